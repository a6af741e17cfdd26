"""Describe a quantized checkpoint without loading its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..formats.overrides import read_with_overrides
from ..kernels.backend import backend_reasons, choose_backend
from ..kernels.quant_linear import QuantLinear
from .load import quantized_skeleton, read_config
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
    model, _, swapped = quantized_skeleton(cfg, fmt, fcfg, reader, dt)
    swapped = set(swapped)
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
                "scheme": mod.scheme.short_name,
                "symmetric": mod.scheme.symmetric,
                "act_order": mod.scheme.act_order,
                "shape": [mod.out_features, mod.in_features],
                "backend": backend.name,
                "backend_reason": why,
                "backends": backend_reasons(mod.scheme, mod.out_features, mod.in_features, dev, dt),
            }
        elif isinstance(mod, torch.nn.Linear) and name not in swapped:
            reason = report.get("dense_layers", {}).get(name) or (
                "ignored by the format's config" if name in fcfg.ignore else "stored dense"
            )
            layers[name] = {"dense": True, "reason": reason, "shape": [mod.out_features, mod.in_features]}
    for name, reason in report.get("dense_layers", {}).items():  # routers, fused experts: not Linears
        layers.setdefault(name, {"dense": True, "reason": reason})
    return {
        "path": str(path),
        "format": fmt.name,
        "scheme": fcfg.scheme.to_dict(),
        "model_type": cfg.get("model_type"),
        "size_bytes": folder_size_bytes(path),
        "quantized_layers": len(swapped),
        "dense_layers": sorted(n for n, v in layers.items() if v.get("dense")),
        "layers": layers,
        "experts": experts_summary(model, swapped),
        "method": report.get("method"),
        "quantize_seconds": report.get("quantize_seconds"),
        "kv_cache": _kv_summary(fcfg.extra.get("kv_cache"), reader),
    }


def _kv_summary(kv, reader: CheckpointReader) -> dict | None:
    """The checkpoint's KV-cache setting and the range of its k/v scales (None without)."""
    from safetensors import safe_open

    if kv is None:
        return None
    scales: dict[str, list[float]] = {"k_scale": [], "v_scale": []}
    for key in sorted(k for k in reader.keys() if k.endswith((".k_scale", ".v_scale"))):
        with safe_open(str(reader.file_of(key)), framework="pt") as h:
            scales[key.rsplit(".", 1)[1]].append(float(h.get_tensor(key).float().max()))
    return {"kind": kv.kind, "strategy": kv.strategy, "layers": len(scales["k_scale"]),
            **{f"max_{n}": max(v, default=None) for n, v in scales.items()},
            **{f"min_{n}": min(v, default=None) for n, v in scales.items()}}


def experts_summary(model: torch.nn.Module, swapped: set[str]) -> dict[str, dict]:
    """Per MoE block's experts module: how many experts, how many with every Linear quantized,
    and the experts left (partly) dense."""
    from ..models.experts import experts_modules

    out = {}
    for name, experts in experts_modules(model).items():
        dense = [e for e, mlp in enumerate(experts) if any(f"{name}.{e}.{n}" not in swapped for n in mlp.names)]
        out[name] = {"experts": len(experts), "quantized": len(experts) - len(dense), "dense_experts": dense}
    return out
