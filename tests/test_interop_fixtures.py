"""The interop suite's engine-venv fixture (tests/interop/conftest.py), in the default run: an
engine venv that cannot be had skips the test, and fails it under QUANTSPEC_REQUIRE_ASSETS=1.

No engine is built or started: ``venvs.ensure`` runs for real in an empty venv root, with its
command runner replaced by one that fails as a pip install without network would.
"""

from __future__ import annotations

import pytest

from interop import venvs
from interop.conftest import engine_venv

OUTCOME = {"": pytest.skip.Exception, "1": pytest.fail.Exception}


@pytest.fixture
def empty_venv_root(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTSPEC_INTEROP_VENVS", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("require", sorted(OUTCOME))
def test_failed_venv_build(empty_venv_root, monkeypatch, require):
    def failing_run(cmd, log):
        raise venvs.VenvError(f"command failed (1): {' '.join(cmd)}; see {log.name}")

    monkeypatch.setattr(venvs, "_run", failing_run)
    monkeypatch.setenv("QUANTSPEC_REQUIRE_ASSETS", require)
    with pytest.raises(OUTCOME[require], match=r"engine venv 'vllm' unavailable: command failed"):
        engine_venv("vllm", build=True)
    assert not venvs.is_ready("vllm")


@pytest.mark.parametrize("require", sorted(OUTCOME))
def test_unbuilt_venv_without_building(empty_venv_root, monkeypatch, require):
    """QUANTSPEC_INTEROP_NO_BUILD=1 (build=False) with no venv built."""
    monkeypatch.setenv("QUANTSPEC_REQUIRE_ASSETS", require)
    with pytest.raises(OUTCOME[require], match=r"engine venv 'gptqmodel' unavailable: .* is not built"):
        engine_venv("gptqmodel", build=False)


def test_built_venv_is_returned(empty_venv_root, monkeypatch):
    monkeypatch.setenv("QUANTSPEC_REQUIRE_ASSETS", "1")
    assert engine_venv("vllm", build=True, ensure=lambda name, build: venvs.python_of(name)) == (
        empty_venv_root / "vllm" / "bin" / "python")
