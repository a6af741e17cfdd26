"""Layer probe: an engine's first attention projections (q, k, v of block 0, concatenated as vLLM
fuses them) on the engine's own input, against quantspec's reference on that same input.

Why: end to end, a W8A8 model turns dtype rounding into whole int8 steps over 30 layers, so two
correct runtimes already differ by ~1-3 in log-probability (our own reference, SmolLM2 ct-w8a8:
2.86 bf16 vs fp32, 1.17 fp32 vs fp64), as much as a different activation-scale convention
(absmax / 127.5 instead of / 127: 2.34 in fp32). On one layer with identical inputs, codes and
int32 sums are exact and only the last roundings differ, so the two separate by ~70x.

Noise model (fixed before any engine result is read): the engine and we see the same input
``x``; a correct engine differs from our reference in ``dtype`` at most as our reference in
``dtype`` differs from itself computed in float64 on the same ``x``, times ``PROBE_FACTOR``, and
at least ``MIN_SHARE``. Statistic: the share of outputs more than 2 ulps of ``dtype`` apart
(``probe_stats``); a different activation-scale convention re-rounds every activation code and
moves most outputs by several ulps.
"""

from __future__ import annotations

import functools

import torch

PROBE_PREFIX = "layers.0.self_attn"
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
PROBE_FACTOR = 4.0
MIN_SHARE = 0.01
FP32_UNIT = 2.0**-16  # 128 fp32 ulps; a different activation convention moves outputs ~2**-7.5


@functools.lru_cache(maxsize=4)
def _layers(ckpt: str, dtype: torch.dtype):
    import quantspec

    model = quantspec.load_quantized(ckpt, dtype=dtype, backend="reference")
    attn = model.model.layers[0].self_attn
    return tuple(getattr(attn, p) for p in PROJECTIONS)


@torch.inference_mode()
def our_projection(ckpt, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] -> [T, q + k + v] outputs of block 0's q/k/v through our reference in ``dtype``."""
    return torch.cat([lin(x.to(dtype)) for lin in _layers(str(ckpt), dtype)], dim=-1)


def ulps(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|y - ref| in units in the last place of ``dtype`` at each element of ``ref``, the unit
    at least ``FP32_UNIT`` relative (an fp32 engine rounds a few more times than we do, e.g. an
    int32 sum times two scales in another order, or dequantized weights times fp32 activations:
    measured up to 2**-21 of the largest output); elements smaller than a quarter of the output's
    rms are measured at the ulp of that quarter (sums that cancel to ~0 carry the rounding of
    their larger terms)."""
    ref = ref.double()
    floor = ref.pow(2).mean().sqrt() / 4
    mag = torch.maximum(ref.abs(), floor).clamp(min=torch.finfo(dtype).tiny)
    ulp = max(torch.finfo(dtype).eps, FP32_UNIT) * torch.exp2(torch.floor(torch.log2(mag)))
    return (y.double() - ref).abs() / ulp


def probe_stats(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> dict:
    """``over_2ulp``: the share of outputs more than 2 ulps of ``dtype`` from ``ref`` (a correct
    engine rounds each output once from exact int32 sums or fp32 accumulations: <= 1 ulp but
    where accumulation orders differ); ``mean_rel``: mean |y - ref| / mean |ref|."""
    d = (y.double() - ref.double()).abs()
    return {"over_2ulp": float((ulps(y, ref, dtype) > 2).double().mean()),
            "mean_rel": float(d.mean() / ref.double().abs().mean()),
            "max_rel": float(d.max() / ref.double().abs().max())}


def probe_bound(ckpt, x: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest ``over_2ulp`` a correct engine running ``dtype`` may show on input ``x``:
    ``PROBE_FACTOR`` x our own reference's in ``dtype`` against float64, and at least
    ``MIN_SHARE`` (accumulation-order differences near rounding boundaries)."""
    ours = our_projection(ckpt, x, dtype)
    exact = our_projection(ckpt, x, torch.float64)
    own = probe_stats(ours, exact, dtype)
    return max(PROBE_FACTOR * own["over_2ulp"], MIN_SHARE)


def check_probe(ckpt, x: torch.Tensor, y_engine: torch.Tensor, dtype: torch.dtype) -> dict:
    """Bound first, then the engine's statistic against our reference in ``dtype``."""
    bound = probe_bound(ckpt, x, dtype)
    stats = probe_stats(y_engine, our_projection(ckpt, x, dtype), dtype)
    return {**stats, "bound": bound, "ok": stats["over_2ulp"] <= bound}
