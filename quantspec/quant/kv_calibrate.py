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
from ..runtime.kv_quant import KVObserver, scales_from_amax
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


def observe_kv(model: nn.Module, ids: torch.Tensor, progress: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, each KV head's max |key| and max |value| over the samples ``ids`` [n, L]."""
    from tqdm.auto import tqdm

    kw = cache_kwarg(model)
    device = next(model.parameters()).device
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for j in tqdm(range(ids.shape[0]), disable=not progress, desc="kv scales", unit="sample"):
            obs = KVObserver(config=model.config)
            model(input_ids=ids[j : j + 1].to(device), use_cache=True, **{kw: obs})
            for layer, (k, v) in obs.amax.items():
                if layer in seen:
                    k, v = torch.maximum(seen[layer][0], k), torch.maximum(seen[layer][1], v)
                seen[layer] = (k, v)
    return seen


def kv_scales(amax: dict[int, tuple[torch.Tensor, torch.Tensor]], cfg: KVCacheConfig
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale, v_scale): [1] (tensor) or [kv_heads, 1, 1] (head), fp32."""
    out = {}
    for layer, (k, v) in amax.items():
        if cfg.strategy == "tensor":
            k, v = k.amax().reshape(1), v.amax().reshape(1)
        else:
            k, v = k.reshape(-1, 1, 1), v.reshape(-1, 1, 1)
        out[layer] = (scales_from_amax(k, cfg.kind), scales_from_amax(v, cfg.kind))
    return out


def calibrate_checkpoint_kv(folder, ids: torch.Tensor, cfg: KVCacheConfig, blocks: list[str],
                            progress: bool = False) -> dict[str, torch.Tensor]:
    """KV scales of the quantized checkpoint in ``folder`` (loaded as engines run it: the
    declared scheme, ``backend="exact"``) observed on the first ``cfg.samples`` rows of ``ids``;
    returns the checkpoint tensors. Memory: the whole quantized model (not one block)."""
    from ..checkpoint.load import load_quantized

    model = load_quantized(folder, backend="exact")
    attn = attention_names(model, blocks)
    amax = observe_kv(model, ids[: cfg.samples], progress)
    missing = sorted(set(range(len(attn))) - set(amax))
    if missing:
        raise QuantspecError(f"layers {missing[:5]} wrote nothing to the KV cache during calibration.",
                             "drop --kv-cache for this architecture.")
    return scale_tensors(kv_scales(amax, cfg), attn)
