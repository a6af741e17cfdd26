"""Fixtures of the interop suite (``pytest -m interop tests/interop``).

Engine venvs are built on first use under ``$QUANTSPEC_INTEROP_VENVS`` (default
``~/.cache/quantspec/interop-venvs``) and reused; exports of SmolLM2-135M are written once
per session under pytest's tmp dir, or reused from ``$QUANTSPEC_INTEROP_EXPORTS`` when set
(a folder of ``<export name>/`` checkpoints, e.g. the one benchmarks/interop.py fills).
Set ``QUANTSPEC_INTEROP_NO_BUILD=1`` to skip (not build) a missing engine venv.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from interop import exports, venvs

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; a hub probe can hang here


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/interop/" in str(item.fspath).replace(os.sep, "/") and "interop" not in item.keywords:
            item.add_marker(pytest.mark.interop)


@pytest.fixture(scope="session")
def engine_python():
    """engine_python("vllm") -> the engine venv's python (built if needed, else skipped)."""
    no_build = os.environ.get("QUANTSPEC_INTEROP_NO_BUILD", "") in ("1", "true", "yes")

    def get(name: str) -> Path:
        try:
            return venvs.ensure(name, build=not no_build)
        except venvs.VenvError as exc:
            pytest.skip(f"engine venv {name!r} unavailable: {exc}")

    return get


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
                pytest.skip(why)
            made[name] = exports.make_export(name, smollm2_dir, exports_root / name)
        return made[name]

    return get
