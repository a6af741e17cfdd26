"""Float number grids: FP8 E4M3 and FP4 E2M1 codes, their group scales, and RTN onto them.

Pure tensor functions. A float scheme's ``QuantResult`` holds

* ``qweight``: uint8 codes, the FP8 E4M3FN byte (``fp8``) or the E2M1 nibble (``nvfp4``,
  ``mxfp4``: bits 0-2 the magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign);
* ``scales``: float32 [N, 1] (``fp8`` per channel), float32 [N, K/128] (FP8 block: every row of
  a block of 128 rows holds the block's scale; the checkpoint stores one row per block),
  float8_e4m3fn [N, K/16] to be divided by the per-tensor ``global_scale`` (``nvfp4``), uint8
  E8M0 exponents [N, K/32] meaning ``2 ** (e - 127)`` (``mxfp4``);
* ``global_scale``: float32 [1], ``nvfp4`` only.

``w[n, k] = value(code[n, k]) * decoded_scale[n, g]`` with ``g = k // group_len``.

Scales (element codes and rounding: ``floatcodes.py``):
``fp8`` amax / 448 of the channel, or of the 128x128 block (``block_scales``; the last block of
rows may be shorter, K must be a multiple of 128); ``nvfp4`` the global scale
``448 * 6 / amax(W)`` maps the largest group scale to E4M3's top, each group's ``amax / 6`` is
stored as ``E4M3(amax / 6 * global)`` (scale rule ``amax``, the default; ``mse`` tries that code's
neighbours too, ``nv_group_scales``); ``mxfp4`` picks each group's power-of-two exponent by the
scheme's ``scale_rule`` (``mx_exponents``) from two candidates: the OCP rule ``floor(log2 amax) - 2``
(``"ocp"``; the group max may exceed ``6 * 2**e`` and saturate, up to 25% of it clipped) and the
next exponent, which never clips. ``"ceil"`` takes the smaller one that does not clip the max
(``ceil(log2(amax / 6))``), ``"mse"`` the one with the smaller squared error of the group (the
OCP one on a tie), ``"hmse"`` the same with each column's error weighted by the method's
importance of it (GPTQ: the Hessian's diagonal, the output error of the column alone; data-free
methods: ``"mse"``), ``"round"`` the next one when amax's significand is at least 1.75 (amax rounded
to a power of two as llm-compressor and vLLM's MXFP4 reference do: clips up to 1/7 of the max).
The default, ``"auto"`` (``core.scheme.MX_SCALE_RULE``), is ``"round"`` for data-free rounding
(RTN, AWQ's rounding) and ``"mse"`` for GPTQ, each chosen on a validation split (C4 documents
outside the calibration draw), not on the wikitext2 test text: docs/decisions/mxfp4-scale-rule.md,
benchmarks/results/mxfp4-scale-rule.md.
"""

from __future__ import annotations

import torch

from ..core.floatcodes import E8M0_BIAS, FP4_MAX, FP8_MAX, code_values, decode_scales, encode
from ..core.scheme import MX_SCALE_RULES, NV_SCALE_RULES, QuantResult, QuantScheme, mx_scale_rule


