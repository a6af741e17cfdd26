"""The packed GEMV on a pre-shuffled qweight (``layout.py``'s mma16x64 / mfma16x128): M <= 2,
fp16 / bf16 x, so that a pre-shuffled weight keeps a GEMV for decode (docs/decisions/preshuffled-layout.md).

Both layouts keep a fragment register's two lanes at nibbles j and j + 4 of a word, so
``wq_gemv_packed._dequant_f16x2`` builds a word's four exact pairs (code - zero) / 16 as it does for
a GPTQ word, and each pair's two lanes are two consecutive K of one row: x's matching pair is one
32-bit word of x as it lies in memory (no byte permutes, unlike the GPTQ word's (k + i, k + i + 4)).

* mfma16x128: a word is 8 consecutive K of one row (pairs d0..d3 = K 0-1, 2-3, 4-5, 6-7); a
  thread's 16-byte load holds 4 such words (K blocks 32 apart) of one row, x's 4 x 16 bytes.
* mma16x64: a word is two rows (g, g + 8) x 4 K (2c + {0, 1}, 2c + {8, 9}); ``_dequant_f16x2``'s
  two zero pairs are the two rows' (d0, d2 row g; d1, d3 row g + 8), and the products go to two
  partial sums, one per row.

Launcher: ``wq_gemm.wq_linear`` (a pre-shuffled qweight at M <= 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import _load_words
from .pair_ops import _gemv_zero_pairs, _group_zero_u32
from .tiles import EVEN as _EVEN
from .tiles import store_result as _store_result
from .wq_dequant import _group_scale
from .wq_gemv_packed import (
    _bf16_f32,
    _dequant_f16x2,
    _dot8_f16x2,
    _dot8_f32,
    _fma_f16x2,
    _pair_fma_f32,
    _pair_sum_f32,
    _x_halves,
)


@triton.jit
def _split4(v):
    """The four slices of a thread-local last dim of 4 (``v`` [..., 2, 2], as the caller reshapes it)."""
    a, b = tl.split(v)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _word(ws, j: tl.constexpr, KB: tl.constexpr):
    """Word j = 4 kb + i of a thread's chain: ``ws`` the 4 words of its 16-byte loads (i = 0..3),
    each [...] (KB 1) or [..., 2] (KB 2: K blocks kb = 0, 1)."""
    if KB == 1:
        return ws[j]
    else:
        tl.static_assert(KB == 2)
        return tl.split(ws[j % 4])[j // 4]


@triton.jit
def _pair_dot(h, xw, d, XBF16: tl.constexpr, PACKED: tl.constexpr):
    """h + x . d over one pair: fp16 x (``xw`` x's fp16 pair matching d's lanes) one packed fma
    into the fp16 partial ``h``; bf16 x (``xw`` the bf16 pair) two fp32 fmas of exact products."""
    if XBF16:
        return _pair_fma_f32(h, _bf16_f32(xw, False), _bf16_f32(xw, True), d, PACKED)
    else:
        return _fma_f16x2(xw, d, h, PACKED)


@triton.jit
def _partial_zero(like, XBF16: tl.constexpr):
    """A zero partial sum shaped as ``like``: fp32 (bf16 x) or the packed fp16 pair (fp16 x)."""
    if XBF16:
        return tl.zeros_like(like).to(tl.float32)
    else:
        return tl.zeros_like(like).to(tl.uint32)


@triton.jit
def _partial_f32(h, XBF16: tl.constexpr, PACKED: tl.constexpr):
    """A partial sum in fp32: the fp16 pair's lane sum, or the bf16 path's fp32 partial itself."""
    if XBF16:
        return h
    else:
        return _pair_sum_f32(h, PACKED)


@triton.jit
def _mma_tile(words, x_ptr, k0, K, x_step, s_a, s_b, z_a, z_b, m_pair, XBF16: tl.constexpr,
              EVEN_K: tl.constexpr, PACKED: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
              KB: tl.constexpr):
    """fp32 x . W.T / 16 [NB, 8 g, 4 c, 2 r1] (row 16 nb + 8 r1 + g) of a tile of mma16x64
    words [KB, NB, 128] for x rows 0 and 1: a thread's words (K blocks kb, then s: K 64 kb + 16 s
    + 2c + {0, 1, 8, 9}) chained in one packed partial per row (4 KB words, 8 KB products a
    lane). Pairs d0, d2 are row g, d1, d3 row g + 8; d0, d1 take x's uint32 at K 2c, d2, d3 the one
    at 2c + 8. ``s_a``, ``z_a`` / ``s_b``, ``z_b``: scales (fp32) and integer zero points (uint32) of rows g / g + 8 [NB, 8, 1]."""
    w = tl.permute(tl.reshape(words, (KB, NB, 8, 4, 4)), (1, 2, 3, 0, 4))  # nb, g, c | kb, s
    ws = _split4(tl.reshape(w, (NB, 8, 4, 2, 2) if KB == 1 else (NB, 8, 4, KB, 2, 2)))
    zc0 = _gemv_zero_pairs(z_a)[0]
    zc1 = _gemv_zero_pairs(z_b)[1]
    kx = k0 + (tl.arange(0, 4) * 2)[None, None, :, None] + (tl.arange(0, 2) * 8)[None, None, None, :]  # [1, 1, 4 c, 2]
    p = (x_ptr + kx).to(tl.pointer_type(tl.uint32), bitcast=True)
    ha0 = _partial_zero(_word(ws, 0, KB), XBF16)
    hb0 = ha0
    ha1 = ha0
    hb1 = ha0
    for j in tl.static_range(4 * KB):  # word j: K 16 j on
        d0, d1, d2, d3 = _dequant_f16x2(_word(ws, j, KB), m_pair, zc0, zc1, PACKED)
        for mi in tl.static_range(BLOCK_M):
            if EVEN_K:
                v = tl.load(p + 8 * j + mi * x_step)
            else:
                v = tl.load(p + 8 * j + mi * x_step, mask=kx + 16 * j < K, other=0)
            xa, xb = tl.split(v)
            if mi == 0:
                ha0 = _pair_dot(_pair_dot(ha0, xa, d0, XBF16, PACKED), xb, d2, XBF16, PACKED)
                hb0 = _pair_dot(_pair_dot(hb0, xa, d1, XBF16, PACKED), xb, d3, XBF16, PACKED)
            else:
                ha1 = _pair_dot(_pair_dot(ha1, xa, d0, XBF16, PACKED), xb, d2, XBF16, PACKED)
                hb1 = _pair_dot(_pair_dot(hb1, xa, d1, XBF16, PACKED), xb, d3, XBF16, PACKED)
    f0 = tl.join(_partial_f32(ha0, XBF16, PACKED) * s_a, _partial_f32(hb0, XBF16, PACKED) * s_b)
    f1 = tl.join(_partial_f32(ha1, XBF16, PACKED) * s_a, _partial_f32(hb1, XBF16, PACKED) * s_b)
    return f0, f1


@triton.jit
def _mfma_tile(words, x_ptr, k0, K, x_step, s, z, m_pair, XBF16: tl.constexpr, EVEN_K: tl.constexpr,
               PACKED: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr):
    """fp32 x . W.T / 16 [NB, 4 q, 16 r] (row 16 nb + r) of a tile of mfma16x128 words [KB, NB, 256]
    for x rows 0 and 1: a thread's words (K blocks kb, then i: K 128 kb + 32 i + 8 q + 0..7, pair
    j = K 2j, 2j + 1) chained in packed partials of 4 words (16 products a lane). ``s``, ``z``:
    the rows' scales (fp32) and integer zero points (uint32) [NB, 1, 16]."""
    w = tl.permute(tl.reshape(words, (KB, NB, 4, 16, 4)), (1, 2, 3, 0, 4))  # nb, q, r | kb, i
    ws = _split4(tl.reshape(w, (NB, 4, 16, 2, 2) if KB == 1 else (NB, 4, 16, KB, 2, 2)))
    zc0, zc1 = _gemv_zero_pairs(z)
    kx = k0 + (tl.arange(0, 4) * 8)[None, :, None, None]  # [1, 4 q, 1, 1]
    p = (x_ptr + kx).to(tl.pointer_type(tl.uint64), bitcast=True) + tl.arange(0, 2)[None, None, None, :]
    f0 = tl.zeros_like(s)
    f1 = f0
    for kb in tl.static_range(KB):
        h0 = _partial_zero(_word(ws, 0, KB), XBF16)
        h1 = h0
        for i in tl.static_range(4):  # word 4 kb + i: K 32 (4 kb + i) on, x 8 uint64 a word
            d0, d1, d2, d3 = _dequant_f16x2(_word(ws, 4 * kb + i, KB), m_pair, zc0, zc1, PACKED)
            x0, x1, x2, x3 = _x_halves(p + 8 * (4 * kb + i), kx + 32 * (4 * kb + i) < K, EVEN_K)
            h0 = _dot4_pairs(h0, x0, x1, x2, x3, d0, d1, d2, d3, XBF16, PACKED)
            if BLOCK_M > 1:
                x0, x1, x2, x3 = _x_halves(p + 8 * (4 * kb + i) + x_step, kx + 32 * (4 * kb + i) < K, EVEN_K)
                h1 = _dot4_pairs(h1, x0, x1, x2, x3, d0, d1, d2, d3, XBF16, PACKED)
        f0 += _partial_f32(h0, XBF16, PACKED) * s
        f1 += _partial_f32(h1, XBF16, PACKED) * s
    return f0, f1


