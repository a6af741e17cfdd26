"""Small helpers shared by the subcommands."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, p)


def load_any(spec: str | None, dtype: str = "auto", device: str = "cpu", backend: str = "auto"):
    """Load a quantized checkpoint folder or a dense model; returns (model, tokenizer, label)."""
    from transformers import AutoTokenizer

    from ..checkpoint.load import is_quantized_folder, load_quantized

    if spec is not None and is_quantized_folder(spec):
        model = load_quantized(spec, dtype=dtype, device=device, backend=backend)
        tokenizer = AutoTokenizer.from_pretrained(spec)
        return model, tokenizer, str(spec)
    from ..models import load_dense

    model, tokenizer, info = load_dense(spec, dtype=dtype, device=device)
    return model, tokenizer, info.name
