"""Session fixtures for real assets: a dense SmolLM2-135M folder and the shared data folder.

When an asset is absent the test is skipped with the reason, or failed when the environment
sets QUANTSPEC_REQUIRE_ASSETS=1 (CI that must exercise the real model): ``helpers.missing_asset``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so tests can `import helpers`

from helpers import missing_asset  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Dense HF folder of SmolLM2-135M-Instruct (cached dequantized GGUF, or the hub snapshot)."""
    from quantspec.errors import QuantspecError
    from quantspec.models import dense_folder

    try:
        return dense_folder("smollm2-135m")
    except QuantspecError as exc:
        missing_asset(f"SmolLM2-135M not available: {exc}")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Folder of local dataset copies: $QUANTSPEC_DATA, else <repo>/../shared/data."""
    env = os.environ.get("QUANTSPEC_DATA")
    path = Path(env).expanduser() if env else REPO.parent / "shared" / "data"
    if not (path / "wikitext2" / "wikitext-2-raw-v1.test.txt").is_file():
        missing_asset(f"data folder {path} has no wikitext2/wikitext-2-raw-v1.test.txt (set QUANTSPEC_DATA)")
    return path


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine: more threads only add contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
