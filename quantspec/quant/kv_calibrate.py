"""Calibrated KV-cache scales: observe keys (after RoPE) and values on calibration text, turn
the maxima into per-layer scales, and name them as checkpoints store them: per attention module
``{block}.{attention}.k_scale`` / ``v_scale`` (``ArchSpec.attention``: ``self_attn`` in most
families), fp32, shape [1] (strategy "tensor", what vLLM reads) or [kv_heads, 1, 1] (strategy
"attn_head"); the config side is ``kv_config.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import QuantspecError, one_line
from ..runtime.kv import cache_kwarg
from ..runtime.kv_quant import KVErrorObserver, KVObserver, scale_errors, scale_multipliers, scales_from_amax
from ..core.kv_config import KVCacheConfig, scale_tensors
from .arch import ArchSpec
from .heap import free_memory_bytes

KEEP_SHARE = 0.25  # of the model's device's free memory: at most this for the kept keys and values of the search samples
KEEP_UNKNOWN_BYTES = 2 << 30  # the same limit where the free memory is unknown

def attention_names(arch: ArchSpec, blocks: list[str]) -> list[str]:
    """``{block}.{arch.attention}`` of every block (the names of its KV scales), or
    QuantspecError when the family's cache holds no per-head keys and values (multi-head latent
    attention) or no attention module was found."""
    if arch.attention is None:
        raise QuantspecError(f"{arch.name}'s attention caches no per-head keys and values that KV-cache scales could "
                             "describe (multi-head latent attention, or no module of a block takes the cache); "
                             "scales are written for MHA/GQA attention only.",
                             "drop --kv-cache for this architecture.")
    return [f"{block}.{arch.attention}" for block in blocks]


def _observe(model: nn.Module, ids: torch.Tensor, make, merge, desc: str, progress: bool, on_sample=None) -> dict:
    """One forward per sample of ``ids`` [n, L] into the cache ``make(j)``; its per-layer
    statistics (``.stats``: layer -> (keys', values')) merged over the samples by ``merge``;
    ``on_sample(j, cache)`` after each forward."""
    from tqdm.auto import tqdm

    kw = cache_kwarg(model)
    device = next(model.parameters()).device
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for j in tqdm(range(ids.shape[0]), disable=not progress, desc=desc, unit="sample"):
            obs = make(j)
            # logits of the last position only: the cache is what is observed, not the output
            try:
                model(input_ids=ids[j : j + 1].to(device), use_cache=True, logits_to_keep=1, **{kw: obs})
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError, IndexError, NotImplementedError) as exc:
                raise QuantspecError(
                    f"{type(model).__name__}'s forward failed on the KV-cache observer ({type(exc).__name__}: "
                    f"{one_line(exc, 200)}): its attention keeps a cache of its own kind (looped or recurrent "
                    "layers), which per-layer KV scales do not describe.", "drop --kv-cache for this model.") from exc
            for layer, (k, v) in obs.stats.items():
                if layer in seen:
                    k, v = merge(seen[layer][0], k), merge(seen[layer][1], v)
                seen[layer] = (k, v)
            if on_sample is not None:
                on_sample(j, obs)
    return seen


def observe_kv(model: nn.Module, ids: torch.Tensor, progress: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, each KV head's max |key| and max |value| over the samples ``ids`` [n, L]."""
    return observe_kv_keeping(model, ids, 0, progress)[0]


