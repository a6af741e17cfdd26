"""The KV-cache setting of a recipe and of a checkpoint: ``KVCacheConfig`` and compressed-tensors'
``kv_cache_scheme`` (written, and read back), as vLLM reads it: {num_bits 8, type float|int,
symmetric, strategy tensor|attn_head, dynamic false}, with per-layer ``k_scale`` / ``v_scale``
tensors (``kv_calibrate.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import QuantspecError
from ..strict import config_value

KV_MAX = {"fp8": 448.0, "int8": 127.0}  # the top code of each KV kind
KV_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}
KV_SCALE_RULES = ("auto", "mse", "amax")  # the first is the default (docs/decisions/kv-scale-rule.md)
AUTO_KV_SCALE_RULE = {"fp8": "mse", "int8": "amax"}  # what "auto" is per kind, chosen on a validation split


@dataclass(frozen=True)
class KVCacheConfig:
    """A recipe's ``kv_cache``: kind "fp8" or "int8"; strategy "tensor" (one scale per layer
    for keys and one for values) or "head" (one per KV head); samples: calibration samples
    observed (the first ones of the recipe's calibration draw); scale_rule: "amax" (the
    observed max lands on the top code), "mse" (of the multiples 2**(j/64), j = -64..64, of
    that scale, the one with the smallest squared error of the observed keys / values, computed
    after the maxima on the search samples' keys and values) or "auto" (the default: mse for fp8, amax for int8; ``rule``). The
    rule is how the scales were found, not part of the format. search_samples: the mse rule's
    errors are of the first this many samples only (None: all ``samples``); 8 by default,
    chosen on a validation split (docs/decisions/kv-scale-rule.md, "Search samples")."""

    kind: str = "fp8"
    strategy: str = "tensor"
    samples: int = 32
    scale_rule: str = KV_SCALE_RULES[0]
    search_samples: int | None = 8

    def __post_init__(self) -> None:
        if self.kind not in KV_MAX:
            raise QuantspecError(f"kv_cache kind {self.kind!r} is not supported.", f"use one of {list(KV_MAX)}.")
        if self.strategy not in KV_STRATEGIES:
            raise QuantspecError(f"kv_cache strategy {self.strategy!r} is unknown.",
                                 f"use one of {list(KV_STRATEGIES)}.")
        if self.scale_rule not in KV_SCALE_RULES:
            raise QuantspecError(f"kv_cache scale_rule {self.scale_rule!r} is unknown.",
                                 f"use one of {list(KV_SCALE_RULES)}.")
        if self.samples < 1:
            raise QuantspecError(f"kv_cache samples must be >= 1, got {self.samples}.", "use e.g. 32.")
        if self.search_samples is not None and self.search_samples < 1:
            raise QuantspecError(f"kv_cache search_samples must be >= 1, got {self.search_samples}.",
                                 "use e.g. 8, or leave it out to search on every sample.")

    @property
    def searched(self) -> int:
        """How many samples the mse rule's error pass reads."""
        return self.samples if self.search_samples is None else min(self.search_samples, self.samples)

    @property
    def rule(self) -> str:
        """The scale rule that runs: "amax" or "mse" ("auto" resolved for the kind)."""
        return AUTO_KV_SCALE_RULE[self.kind] if self.scale_rule == "auto" else self.scale_rule


def kv_cache_scheme(cfg: KVCacheConfig) -> dict:
    return {"num_bits": 8, "type": "float" if cfg.kind == "fp8" else "int", "symmetric": True,
            "group_size": None, "strategy": KV_STRATEGIES[cfg.strategy], "dynamic": False}


def parse_kv_cache_scheme(scheme: dict) -> KVCacheConfig:
    """The KVCacheConfig of a checkpoint's ``kv_cache_scheme``; QuantspecError for what we
    cannot run (dynamic or asymmetric KV quantization, other widths)."""
    where = "kv_cache_scheme"
    kind = {"float": "fp8", "int": "int8"}.get(str(scheme.get("type", "")).lower())
    strategy = {v: k for k, v in KV_STRATEGIES.items()}.get(str(scheme.get("strategy", "tensor")).lower())
    if (kind is None or strategy is None or config_value(scheme, "num_bits", int, 0, where) != 8
            or config_value(scheme, "dynamic", bool | str, False, where)
            or not config_value(scheme, "symmetric", bool, True, where)):
        raise QuantspecError(f"kv_cache_scheme {scheme} is not supported.",
                             "quantspec runs static, symmetric 8-bit KV scales (fp8 or int8) per tensor or head.")
    return KVCacheConfig(kind=kind, strategy=strategy)


def scale_tensors(scales: dict[int, tuple[torch.Tensor, torch.Tensor]], attn: list[str]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors ``{attn}.k_scale`` / ``v_scale`` of each layer."""
    out = {}
    for layer, (k, v) in scales.items():
        out[f"{attn[layer]}.k_scale"] = k.float().contiguous()
        out[f"{attn[layer]}.v_scale"] = v.float().contiguous()
    return out


def scales_from_tensors(tensors: dict[str, torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of ``scale_tensors``, as QuantKVCache takes them (scalars or [kv_heads]): the
    layer of ``...layers.{i}.{attention}.k_scale`` is i (its attention's ``layer_idx``)."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(?:.*\.)?(\d+)\.[^.]+\.([kv])_scale", name)
        if m is None:
            raise QuantspecError(f"KV-cache scale {name} is not under a block's attention module.",
                                 "rewrite the checkpoint.")
        found.setdefault(int(m.group(1)), {})[m.group(2)] = t.float().reshape(-1)
    if not found or sorted(found) != list(range(len(found))) or any(len(kv) != 2 for kv in found.values()):
        raise QuantspecError(f"the checkpoint declares a kv_cache_scheme but its k_scale / v_scale tensors do not "
                             f"cover every layer once (layers {sorted(found)[:8]}).",
                             "requantize with --kv-cache, or remove kv_cache_scheme from config.json.")
    return {layer: (kv["k"], kv["v"]) for layer, kv in found.items()}
