"""Calibrated KV-cache scales: observe keys (after RoPE) and values on calibration text, turn
the maxima into per-layer scales, and name them as checkpoints store them: per attention module
``{block}.self_attn.k_scale`` / ``v_scale``, fp32, shape [1] (strategy "tensor", what vLLM
reads) or [kv_heads, 1, 1] (strategy "attn_head"); the config side is ``kv_config.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import QuantspecError
from ..runtime.kv import cache_kwarg
from ..runtime.kv_quant import KVErrorObserver, KVObserver, scale_multipliers, scales_from_amax
from ..core.kv_config import KVCacheConfig, scale_tensors

def attention_names(model: nn.Module, blocks: list[str]) -> list[str]:
    """``{block}.self_attn`` of every block, or QuantspecError when a block has no attention
    module with separate k_proj / v_proj (e.g. multi-head latent attention)."""
    names = []
    for block in blocks:
        name = f"{block}.self_attn"
        try:
            attn = model.get_submodule(name)
        except AttributeError:
            attn = None
        if attn is None or not all(isinstance(getattr(attn, p, None), nn.Module) for p in ("k_proj", "v_proj")):
            raise QuantspecError(f"{name} is not an attention module with k_proj and v_proj; KV-cache scales "
                                 "are written for standard (GQA/MHA) attention only.",
                                 "drop --kv-cache for this architecture.")
        names.append(name)
    return names


def _observe(model: nn.Module, ids: torch.Tensor, make, merge, desc: str, progress: bool) -> dict:
    """One forward per sample of ``ids`` [n, L] into the cache ``make()``; its per-layer
    statistics (``.stats``: layer -> (keys', values')) merged over the samples by ``merge``."""
    from tqdm.auto import tqdm

    kw = cache_kwarg(model)
    device = next(model.parameters()).device
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for j in tqdm(range(ids.shape[0]), disable=not progress, desc=desc, unit="sample"):
            obs = make()
            # logits of the last position only: the cache is what is observed, not the output
            model(input_ids=ids[j : j + 1].to(device), use_cache=True, logits_to_keep=1, **{kw: obs})
            for layer, (k, v) in obs.stats.items():
                if layer in seen:
                    k, v = merge(seen[layer][0], k), merge(seen[layer][1], v)
                seen[layer] = (k, v)
    return seen


def observe_kv(model: nn.Module, ids: torch.Tensor, progress: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, each KV head's max |key| and max |value| over the samples ``ids`` [n, L]."""
    return _observe(model, ids, lambda: KVObserver(config=model.config), torch.maximum, "kv maxima", progress)


def observe_errors(model: nn.Module, ids: torch.Tensor, base: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   kind: str, progress: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the summed squared error [M, H] of the keys and of the values of the samples
    ``ids`` under each scale ``base * scale_multipliers()[m] / top code``."""
    mults = scale_multipliers()
    return _observe(model, ids, lambda: KVErrorObserver(base, kind, mults, config=model.config), torch.add,
                    "kv scale search", progress)


def error_bases(amax: dict[int, tuple[torch.Tensor, torch.Tensor]], strategy: str
                ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The amax each head's candidate scales of ``observe_errors`` are multiples of: its own
    ("head"), or the layer's max over heads ("tensor")."""
    if strategy == "head":
        return amax
    return {i: (k.amax().expand_as(k), v.amax().expand_as(v)) for i, (k, v) in amax.items()}


def kv_scales(amax: dict[int, tuple[torch.Tensor, torch.Tensor]], cfg: KVCacheConfig,
              errors: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale, v_scale): [1] (tensor) or [kv_heads, 1, 1] (head), fp32. The "amax"
    rule: amax / top code. The "mse" rule needs ``errors`` (``observe_errors`` around
    ``error_bases(amax, cfg.strategy)``): each scale is the amax one times the multiplier of least
    error (summed over the heads for "tensor"; the amax scale itself on a tie)."""
    if cfg.rule == "mse" and errors is None:
        raise QuantspecError("the mse KV scale rule needs the squared errors of its candidate scales.",
                             "pass observe_errors(...) as errors, or use scale_rule='amax'.")
    errors = errors if cfg.rule == "mse" else None
    mults = scale_multipliers()
    one = int((mults == 1).nonzero())
    out = {}
    for layer, pair in amax.items():
        picked = []
        for which, a in enumerate(pair):
            a = a.amax().reshape(1) if cfg.strategy == "tensor" else a.reshape(-1)
            if errors is not None:
                err = errors[layer][which]
                err = err.sum(1, keepdim=True) if cfg.strategy == "tensor" else err  # [M, 1 or H]
                best = torch.where(err[one] <= err.min(0).values, one, err.argmin(0))
                a = a * mults[best]
            s = scales_from_amax(a, cfg.kind)
            picked.append(s if cfg.strategy == "tensor" else s.reshape(-1, 1, 1))
        out[layer] = (picked[0], picked[1])
    return out


def calibrate_checkpoint_kv(folder, ids: torch.Tensor, cfg: KVCacheConfig, blocks: list[str],
                            progress: bool = False) -> dict[str, torch.Tensor]:
    """KV scales of the quantized checkpoint in ``folder`` (loaded as engines run it: the
    declared scheme, ``backend="exact"``) observed on the first ``cfg.samples`` rows of ``ids``
    (the "mse" rule then reads the first ``cfg.searched`` again for the errors around the maxima); returns the checkpoint
    tensors. Memory: the whole quantized model (not one block)."""
    from ..checkpoint.load import load_quantized

    model = load_quantized(folder, backend="exact")
    attn = attention_names(model, blocks)
    amax = observe_kv(model, ids[: cfg.samples], progress)
    missing = sorted(set(range(len(attn))) - set(amax))
    if missing:
        raise QuantspecError(f"layers {missing[:5]} wrote nothing to the KV cache during calibration.",
                             "drop --kv-cache for this architecture.")
    errors = None
    if cfg.rule == "mse":
        errors = observe_errors(model, ids[: cfg.searched], error_bases(amax, cfg.strategy), cfg.kind, progress)
    return scale_tensors(kv_scales(amax, cfg, errors), attn)
