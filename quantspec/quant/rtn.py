"""Round-to-nearest (RTN): the baseline, and the grid helpers every algorithm shares.

Pure tensor functions. ``qparams`` finds the scale (and zero) of a group of columns from its
min/max, ``quantize_codes`` maps weights to codes on a given grid, ``rtn`` does both for a
whole [N, K] weight.
"""

from __future__ import annotations

import torch

from .floatgrid import rtn_float
from ..core.scheme import QuantResult, QuantScheme


def qparams(
    w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero of each row of ``w`` ([N, C] -> [N], [N] or None), from min/max.

    Symmetric: ``scale = 2 * max|w| / maxq`` with the implicit zero ``2**(bits-1)`` (GPTQ's
    convention). Asymmetric: ``scale = (max - min) / maxq``, ``zero = round(-min / scale)``,
    kept >= 1 (see below).
    Scales are rounded to ``scale_dtype`` (the stored dtype) before they are returned.
    """
    w = w.to(torch.float32)
    wmin = w.amin(dim=1).clamp(max=0)
    wmax = w.amax(dim=1).clamp(min=0)
    if scheme.symmetric:
        amax = torch.maximum(wmin.abs(), wmax)
        scale = 2 * amax / scheme.maxq
    else:
        scale = (wmax - wmin) / scheme.maxq
        # Zero points stay >= 1: GPTQ v1 stores zero - 1 and cannot hold zero = 0. A group
        # with no negative weight spends its lowest code instead: scale = max / (maxq - 1).
        low = torch.round(-wmin / scale.clamp(min=1e-30)) < 1
        scale = torch.where(low, wmax / (scheme.maxq - 1), scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(scale_dtype).to(torch.float32)
    # fp16 may round a tiny scale down to zero: keep the smallest normal number instead.
    tiny = torch.finfo(scale_dtype).tiny
    scale = scale.clamp(min=tiny)
    if scheme.symmetric:
        return scale.to(scale_dtype), None
    zero = torch.round(-wmin / scale).clamp(1, scheme.maxq)
    return scale.to(scale_dtype), zero.to(torch.uint8)


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Codes of ``w`` ([N, C]) on the grid (scale, zero) given per row ([N]) -> uint8 [N, C]."""
    s = scale.to(torch.float32).unsqueeze(1)
    z = float(scheme.sym_zero) if zero is None else zero.to(torch.float32).unsqueeze(1)
    q = torch.round(w.to(torch.float32) / s) + z
    return q.clamp(0, scheme.maxq).to(torch.uint8)


def dequantize_codes(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Inverse of ``quantize_codes`` (fp32)."""
    s = scale.to(torch.float32).unsqueeze(1)
    z = float(scheme.sym_zero) if zero is None else zero.to(torch.float32).unsqueeze(1)
    return (q.to(torch.float32) - z) * s


def rtn(
    weight: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype = torch.float16,
    gscale: torch.Tensor | None = None,
) -> QuantResult:
    """Round-to-nearest quantization of a [N, K] weight, group by group along K.

    A last group shorter than ``group_size`` (K not divisible) is quantized on its own; whether
    a format can store it is the format's question, not the algorithm's. Float schemes (FP8,
    FP4) round onto their grids (``floatgrid.rtn_float``; their scales ignore ``scale_dtype``;
    NVFP4 under ``gscale`` when given).
    """
    if scheme.is_float:
        return rtn_float(weight, scheme, gscale)
    n, k = weight.shape
    glen = scheme.group_len(k)
    full = (k // glen) * glen
    codes, scales, zeros = [], [], []
    # whole groups at once as rows of [N * G, glen]; a shorter last group on its own
    for lo, hi, width in ((0, full, glen), (full, k, k - full)):
        if hi <= lo:
            continue
        block = weight[:, lo:hi].reshape(-1, width)
        s, z = qparams(block, scheme, scale_dtype)
        codes.append(quantize_codes(block, s, z, scheme).reshape(n, hi - lo))
        scales.append(s.reshape(n, -1))
        zeros.append(None if z is None else z.reshape(n, -1))
    return QuantResult(
        qweight=torch.cat(codes, dim=1),
        scales=torch.cat(scales, dim=1),
        zeros=None if scheme.symmetric else torch.cat(zeros, dim=1),  # type: ignore[arg-type]
        g_idx=None,
        scheme=scheme,
    )
