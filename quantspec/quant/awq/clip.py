"""Weight clipping for AWQ (the paper's auto_clip) and the RTN fake quantization the searches
score with. Pure tensor functions.

Per output row and quantization group, the max |w| shrinks by ``1 - i/grid`` for i < grid/2
(``clip_error_curve``); ``pick_clip`` keeps the candidate with the least output error on a
token sample where it lowers the unclipped error by more than ``min_gain``. Why the defaults
(``CLIP_SKIP``, ``CLIP_AUTO_MAX_BITS``, ``AWQOptions.clip_min_gain``) are what they are:
docs/decisions/awq-defaults.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..floatgrid import fake_quantize_blocks, fake_quantize_groups, global_scale
from ..rtn import dequantize_codes, qparams, quantize_codes, rtn
from ...core.scheme import QuantResult, QuantScheme

# Linear names (suffixes) never clip-searched. None: on the validation split (C4 documents outside
# the calibration draw; docs/decisions/awq-defaults.md) clipping q/k too was better on both models
# measured (the clip rule alone on the same scales, q/k clipped vs not: SmolLM2-135M W3 g64 48.392
# vs 49.105, Qwen2.5-Coder-0.5B W3 g128 46.257 vs 47.471), although the reference implementation
# skips the Linears that feed attention scores.
CLIP_SKIP: tuple[str, ...] = ()
# Clipping by default only up to this many bits (0: never); a recipe can turn it on or off. 3: on
# the validation split (docs/decisions/awq-defaults.md) clips at W4 helped SmolLM2-135M W4 g64
# (whole pipeline 28.246 vs 28.591 unclipped) and hurt Qwen2.5-Coder-0.5B W4 g128 (36.233 vs
# 36.024); the larger model decides, as for ``clip_min_gain``. W3 gains on both.
CLIP_AUTO_MAX_BITS = 3


def grouped(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """fp32 [N, K] -> [N, G, L] (L = group length), a partial last group padded with zeros.

    Zero padding changes no group's grid: ``qparams`` takes min over values <= 0 and max over
    values >= 0, and a zero column adds nothing to any output.
    """
    n, k = weight.shape
    glen = scheme.group_len(k)
    g = scheme.num_groups(k)
    w = weight.to(torch.float32)
    if g * glen != k:
        w = torch.nn.functional.pad(w, (0, g * glen - k))
    return w.reshape(n, g, glen)


def _fake_quantize_rows(w: torch.Tensor, scheme: QuantScheme, gscale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize each row of [R, L] on its own min/max grid (fp32); float schemes on
    their grid with the row's scale (NVFP4: under the tensor's global scale ``gscale``)."""
    if scheme.is_float:
        return fake_quantize_groups(w, scheme, gscale)
    s, z = qparams(w, scheme)
    return dequantize_codes(quantize_codes(w, s, z, scheme), s, z, scheme)


