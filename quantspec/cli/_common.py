"""Small helpers shared by the subcommands."""

from __future__ import annotations

import json
import os
from typing import Any

from ..checkpoint.atomic import atomic_write_text


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def load_any(spec: str | None, dtype: str = "auto", device: str = "cpu", backend: str = "auto"):
    """Load a quantized checkpoint folder or a dense model; returns (model, tokenizer, label)."""
    from ..checkpoint.load import load_model

    model, tokenizer, desc = load_model(spec, dtype=dtype, device=device, backend=backend)
    return model, tokenizer, desc.get("name") or desc["path"]
