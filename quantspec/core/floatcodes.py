"""Float element codes: FP8 E4M3FN bytes and FP4 E2M1 nibbles, their values, and the decoding
of stored group scales. Pure functions keyed by the weight type ("fp8", "nvfp4", "mxfp4");
what the codes and scales of a float ``QuantResult`` mean is in ``quant/floatgrid.py``.

Rounding is to nearest, ties to even (the IEEE rule, which torch's float8 casts apply); values
beyond the grid saturate at its largest finite value (448 for E4M3FN, 6 for E2M1). Zero is
always the all-zero code (a negative value rounding to zero is not written as -0), so each
value has one code and a code read back re-encodes to itself.
"""

from __future__ import annotations

import torch

from ..errors import QuantspecError

FP8_MAX = 448.0  # E4M3FN
FP8_FNUZ_MAX = 240.0  # E4M3FNUZ (MI300, gfx942)
FP4_MAX = 6.0  # E2M1
E8M0_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
HAS_FLOAT8 = hasattr(torch, "float8_e4m3fn")  # torch >= 2.1 (pyproject asks for 2.4)


def require_float8(what: str) -> None:
    """Refuse ``what`` (an FP8 / FP4 scheme, an FP8 KV cache) on a torch without float8 dtypes,
    whose casts every FP8 code and NVFP4 scale goes through."""
    if not HAS_FLOAT8:
        raise QuantspecError(f"{what} needs torch's float8 dtypes, which torch {torch.__version__} lacks.",
                             "install torch >= 2.4 (pip install -U torch), or use an integer scheme (--bits).")


def code_values(weights: str, device=None) -> torch.Tensor:
    """fp32 table: the value of every code of a weight type's element ([256] or [16])."""
    if weights == "fp8":
        codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
        values = codes.view(torch.float8_e4m3fn).to(torch.float32)
        return torch.nan_to_num(values, nan=0.0)  # 0x7F / 0xFF (NaN) are never written
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each element of ``x`` (already divided by its scale) -> uint8.

    The magnitude index counts the midpoints below |x|: strictly below where a tie belongs to
    the lower (even) index (0.25, 1.25, 2.5, 5), at or below where it belongs to the upper one
    (0.75, 1.75, 3.5); seven comparisons beat a search here by ~10x."""
    a = x.to(torch.float32).abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0))
    negative = ((x < 0) & (idx > 0)).to(torch.uint8)  # zero is always code 0, never -0
    return idx | (negative << 3)


def e2m1_search_table(device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bounds fp32 [14], codes uint8 [15], values fp32 [15]) for ``e2m1_round``: the signed E2M1
    grid in ascending order, its codes, and the 14 midpoints between neighbours, each moved one
    fp32 step down where its tie belongs to the upper neighbour (so that a search counting the
    bounds strictly below x rounds ties to even, as ``e2m1_codes`` does)."""
    mags = E2M1_MAGNITUDES
    grid = [-m for m in reversed(mags[1:])] + list(mags)
    codes = [8 + i for i in range(7, 0, -1)] + list(range(8))
    mids = torch.tensor([(a + b) / 2 for a, b in zip(grid, grid[1:])], dtype=torch.float32)
    # the tie goes to the value of even mantissa: the upper neighbour has it when its magnitude
    # index is even (|values| 1, 2, 4 ... on the positive side; 0, 1, 2, 4 ... below zero)
    upper_even = torch.tensor([codes[i + 1] % 2 == 0 for i in range(14)])
    bounds = torch.where(upper_even, torch.nextafter(mids, torch.tensor(-float("inf"))), mids)
    return (bounds.to(device), torch.tensor(codes, dtype=torch.uint8, device=device),
            torch.tensor(grid, dtype=torch.float32, device=device))


def e2m1_round(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, values fp32) of the nearest E2M1 value of each element of fp32 ``x``: the
    codes of ``e2m1_codes`` (NaN too: code 0), by one search in ``e2m1_search_table()``. On short
    vectors (GPTQ's column loop) that is ~6x faster than the seven comparisons; on whole
    tensors, slower."""
    bounds, codes, values = table
    idx = torch.bucketize(x.nan_to_num(nan=0.0), bounds)
    return codes[idx], values[idx]


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` (in units of its scale) rounded to the nearest E4M3FN value, saturating at 448; fp32."""
    return x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def pack_fp4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] E2M1 codes -> [N, K/2] bytes: column 2j in the low nibble, 2j+1 in the high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_fp4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4_pairs``."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(packed.shape[0], -1).contiguous()


def fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3FN byte of each element of ``x`` (already divided by its scale) -> uint8."""
    x = x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX)
    codes = x.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(codes == 0x80, torch.zeros_like(codes), codes)  # zero is 0x00, never -0 (0x80)


def encode(x: torch.Tensor, weights: str) -> torch.Tensor:
    """Codes of ``x`` on a weight type's element grid (x is in units of the scale)."""
    return fp8_codes(x) if weights == "fp8" else e2m1_codes(x)


def decode_scales(stored: torch.Tensor, weights: str, gscale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 scales that stored ``scales`` stand for (same shape)."""
    if weights == "mxfp4":
        return torch.exp2(stored.to(torch.float32) - E8M0_BIAS)
    if weights == "nvfp4":
        return stored.to(torch.float32) / gscale.to(torch.float32)
    return stored.to(torch.float32)


def dequantize_values(
    codes: torch.Tensor, stored: torch.Tensor, weights: str, group_len: int, gscale: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [N, K] weight from uint8 codes [N, K] and stored scales [N, K / group_len]."""
    n, k = codes.shape
    if weights == "fp8":  # the byte is the E4M3FN value (NaN bytes are never written)
        values = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    else:
        values = code_values(weights, codes.device)[codes.long()]
    scale = decode_scales(stored, weights, gscale)
    if k % group_len == 0:  # whole groups: broadcast the scales over each group's columns
        return (values.view(n, k // group_len, group_len) * scale.unsqueeze(2)).view(n, k)
    return values * scale.repeat_interleave(group_len, dim=1)[:, :k]


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> E4M3 values as fp32 [M, K] and fp32 scales [M, 1] (absmax / 448, dynamic)."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return round_fp8(x.to(torch.float32) / scale), scale


def quantize_per_group_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> E4M3 values as fp32 [M, K] and fp32 scales [M, K / group]: absmax / 448 of each
    token's ``group`` consecutive columns, dynamic (``fp8-group-dynamic``; K a multiple of group)."""
    m, k = x.shape
    xg = x.to(torch.float32).view(m, k // group, group)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return round_fp8(xg / scale).view(m, k), scale.view(m, k // group)


def e4m3fn_to_fnuz(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An E4M3FN weight (uint8 bytes) and its scales as MI300's E4M3FNUZ computes them.

    The same byte read as E4M3FNUZ (exponent bias 8, not 7) is worth half as much, so the bytes
    are kept and the scales doubled: ``fnuz(b) * 2s == fn(b) * s`` exactly for every finite
    byte. The one exception is 0x80 (-0 in FN, NaN in FNUZ), which becomes 0x00.
    """
    codes = torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    return codes, scales.to(torch.float32) * 2.0
