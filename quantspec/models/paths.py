"""Where quantspec keeps its caches (all overridable by environment variables).

- ``QUANTSPEC_CACHE``  (default ``~/.cache/quantspec``): dense model copies, token-id caches.
- ``QUANTSPEC_MODELS`` (default ``~/.cache/quantspec-assets``): downloaded GGUF assets, in the
  layout of ``shared/tools/fetch-model`` (``<alias>/<file>.gguf``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Root of quantspec's own cache (not created here)."""
    env = os.environ.get("QUANTSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantspec"


def assets_root() -> Path:
    """Root of the GGUF asset cache shared with ``fetch-model`` (not created here)."""
    env = os.environ.get("QUANTSPEC_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantspec-assets"