@triton.jit
def _dot4_pairs(h, x0, x1, x2, x3, d0, d1, d2, d3, XBF16: tl.constexpr, PACKED: tl.constexpr):
    """h + the four pairs' products, x pair i against weight pair i."""
    if XBF16:  # bf16 pairs (lo, hi): the lo lanes, then the hi lanes, as _dot8_f32 takes them
        return _dot8_f32(h, _bf16_f32(x0, False), _bf16_f32(x1, False), _bf16_f32(x2, False), _bf16_f32(x3, False),
                         _bf16_f32(x0, True), _bf16_f32(x1, True), _bf16_f32(x2, True), _bf16_f32(x3, True),
                         d0, d1, d2, d3, PACKED)
    else:
        return _dot8_f16x2(h, x0, x1, x2, x3, d0, d1, d2, d3, PACKED)


@triton.jit
def _rows(acc, PRESHUFFLED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The accumulator summed over a row's threads into [BLOCK_N] (row order): mma16x64's [NB, 8 g,
    4 c, 2 r1] (row 16 nb + 8 r1 + g), mfma16x128's [NB, 4 q, 16 r] (row 16 nb + r)."""
    if PRESHUFFLED == 1:
        v = tl.permute(tl.sum(acc, axis=2), (0, 2, 1))
    else:
        v = tl.sum(acc, axis=1)
    return tl.reshape(v, (BLOCK_N,))


@_EVEN
@triton.jit
def _wq_gemv_ps_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, b_ptr, out_ptr, part_ptr,
                       M, N, K, stride_xm, M_KEY, code_mask,
                       FB: tl.constexpr, GROUP: tl.constexpr, SYM_ZERO: tl.constexpr,
                       HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                       PACKED: tl.constexpr, PRESHUFFLED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed GEMV on a pre-shuffled qweight (PRESHUFFLED 1: mma16x64, 2: mfma16x128; module
    doc): fp16 or bf16 x, M <= 2 (BLOCK_M = M), grid (cdiv(N, BLOCK_N), SPLIT_K); BLOCK_N a
    multiple of 16, BLOCK_K of the layout's K atom (at most 2 atoms), the K tile in one group
    (GROUP % BLOCK_K == 0), K % 8 == 0 and x rows 16-byte aligned (the launcher checks).

    Numerics as the packed GEMV's (``_wq_gemv_f16x2_kernel``): exact pairs (code - zero) / 16;
    fp16 x sums 16 products a lane (mma16x64: 8 words of a row pair, mfma16x128: 4 words of a
    row) in a packed fp16 partial, then fp32 and the scale; bf16 x sums exact products in fp32.
    A tile's words are loaded [KB, NB, words of an atom], so that a thread's K blocks (kb) are its
    own registers and chain in one partial; x 16 after the loop."""
    tl.static_assert(FB == 4 and not HAS_GIDX and GROUP % BLOCK_K == 0)
    tl.static_assert(BLOCK_N % 16 == 0 and BLOCK_K % (64 * PRESHUFFLED) == 0)
    XBF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    KA: tl.constexpr = 64 * PRESHUFFLED
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // KA
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    m_pair = (code_mask * 0x10001).to(tl.uint32)  # 0x000F000F, kept in a register
    if PRESHUFFLED == 1:
        x_step = stride_xm // 2  # x rows in uint32
        rows = pid_n * BLOCK_N + (tl.arange(0, NB) * 16)[:, None, None] + tl.arange(0, 8)[None, :, None]  # rows g
        acc0 = tl.zeros([NB, 8, 4, 2], dtype=tl.float32)
    else:
        x_step = stride_xm // 4  # x rows in uint64
        acc0 = tl.zeros([NB, 4, 16], dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    for t in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
        k0 = t * BLOCK_K
        g = k0 // GROUP
        # zero points loaded before the words, scales after: Triton's layout propagation then gives
        # the words' layout to the dequantized pairs (a zero load with as many elements as threads
        # is a layout anchor; loaded after the words, its layout won and the pairs went through
        # shared memory at 4 rows a thread: gfx942 7.92 instructions a weight against 4.48)
        if PRESHUFFLED == 1:  # each row's scale loaded where it is used (a [BLOCK_N] load split per row
            # pair went through shared memory on sm90, two barriers a tile)
            z_a = _group_zero_u32(z_ptr, g, rows, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            z_b = _group_zero_u32(z_ptr, g, rows + 8, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            words = _load_words(qw_ptr, k0, pid_n, K, N, EVEN_K and EVEN_N, BLOCK_N, BLOCK_K, KA, True)
            s_a = _group_scale(s_ptr, g, rows, N, EVEN_N)
            s_b = _group_scale(s_ptr, g, rows + 8, N, EVEN_N)
            f0, f1 = _mma_tile(words, x_ptr, k0, K, x_step, s_a, s_b, z_a, z_b, m_pair, XBF16, EVEN_K, PACKED,
                               BLOCK_M, NB, KB)
        else:  # one coalesced [BLOCK_N] load, reshaped (fewer instructions on gfx942, no LDS)
            z = _group_zero_u32(z_ptr, g, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            words = _load_words(qw_ptr, k0, pid_n, K, N, EVEN_K and EVEN_N, BLOCK_N, BLOCK_K, KA, True)
            s = _group_scale(s_ptr, g, offs_n, N, EVEN_N)
            f0, f1 = _mfma_tile(words, x_ptr, k0, K, x_step, tl.reshape(s, (NB, 1, 16)), tl.reshape(z, (NB, 1, 16)),
                                m_pair, XBF16, EVEN_K, PACKED, BLOCK_M, NB, KB)
        acc0 += f0
        if BLOCK_M > 1:
            acc1 += f1
    y0 = _rows(acc0, PRESHUFFLED, BLOCK_N)
    y1 = _rows(acc1, PRESHUFFLED, BLOCK_N)
    acc = tl.where(offs_m[:, None] == 0, y0[None, :], y1[None, :]) * 16.0
    _store_result(acc, offs_m, offs_n, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT_K)