def _global_scale(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor | None:
    return global_scale(weight.float()) if scheme.weights == "nvfp4" else None


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN quantize-dequantize of [N, K] (fp32 out), equal to ``rtn(w).dequantize()``;
    a partial last group is quantized on its own. FP8 block weights share a scale across 128
    rows, so they are quantized as a whole (K a multiple of 128)."""
    if scheme.is_block:
        return fake_quantize_blocks(weight, scheme.group_size)
    n, k = weight.shape
    w = grouped(weight, scheme)
    q = _fake_quantize_rows(w.reshape(-1, w.shape[-1]), scheme, _global_scale(weight, scheme)).reshape(w.shape)
    return q.reshape(n, -1)[:, :k]


def clip_error_curve(
    weight: torch.Tensor,
    x: torch.Tensor,
    scheme: QuantScheme,
    grid: int = 20,
    max_shrink: float = 0.5,
    row_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (row, group)'s output error at every clip candidate: (errors [S, N, G], amax [N, G]).

    weight [N, K], x [T, K] sample of its inputs. Candidate ``i < S = max_shrink * grid`` clips
    the group to ``amax * (1 - i/grid)``; error ``mean_t (x_g . (w_g - Q(clip(w_g))))^2`` (fp32;
    G = number of groups, a partial last group included). Step 0 is the unclipped group.
    """
    if scheme.is_block:  # a row's clip would move the scale of its 127 block neighbours too
        raise ValueError("AWQ clip search scores rows on their own scales; fp8 block weights share them")
    xg = grouped(x.detach(), scheme).permute(1, 0, 2)  # [G, T, L]
    gscale = _global_scale(weight, scheme)  # NVFP4: the unclipped tensor's
    steps = max(1, int(max_shrink * grid))
    errs, amaxes = [], []
    for r0 in range(0, weight.shape[0], row_chunk):
        w = grouped(weight.detach()[r0 : r0 + row_chunk], scheme)  # [n', G, L]
        amax = w.abs().amax(dim=2).clamp(min=1e-8)  # [n', G]
        rows = []
        for i in range(steps):
            m = (amax * (1 - i / grid)).unsqueeze(2)
            wc = torch.maximum(torch.minimum(w, m), -m)
            q = _fake_quantize_rows(wc.reshape(-1, w.shape[2]), scheme, gscale).reshape(w.shape)
            rows.append(torch.bmm(xg, (w - q).permute(1, 2, 0)).pow(2).mean(dim=1).T)  # [n', G]
        errs.append(torch.stack(rows))
        amaxes.append(amax)
    return torch.cat(errs, dim=1), torch.cat(amaxes, dim=0)


def pick_clip(errs: torch.Tensor, amax: torch.Tensor, grid: int = 20, min_gain: float = 0.0) -> torch.Tensor:
    """Clip values [N, G] from ``clip_error_curve``'s output: the candidate with the least error
    (the smaller shrink on ties), where it lowers the unclipped error by more than the fraction
    ``min_gain``; elsewhere the full range ``amax``."""
    best, step = errs.min(dim=0)
    factor = torch.tensor([1 - i / grid for i in range(errs.shape[0])], dtype=amax.dtype, device=amax.device)
    return torch.where(best < (1 - min_gain) * errs[0], amax * factor[step], amax)


def search_clip(weight: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, grid: int = 20,
                min_gain: float = 0.0, **curve: Any) -> torch.Tensor:
    """Per-(row, group) clip value (max |w|) minimising the group's output error on ``x``
    (``clip_error_curve``, which takes ``curve``: max_shrink, row_chunk); a group keeps its full
    range unless the best clip lowers that error by more than the fraction ``min_gain`` (0: any
    improvement). Returns fp32 [N, G]."""
    return pick_clip(*clip_error_curve(weight, x, scheme, grid, **curve), grid=grid, min_gain=min_gain)


def apply_clip(weight: torch.Tensor, clip: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """[N, K] weight clamped to ``[-clip[n, g], clip[n, g]]`` per group (fp32 out)."""
    n, k = weight.shape
    w = grouped(weight.detach(), scheme)
    m = clip.to(w).unsqueeze(2)
    return torch.maximum(torch.minimum(w, m), -m).reshape(n, -1)[:, :k].contiguous()


def clip_wanted(option: bool | None, scheme: QuantScheme) -> bool:
    """Whether to search clip values: the recipe's ``awq.clip``, or when None by bit width."""
    return option if option is not None else scheme.bits <= CLIP_AUTO_MAX_BITS


def awq_quantize(
    weight: torch.Tensor,
    scheme: QuantScheme,
    clip: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
    gscale: torch.Tensor | None = None,
) -> QuantResult:
    """RTN of an AWQ-scaled weight [N, K], clamped first by ``clip`` [N, G] when given (NVFP4:
    under ``gscale``, the global scale shared with fused siblings, when given)."""
    w = weight if clip is None else apply_clip(weight, clip, scheme)
    return rtn(w.to(torch.float32), scheme, scale_dtype, gscale)