def observe_kv_keeping(model: nn.Module, ids: torch.Tensor, keep: int, progress: bool = False,
                       limit_bytes: int | None = None) -> tuple[dict, list[dict] | None]:
    """``observe_kv``, and the keys and values of the first ``keep`` samples (per sample: layer
    -> (keys, values)) for ``errors_of_kept``, so the "mse" rule needs no second forward. None
    instead when they would take more than ``limit_bytes`` (default: ``KEEP_SHARE`` of the free
    memory of the model's device; judged on the first sample), or ``keep`` is 0."""
    kept: list[dict] | None = [] if keep > 0 else None
    if limit_bytes is None and keep > 0:
        free = free_memory_bytes(next(model.parameters()).device)
        limit_bytes = int(KEEP_SHARE * free) if free is not None else KEEP_UNKNOWN_BYTES

    def hold(j: int, obs: KVObserver) -> None:
        nonlocal kept
        if kept is None or j >= keep:
            return
        size = sum(t.numel() * t.element_size() for pair in obs.kept.values() for t in pair)
        if size * min(keep, ids.shape[0]) > limit_bytes:
            kept = None  # too big to hold: the caller runs the second forward
            return
        kept.append(obs.kept)

    amax = _observe(model, ids, lambda j: KVObserver(config=model.config, keep=kept is not None and j < keep),
                    torch.maximum, "kv maxima", progress, hold)
    return amax, kept


def observe_errors(model: nn.Module, ids: torch.Tensor, base: dict[int, tuple[torch.Tensor, torch.Tensor]],
                   kind: str, progress: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the summed squared error [M, H] of the keys and of the values of the samples
    ``ids`` under each scale ``base * scale_multipliers()[m] / top code``."""
    mults = scale_multipliers()
    return _observe(model, ids, lambda j: KVErrorObserver(base, kind, mults, config=model.config), torch.add,
                    "kv scale search", progress)


def errors_of_kept(kept: list[dict], base: dict[int, tuple[torch.Tensor, torch.Tensor]], kind: str
                   ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``observe_errors`` of the samples whose keys and values ``observe_kv_keeping`` kept (the
    same sums, in the same order)."""
    mults = scale_multipliers()
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for sample in kept:
        for layer, (k, v) in sample.items():
            kb, vb = base[layer]
            ek, ev = scale_errors(k, kb, kind, mults).cpu(), scale_errors(v, vb, kind, mults).cpu()
            out[layer] = (out[layer][0] + ek, out[layer][1] + ev) if layer in out else (ek, ev)
    return out


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


def calibrate_checkpoint_kv(folder, ids: torch.Tensor, cfg: KVCacheConfig, attn: list[str],
                            progress: bool = False) -> dict[str, torch.Tensor]:
    """KV scales of the quantized checkpoint in ``folder`` (loaded as engines run it: the
    declared scheme, ``backend="exact"``) observed on the first ``cfg.samples`` rows of ``ids``
    (the "mse" rule then computes the errors around the maxima on the keys and values of the
    first ``cfg.searched``, kept from that pass, or from a second forward where they would not
    fit: ``observe_kv_keeping``); returns the checkpoint tensors. Memory: the whole quantized
    model (not one block), and the kept keys and values."""
    from ..checkpoint.load import load_quantized

    model = load_quantized(folder, backend="exact")
    amax, kept = observe_kv_keeping(model, ids[: cfg.samples], cfg.searched if cfg.rule == "mse" else 0, progress)
    missing = sorted(set(range(len(attn))) - set(amax))
    extra = sorted(set(amax) - set(range(len(attn))))
    if extra:  # HRM runs its blocks again under further cache layers
        raise QuantspecError(f"the model wrote {len(amax)} KV-cache layers for {len(attn)} attention modules "
                             f"(layers {extra[:5]} have no module of their own: blocks run more than once), "
                             "so per-module KV scales cannot describe its cache.", "drop --kv-cache for this model.")
    if missing:
        raise QuantspecError(f"layers {missing[:5]} wrote nothing to the KV cache during calibration.",
                             "drop --kv-cache for this architecture.")
    errors = None
    if cfg.rule == "mse":
        bases = error_bases(amax, cfg.strategy)
        errors = (errors_of_kept(kept, bases, cfg.kind) if kept is not None
                  else observe_errors(model, ids[: cfg.searched], bases, cfg.kind, progress))
    return scale_tensors(kv_scales(amax, cfg, errors), attn)
