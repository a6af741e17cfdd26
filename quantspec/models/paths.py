"""Where quantspec keeps its caches (all overridable by environment variables).

- ``QUANTSPEC_CACHE``  (default ``~/.cache/quantspec``): dense model copies, token-id caches,
  builds of the CPU extension (``ext/``).
- ``QUANTSPEC_MODELS`` (default ``~/.cache/quantspec-assets``): downloaded GGUF assets, in the
  layout of ``shared/tools/fetch-model`` (``<alias>/<file>.gguf``).
"""

from __future__ import annotations

import os
from pathlib import Path


def _env_dir(var: str, default_name: str) -> Path:
    """``$var`` (``~`` expanded) when set and not empty, else ``~/.cache/<default_name>``."""
    env = os.environ.get(var)
    return Path(env).expanduser() if env else Path.home() / ".cache" / default_name


def cache_root() -> Path:
    """Root of quantspec's own cache (not created here): dense model copies, token ids, the
    CPU extension's builds."""
    return _env_dir("QUANTSPEC_CACHE", "quantspec")


def assets_root() -> Path:
    """Root of the GGUF asset cache shared with ``fetch-model`` (not created here)."""
    return _env_dir("QUANTSPEC_MODELS", "quantspec-assets")
