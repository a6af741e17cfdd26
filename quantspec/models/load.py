"""One entry point for every model spec: a quantized checkpoint folder or a dense model."""

from __future__ import annotations

from typing import Any

import torch


def load_model(spec: str | None, dtype: str | torch.dtype = "auto", device: str = "cpu", backend: str = "auto"):
    """Load a quantized checkpoint folder (QuantLinear model) or any dense model spec.

    Returns (model, tokenizer, description dict: kind, path, format, backend, dtype, device;
    ``name`` too for a dense model).
    """
    from transformers import AutoTokenizer

    from ..checkpoint.load import is_quantized_folder, load_quantized
    from ..kernels.backend import get_backend
    from . import load_dense

    if backend not in ("auto", "exact"):
        get_backend(backend)  # an unknown name is refused before anything loads, for a dense model too
    if spec is not None and is_quantized_folder(spec):
        model = load_quantized(spec, dtype=dtype, device=device, backend=backend)
        tokenizer = AutoTokenizer.from_pretrained(spec)
        backends = sorted(set(model.quantspec_backends.values()))
        desc = {"kind": "quantized", "path": str(spec), "format": model.quantspec_format,
                "backend": ",".join(backends) or None}
    else:
        model, tokenizer, info = load_dense(spec, dtype=dtype, device=device)
        desc = {"kind": "dense", "path": str(info.path), "name": info.name, "format": None,
                "backend": "torch dense"}
    desc["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    desc["device"] = str(device)
    return model, tokenizer, desc


def model_label(desc: dict[str, Any]) -> str:
    """The short name of a model in reports: a dense model's name, else its path."""
    return desc.get("name") or desc["path"]
