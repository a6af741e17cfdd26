"""Cheap, fast checks for whether the Hugging Face hub can be used at all.

The point is to fail in milliseconds on a machine without internet instead of letting
``huggingface_hub`` retry for minutes. Nothing here is cached in a global: each call checks.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

_TRUTHY = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when the user asked for offline mode (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    return any(
        os.environ.get(var, "").strip().lower() in _TRUTHY
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def hub_endpoint() -> str:
    """The hub URL in use (``HF_ENDPOINT`` or https://huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds.

    Returns False at once in offline mode. A DNS failure returns in milliseconds; a
    black-holed network costs at most ``timeout`` seconds.
    """
    if hub_offline():
        return False
    url = urlparse(hub_endpoint())
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