def global_scale(weight: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale: fp32 [1], ``448 * 6 / amax`` (1 for an all-zero tensor)."""
    amax = weight.detach().abs().amax().to(torch.float32)
    if not bool(amax > 0) or not bool(torch.isfinite(amax)):
        return torch.ones(1, dtype=torch.float32, device=weight.device)
    return (FP8_MAX * FP4_MAX / amax).reshape(1)


def tensor_global_scale(weight: torch.Tensor, scheme: QuantScheme,
                        shared: torch.Tensor | None = None) -> torch.Tensor | None:
    """The per-tensor scale ``scheme`` stores (NVFP4 only, else None): ``shared`` when given
    (one scale for fused siblings, ``fused_scales.py``), else ``weight``'s own."""
    if scheme.weights != "nvfp4":
        return None
    return global_scale(weight) if shared is None else shared.to(device=weight.device, dtype=torch.float32).reshape(1)


def on_grid(w: torch.Tensor, scale: torch.Tensor, weights: str) -> torch.Tensor:
    """``w`` rounded to the grid of ``weights`` under ``scale`` (broadcast to w), fp32."""
    return code_values(weights, w.device)[encode(w / scale, weights).long()] * scale


def group_scales(
    w: torch.Tensor, scheme: QuantScheme, gscale: torch.Tensor | None = None,
    importance: torch.Tensor | None = None, calibrated: bool = False,
) -> torch.Tensor:
    """The stored scale of each row of ``w`` ([R, L] groups -> [R]) for a float scheme;
    ``importance`` [L] or [R, L] (fp32 >= 0, e.g. GPTQ's Hessian diagonal of the group's columns) weights
    the squared error of MXFP4's ``hmse`` rule; ``calibrated``: GPTQ asks (MXFP4's "auto" rule
    is then mse, else round: ``core.scheme.mx_scale_rule``)."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1)
    if scheme.weights == "fp8":
        scale = amax / FP8_MAX
        return torch.where(scale > 0, scale, torch.ones_like(scale))
    if scheme.weights == "nvfp4":
        return nv_group_scales(w, amax, gscale.to(device=w.device, dtype=torch.float32), scheme.scale_rule)
    rule = mx_scale_rule(scheme.scale_rule, calibrated)
    return (mx_exponents(w, rule, importance) + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


NV_STEPS = (0, -1, 1, -2)  # E4M3 codes tried by "mse", from amax's: the nearest first (it wins ties)


def nv_group_scales(w: torch.Tensor, amax: torch.Tensor, gscale: torch.Tensor, rule: str) -> torch.Tensor:
    """NVFP4's stored E4M3 scale of each row of ``w`` ([R, 16] fp32 groups, ``amax`` [R]) under
    the tensor's ``gscale`` by ``rule`` (``core.scheme.NV_SCALE_RULES``; "auto" is amax): the cast of
    amax / 6 x gscale, or ("mse") of that code and its neighbours one above and two below, the
    one with the smallest squared error of the group."""
    if rule not in NV_SCALE_RULES:
        raise ValueError(f"unknown NVFP4 scale rule {rule!r}: use one of {NV_SCALE_RULES}")
    tiny = 2.0**-9  # the smallest E4M3 subnormal: a zero group still gets a usable scale
    nearest = (amax / FP4_MAX * gscale).clamp(tiny, FP8_MAX).to(torch.float8_e4m3fn)
    if rule != "mse":
        return nearest
    top = int(torch.tensor(FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8))  # 448's code, the largest finite
    codes = nearest.view(torch.uint8).to(torch.int16)  # positive E4M3 codes order as their values
    best, best_err = None, None
    for step in NV_STEPS:
        cand = (codes + step).clamp(1, top).to(torch.uint8)
        scale = cand.view(torch.float8_e4m3fn).to(torch.float32) / gscale
        err = (on_grid(w, scale.unsqueeze(1), "nvfp4") - w).pow(2).sum(dim=1)
        if best is None:
            best, best_err = cand, err
            continue
        better = err < best_err
        best, best_err = torch.where(better, cand, best), torch.where(better, err, best_err)
    return best.view(torch.float8_e4m3fn)


def mx_exponents(w: torch.Tensor, rule: str, importance: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4's unbiased exponent ``e`` (scale ``2**e``) of each row of ``w`` ([R, 32] groups ->
    fp32 [R]) by ``rule`` (``core.scheme.MX_SCALE_RULES``; module docstring; "auto" is the data-free
    one, round); ``hmse`` weights each column's squared error by ``importance`` [32] or [R, 32] (None: the
    ``mse`` rule). An all-zero group gets -2 under every rule."""
    rule = mx_scale_rule(rule)
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    low = torch.floor(torch.log2(safe)) - 2  # OCP: may clip the max
    if rule == "ocp":
        return low
    if rule == "ceil":  # the next exponent where the OCP one clips
        return low + (amax > FP4_MAX * torch.exp2(low)).to(low.dtype)
    if rule == "round":  # amax rounded to a power of two (up from 1.75): llm-compressor's / vLLM's reference
        return low + (amax >= 1.75 * torch.exp2(low + 2)).to(low.dtype)
    if rule not in ("mse", "hmse"):
        raise ValueError(f"unknown MXFP4 scale rule {rule!r}: use one of {MX_SCALE_RULES}")
    weight = importance.to(device=w.device, dtype=torch.float32) if rule == "hmse" and importance is not None else None
    best, best_err = None, None
    for e in (low, low + 1):
        sq = (on_grid(w, torch.exp2(e).unsqueeze(1), "mxfp4") - w).pow(2)
        err = (sq if weight is None else sq * weight).sum(dim=1)
        if best is None:
            best, best_err = e, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, e, best), torch.where(better, err, best_err)
    return best


