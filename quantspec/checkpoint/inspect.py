"""Describe a quantized checkpoint without loading its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..formats.overrides import read_with_overrides
from ..kernels.backend import choose_backend
from ..kernels.quant_linear import QuantLinear
from .load import _empty_model, _swap_quantized_linears, read_config
from .reader import CheckpointReader
from .save import folder_size_bytes


def inspect_checkpoint(path: str | Path, device: str = "cpu", dtype: str = "auto") -> dict:
    """Scheme, format, per-layer bits/group size and backend, dense layers and why, size."""
    from ..models import resolve_dtype

    path = Path(path)
    cfg = read_config(path)
    if "quantization_config" not in cfg:
        from ..errors import QuantspecError

        raise QuantspecError(f"{path} is not a quantized checkpoint (no quantization_config).",
                             "run `quantspec quantize` first.")
    fmt, fcfg = read_with_overrides(cfg["quantization_config"])
    dev = torch.device(device)
    dt = resolve_dtype(dtype, dev)
    reader = CheckpointReader(path)
    model = _empty_model(cfg, dt)
    swapped = set(_swap_quantized_linears(model, fcfg, fmt, reader.keys(), dt))
    report = {}
    rp = path / "quant_report.json"
    if rp.is_file():
        report = json.loads(rp.read_text())
    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            backend, why = choose_backend(mod.scheme, mod.out_features, mod.in_features, dev, dt)
            layers[name] = {
                "bits": mod.scheme.bits,
                "group_size": mod.scheme.group_size,
                "symmetric": mod.scheme.symmetric,
                "act_order": mod.scheme.act_order,
                "shape": [mod.out_features, mod.in_features],
                "backend": backend.name,
                "backend_reason": why,
            }
        elif isinstance(mod, torch.nn.Linear) and name not in swapped:
            reason = report.get("dense_layers", {}).get(name) or (
                "ignored by the format's config" if name in fcfg.ignore else "stored dense"
            )
            layers[name] = {"dense": True, "reason": reason, "shape": [mod.out_features, mod.in_features]}
    return {
        "path": str(path),
        "format": fmt.name,
        "scheme": fcfg.scheme.to_dict(),
        "model_type": cfg.get("model_type"),
        "size_bytes": folder_size_bytes(path),
        "quantized_layers": len(swapped),
        "dense_layers": sorted(n for n, v in layers.items() if v.get("dense")),
        "layers": layers,
        "method": report.get("method"),
        "quantize_seconds": report.get("quantize_seconds"),
    }
