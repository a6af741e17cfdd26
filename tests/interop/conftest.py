"""Fixtures of the interop suite (``pytest -m interop tests/interop``).

Engine venvs are built on first use under ``$QUANTSPEC_INTEROP_VENVS`` (default
``~/.cache/quantspec/interop-venvs``) and reused; exports of SmolLM2-135M are written once
per session under pytest's tmp dir, or reused from ``$QUANTSPEC_INTEROP_EXPORTS`` when set
(a folder of ``<export name>/`` checkpoints, e.g. the one benchmarks/interop.py fills).
Set ``QUANTSPEC_INTEROP_NO_BUILD=1`` to skip (not build) a missing engine venv.

An engine venv that cannot be built (or whose engine does not import after the build), an
unbuilt one under NO_BUILD, or a quantspec method that cannot run skips the test with the
reason, and fails it under ``QUANTSPEC_REQUIRE_ASSETS=1`` (``helpers.missing_asset``): a run
that must exercise the engines never passes by skipping them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import missing_asset
from interop import exports, venvs

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; a hub probe can hang here


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/interop/" in str(item.fspath).replace(os.sep, "/") and "interop" not in item.keywords:
            item.add_marker(pytest.mark.interop)


def engine_venv(name: str, *, build: bool, ensure=venvs.ensure) -> Path:
    """The python of engine venv ``name`` (``ensure``: ``venvs.ensure``); when it cannot be had,
    the test is skipped, or failed under QUANTSPEC_REQUIRE_ASSETS=1."""
    try:
        return ensure(name, build=build)
    except venvs.VenvError as exc:
        missing_asset(f"engine venv {name!r} unavailable: {exc}")


@pytest.fixture(scope="session")
def engine_python():
    """engine_python("vllm") -> the engine venv's python (built if needed; see ``engine_venv``)."""
    no_build = os.environ.get("QUANTSPEC_INTEROP_NO_BUILD", "") in ("1", "true", "yes")
    return lambda name: engine_venv(name, build=not no_build)


@pytest.fixture(scope="session")
def exports_root(tmp_path_factory) -> Path:
    env = os.environ.get("QUANTSPEC_INTEROP_EXPORTS")
    return Path(env).expanduser() if env else tmp_path_factory.mktemp("interop-exports")


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_dir):
    return exports.prompt_ids(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_export(smollm2_dir, exports_root):
    """smollm2_export("gptq-w4g128-sym") -> checkpoint folder (written once per session)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            rk, _ = exports.EXPORTS[name]
            why = exports.method_available(rk["method"])
            if why:
                missing_asset(why)
            made[name] = exports.make_export(name, smollm2_dir, exports_root / name)
        return made[name]

    return get