def block_scales(w: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 block scales of ``w`` [N, K] (K a multiple of ``block``): fp32 [N, K / block], the
    amax / 448 of each ``block`` x ``block`` block (1 for an all-zero block) on every row of the
    block; a last block of fewer than ``block`` rows takes the amax of its own rows."""
    n, k = w.shape
    if k % block:
        raise ValueError(f"fp8 block: K={k} is not a multiple of the block size {block}")
    rows = -(-n // block)
    a = torch.nn.functional.pad(w.detach().to(torch.float32).abs(), (0, 0, 0, rows * block - n))  # |0| adds nothing
    scale = a.view(rows, block, k // block, block).amax(dim=(1, 3)) / FP8_MAX  # [rows, K / block]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale.repeat_interleave(block, dim=0)[:n].contiguous()


def fake_quantize_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] quantized and dequantized on FP8 block scales (fp32): ``rtn_float``'s values."""
    scale = block_scales(w, block).repeat_interleave(block, dim=1)
    return on_grid(w.to(torch.float32), scale, "fp8")


def fake_quantize_groups(groups: torch.Tensor, scheme: QuantScheme, gscale: torch.Tensor | None = None) -> torch.Tensor:
    """Each row of ``groups`` ([R, L], one group each) quantized and dequantized with its own
    scale (NVFP4: under the tensor's ``gscale``), fp32: ``rtn_float``'s values."""
    scale = decode_scales(group_scales(groups, scheme, gscale), scheme.weights, gscale).unsqueeze(1)
    return on_grid(groups.to(torch.float32), scale, scheme.weights)


def rtn_float(weight: torch.Tensor, scheme: QuantScheme, gscale: torch.Tensor | None = None) -> QuantResult:
    """Round-to-nearest of a [N, K] weight onto ``scheme``'s float grid, group by group (FP8
    block: with the scale of each 128x128 block); NVFP4 under ``gscale`` when given (one scale
    shared with fused siblings, ``fused_scales.py``), else the weight's own."""
    n, k = weight.shape
    glen = scheme.group_len(k)
    if k % glen:
        raise ValueError(f"{scheme.weights}: K={k} is not a multiple of the group size {glen}")
    w = weight.detach().to(torch.float32)
    gs = tensor_global_scale(w, scheme, gscale)
    groups = w.reshape(-1, glen)
    stored = block_scales(w, glen).reshape(-1) if scheme.is_block else group_scales(groups, scheme, gs)
    scale = decode_scales(stored, scheme.weights, gs).unsqueeze(1)
    codes = encode(groups / scale, scheme.weights).reshape(n, k)
    return QuantResult(codes, stored.reshape(n, -1), None, None, scheme, global_scale=gs)
