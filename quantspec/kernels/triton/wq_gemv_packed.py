"""The packed W4 GEMV (M <= 2, fp16 / bf16 x, 4-bit fields, no g_idx): pairs of fp16 weights
made by magic-number bit tricks, two weights an instruction (docs/decisions/packed-gemv.md).
Layout and launcher: ``wq_gemm.py`` (``gemv_packed`` picks the PACKED mode, ``wq_linear``
launches it)."""

from __future__ import annotations

import triton
import triton.language as tl

from .pair_ops import (
    _amd_dequant_pair,
    _amd_fma4_f16x2,
    _amd_mix8,
    _fma_pair_f32,
    _gemv_zero_pairs,
)
from .tiles import EVEN as _EVEN
from .tiles import store_result as _store_result

GEMV_CHAIN = tl.constexpr(4)  # packed fp16 GEMV: words per fp16 partial sum (4 * GEMV_CHAIN terms per lane)


# -- the packed GEMV's building blocks ---------------------------------------------------------
# A uint32 holds a pair of fp16 lanes (lane 0: bits 0-15). Each pair operation is one
# instruction through inline asm on the GPUs: PACKED = 2 PTX (fma.rn.f16x2, prmt.b32, LOP3 from
# plain Triton), PACKED = 3 AMDGCN (v_pk_fma_f16, v_perm_b32, v_and_or_b32, v_fma_mix_f32 for bf16
# x; a chain of them one asm statement, pair_ops.py). PACKED = 1 runs the same operations in plain
# Triton, lane by lane (the interpreter): IEEE fmas rounded once per lane and byte moves, the same
# bits (test_packed_gemv_bit_tricks_match_their_emulation). Zero pairs come from the integer zero
# point (pair_ops._gemv_zero_pairs).


@triton.jit
def _lane(v, LANE: tl.constexpr):
    """fp16 lane 0 (bits 0-15) or 1 (bits 16-31) of uint32 pairs."""
    if LANE == 1:
        v = v >> 16
    return v.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _pack(lo, hi):
    """Two fp16 tensors as uint32 pairs (lane 0 = lo)."""
    return lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _fma_f16x2(a, b, c, PACKED: tl.constexpr):
    """a * b + c per fp16 lane, rounded once."""
    if PACKED == 2:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    elif PACKED == 3:
        return tl.inline_asm_elementwise("v_pk_fma_f16 $0, $1, $2, $3", "=v,v,v,v", [a, b, c],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return _pack(tl.fma(_lane(a, 0), _lane(b, 0), _lane(c, 0)),
                     tl.fma(_lane(a, 1), _lane(b, 1), _lane(c, 1)))


@triton.jit
def _and_or(w, m, PACKED: tl.constexpr):
    """(w & m) | 0x64006400: one LOP3 on NVIDIA (m in a register: a LOP3 takes one immediate),
    one v_and_or_b32 on AMD."""
    if PACKED == 3:
        magic = tl.full(w.shape, 0x64006400, tl.uint32)
        return tl.inline_asm_elementwise("v_and_or_b32 $0, $1, $2, $3", "=v,v,v,v", [w, m, magic],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return (w & m) | 0x64006400


@triton.jit
def _pair_lanes(a, b, HI: tl.constexpr, PACKED: tl.constexpr):
    """(lane HI of a, lane HI of b) as one pair: the byte permute prmt.b32 a, b with selector
    0x5410 (HI = 0) or 0x7632; v_perm_b32 b, a with 0x05040100 or 0x07060302 (its bytes 0-3
    come from the second operand)."""
    if PACKED == 2:
        if HI:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b],
                                             dtype=tl.uint32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b],
                                             dtype=tl.uint32, is_pure=True, pack=1)
    elif PACKED == 3:
        sel = tl.full(a.shape, 0x07060302 if HI else 0x05040100, tl.uint32)
        return tl.inline_asm_elementwise("v_perm_b32 $0, $2, $1, $3", "=v,v,v,v", [a, b, sel],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        if HI:
            return (a >> 16) | (b & 0xFFFF0000)
        else:
            return (a & 0xFFFF) | (b << 16)


@triton.jit
def _lanes_f32(h, PACKED: tl.constexpr):
    """Both fp16 lanes of uint32 pairs as fp32 (exact)."""
    if PACKED == 2:  # plain Triton lets LLVM re-pair lanes across registers (byte permutes)
        lo, hi = tl.inline_asm_elementwise(
            "{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}", "=r,=r,r", [h],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        return lo, hi
    else:
        return _lane(h, 0).to(tl.float32), _lane(h, 1).to(tl.float32)


@triton.jit
def _pair_sum_f32(h, PACKED: tl.constexpr):
    """lane 0 + lane 1 of fp16 pairs, in fp32."""
    lo, hi = _lanes_f32(h, PACKED)
    return lo + hi


@triton.jit
def _neg_pair_f16(v):
    """-v (fp32, exact in fp16) as the fp16 pair (-v, -v)."""
    b = (-v).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return b | (b << 16)


@triton.jit
def _dequant_f16x2(w, m_lo, zc0, zc1, PACKED: tl.constexpr):
    """The 8 codes of words ``w`` (uint32) as four exact fp16 pairs of (code - zero) / 16: pair i
    holds fields (i, i+4), rows (k+i, k+i+4). ``(w & 0x000F000F) | 0x64006400`` is the pair
    (1024 + c0, 1024 + c4) (fp16 0x6400 = 1024, the code in the low mantissa bits); the mask
    0x00F000F0 gives (1024 + 16 c1, 1024 + 16 c5) with no shift (as Marlin does), ``w >> 8`` the
    other two. One fma per pair: (1024 + c) / 16 - (64 + z / 16) or (1024 + 16 c) / 256 - (4 +
    z / 16), exact (every value a multiple of 1/16 below 128); 1/16 keeps the products within
    |x| (no fp16 overflow). ``m_lo`` = 0x000F000F in a register; ``zc0``, ``zc1`` the pairs
    -(64 + z / 16), -(4 + z / 16)."""
    m_hi = m_lo << 4
    w8 = w >> 8
    c16 = tl.full(w.shape, 0x2C002C00, tl.uint32)  # (1/16, 1/16)
    c256 = tl.full(w.shape, 0x1C001C00, tl.uint32)  # (1/256, 1/256)
    d0 = _dequant_pair(w, m_lo, c16, zc0, PACKED)
    d1 = _dequant_pair(w, m_hi, c256, zc1, PACKED)
    d2 = _dequant_pair(w8, m_lo, c16, zc0, PACKED)
    d3 = _dequant_pair(w8, m_hi, c256, zc1, PACKED)
    return d0, d1, d2, d3


@triton.jit
def _dequant_pair(w, m, c, zc, PACKED: tl.constexpr):
    """((w & m) | 0x64006400) * c + zc per fp16 lane, rounded once (``_and_or`` then ``_fma_f16x2``;
    PACKED 3: both in one AMDGCN block, ``pair_ops._amd_dequant_pair``)."""
    if PACKED == 3:
        return _amd_dequant_pair(w, m, c, zc)
    else:
        return _fma_f16x2(_and_or(w, m, PACKED), c, zc, PACKED)


@triton.jit
def _x_halves(p, mask, EVEN_K: tl.constexpr):
    """The 16 bytes of x at ``p`` (uint64 pointers [..., 2]: 8 activations k .. k+7, k a multiple
    of 8, 16-byte aligned; ``mask`` [..., 1], unused with EVEN_K) as four uint32 [...]: (x0, x1)
    .. (x6, x7)."""
    if EVEN_K:
        v = tl.load(p)
    else:
        v = tl.load(p, mask=mask, other=0)
    a, b = tl.split(v)
    return a.to(tl.uint32), (a >> 32).to(tl.uint32), b.to(tl.uint32), (b >> 32).to(tl.uint32)


@triton.jit
def _x_words(p, mask, EVEN_K: tl.constexpr):
    """``_x_halves`` of a word row's x (``p`` [RS, 2], ``mask`` [RS]) as four uint32 [RS, 1]."""
    x01, x23, x45, x67 = _x_halves(p, mask[:, None], EVEN_K)
    return x01[:, None], x23[:, None], x45[:, None], x67[:, None]


@triton.jit
def _x_pairs(p, mask, EVEN_K: tl.constexpr, PACKED: tl.constexpr):
    """fp16 x as the pairs (x[k+i], x[k+i+4]), i = 0..3, of the weight pairs of ``_dequant_f16x2``."""
    x01, x23, x45, x67 = _x_words(p, mask, EVEN_K)
    return (_pair_lanes(x01, x45, False, PACKED), _pair_lanes(x01, x45, True, PACKED),
            _pair_lanes(x23, x67, False, PACKED), _pair_lanes(x23, x67, True, PACKED))


@triton.jit
def _bf16_f32(v, HI: tl.constexpr):
    """bf16 lane HI of uint32 pairs as fp32 (exact: bf16 is fp32's high half)."""
    if HI:
        return (v & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return (v << 16).to(tl.float32, bitcast=True)


@triton.jit
def _x_bf16_f32(p, mask, EVEN_K: tl.constexpr):
    """bf16 x k .. k+7 as eight fp32 [RS, 1]."""
    x01, x23, x45, x67 = _x_words(p, mask, EVEN_K)
    return (_bf16_f32(x01, False), _bf16_f32(x01, True), _bf16_f32(x23, False), _bf16_f32(x23, True),
            _bf16_f32(x45, False), _bf16_f32(x45, True), _bf16_f32(x67, False), _bf16_f32(x67, True))


@triton.jit
def _dot8_f16x2(h, x0, x1, x2, x3, d0, d1, d2, d3, PACKED: tl.constexpr):
    """h + x . d over one word's 8 rows in fp16 pairs: 4 fmas, 4 more terms in each lane (PACKED 3:
    one AMDGCN block, ``pair_ops._amd_fma4_f16x2``)."""
    if PACKED == 3:
        return _amd_fma4_f16x2(h, x0, x1, x2, x3, d0, d1, d2, d3)
    h = _fma_f16x2(x0, d0, h, PACKED)
    h = _fma_f16x2(x1, d1, h, PACKED)
    h = _fma_f16x2(x2, d2, h, PACKED)
    return _fma_f16x2(x3, d3, h, PACKED)


@triton.jit
def _pair_fma_f32(acc, xa, xb, d, PACKED: tl.constexpr):
    """acc + xa * lane 0 + xb * lane 1 of the fp16 pairs ``d``, in fp32 (fp32 ``xa``, ``xb``): the
    lanes converted exactly, two fmas in this order. PACKED 3: each one ``v_fma_mix_f32`` reading
    the lane in place (``pair_ops._fma_pair_f32``), no conversion instruction."""
    if PACKED == 2:
        lo, hi = _lanes_f32(d, PACKED)
        return tl.fma(xb, hi, tl.fma(xa, lo, acc))
    else:
        return _fma_pair_f32(xa, xb, d, acc, PACKED)


@triton.jit
def _dot8_f32(acc, x0, x1, x2, x3, x4, x5, x6, x7, d0, d1, d2, d3, PACKED: tl.constexpr):
    """acc + x . d over one word's 8 rows in fp32 (bf16 x): the fp16 weights converted (exact),
    8 fmas of exact products (8 x 5 significant bits)."""
    if PACKED == 3:
        return _amd_mix8(acc, x0, x1, x2, x3, x4, x5, x6, x7, d0, d1, d2, d3)
    acc = _pair_fma_f32(acc, x0, x4, d0, PACKED)
    acc = _pair_fma_f32(acc, x1, x5, d1, PACKED)
    acc = _pair_fma_f32(acc, x2, x6, d2, PACKED)
    return _pair_fma_f32(acc, x3, x7, d3, PACKED)


@_EVEN
@triton.jit
def _wq_gemv_f16x2_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, b_ptr, out_ptr, part_ptr,
                          M, N, K, stride_xm, M_KEY, code_mask,
                          FB: tl.constexpr, GROUP: tl.constexpr, SYM_ZERO: tl.constexpr,
                          HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                          PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The packed GEMV: fp16 or bf16 x, 4-bit fields (4- and 3-bit codes), no g_idx; grid
    (cdiv(N, BLOCK_N), SPLIT_K), M <= 2 (BLOCK_M = M), K % 8 == 0, x rows 16-byte aligned (the
    launcher checks). For the common decode case it spends about a third of the fp32 GEMV's
    instructions per weight (benchmarks/results/kernel-isa.md).

    A K tile is read as [ROWS, BLOCK_N] words per step, KW / ROWS steps (KW = BLOCK_K / 8):
    row r of the ROWS-row slab walks words r * KW / ROWS onwards, so a thread's words are
    contiguous in K (the configs give 4 columns a thread; BLOCK_N 128 x 4 warps: one warp per
    slab row, no cross-thread reduction until the end). Each word becomes four exact fp16 pairs
    (code - zero) / 16 (``_dequant_f16x2``: 4 LOP3 + 1 shift + 4 fmas for 8 weights), then:

    * fp16 x: fmas into a packed fp16 partial sum with x's matching pairs (4 for 8 weights).
      A partial covers GEMV_CHAIN words of one group (4 * GEMV_CHAIN products per lane, each
      fma rounded to fp16), then is converted to fp32, scaled and added to the fp32
      accumulator. Its magnitude stays below 15/16 of the sum of its 16 |x| (no overflow while
      that sum is below 69871, e.g. every |x| <= 4096); its rounding error is at most
      16 * 2**-11 of the sum of its |products| (about 2**-11 * sqrt(16) in practice): measured
      at most a third of the tests' fp16 tolerance (docs/decisions/packed-gemv.md).
    * bf16 x: the fp16 weights converted to fp32 (exact) and fp32 fmas of exact products,
      as the fp32 GEMV computes them (no fp16 rounding).

    The scale (x 16) multiplies each partial once per column; pointers advance per tile.
    """
    XBF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    PF: tl.constexpr = 8
    KW: tl.constexpr = BLOCK_K // PF
    RS: tl.constexpr = min(ROWS, KW)
    SPW: tl.constexpr = KW // RS  # steps per tile: word rows per slab row
    CH0: tl.constexpr = min(GEMV_CHAIN, SPW)
    G2: tl.constexpr = (GROUP // PF) & -(GROUP // PF)  # the largest power of 2 dividing a group's words
    CH: tl.constexpr = min(CH0, G2)  # words per partial: a power of 2, inside one group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, RS)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t0 = pid_k * per_split
    t1 = tl.minimum((pid_k + 1) * per_split, k_tiles)
    m_pair = (code_mask * 0x10001).to(tl.uint32)  # 0x000F000F, kept in a register
    wrow = t0 * KW + offs_r * SPW  # [RS] first word row of each slab row
    w_ptrs = qw_ptr + wrow[:, None] * N + offs_n[None, :]
    x_ptrs = (x_ptr + wrow * PF).to(tl.pointer_type(tl.uint64), bitcast=True)[:, None] + tl.arange(0, 2)[None, :]
    x_step = stride_xm // 4  # x rows in uint64 (the launcher checks stride_xm % 8 == 0)
    acc0 = tl.zeros([RS, BLOCK_N], dtype=tl.float32)  # x row 0, per slab row
    acc1 = tl.zeros([RS, BLOCK_N], dtype=tl.float32)  # x row 1 (BLOCK_M 2)
    for t in range(t0, t1):
        for c0 in tl.static_range(0, SPW, CH):
            krow = (wrow + c0) * PF  # [RS] first K row of this partial (one group)
            s_ptrs = (krow.to(tl.uint32) // GROUP).to(tl.int32)[:, None] * N + offs_n[None, :]
            if EVEN_K and EVEN_N:
                s = tl.load(s_ptr + s_ptrs).to(tl.float32)
            else:
                smask = (krow < K)[:, None] & (offs_n[None, :] < N)
                s = tl.load(s_ptr + s_ptrs, mask=smask, other=0.0).to(tl.float32)
            if HAS_ZEROS:  # the zero pairs built from the integer (pair_ops._gemv_zero_pairs)
                if EVEN_K and EVEN_N:
                    z = tl.load(z_ptr + s_ptrs)
                else:
                    z = tl.load(z_ptr + s_ptrs, mask=smask, other=0)
                zc0, zc1 = _gemv_zero_pairs(z.to(tl.uint32))
            else:
                zc0, zc1 = _gemv_zero_pairs(tl.full([RS, BLOCK_N], SYM_ZERO, tl.float32).to(tl.uint32))
            if XBF16:  # fp32 partial sums
                h0 = tl.zeros([RS, BLOCK_N], dtype=tl.float32)
                h1 = tl.zeros([RS, BLOCK_N], dtype=tl.float32)
            else:  # packed fp16 partial sums
                h0 = tl.zeros([RS, BLOCK_N], dtype=tl.uint32)
                h1 = tl.zeros([RS, BLOCK_N], dtype=tl.uint32)
            for st in tl.static_range(c0, c0 + CH):
                if EVEN_K and EVEN_N:
                    w = tl.load(w_ptrs + st * N)
                else:
                    w = tl.load(w_ptrs + st * N, mask=((wrow + st) * PF < K)[:, None] & (offs_n[None, :] < N),
                                other=0)
                d0, d1, d2, d3 = _dequant_f16x2(w.to(tl.uint32, bitcast=True), m_pair, zc0, zc1, PACKED)
                xmask = (wrow + st) * PF < K
                if XBF16:
                    x0, x1, x2, x3, x4, x5, x6, x7 = _x_bf16_f32(x_ptrs + st * 2, xmask, EVEN_K)
                    h0 = _dot8_f32(h0, x0, x1, x2, x3, x4, x5, x6, x7, d0, d1, d2, d3, PACKED)
                    if BLOCK_M > 1:
                        x0, x1, x2, x3, x4, x5, x6, x7 = _x_bf16_f32(x_ptrs + x_step + st * 2, xmask, EVEN_K)
                        h1 = _dot8_f32(h1, x0, x1, x2, x3, x4, x5, x6, x7, d0, d1, d2, d3, PACKED)
                else:
                    x0, x1, x2, x3 = _x_pairs(x_ptrs + st * 2, xmask, EVEN_K, PACKED)
                    h0 = _dot8_f16x2(h0, x0, x1, x2, x3, d0, d1, d2, d3, PACKED)
                    if BLOCK_M > 1:
                        x0, x1, x2, x3 = _x_pairs(x_ptrs + x_step + st * 2, xmask, EVEN_K, PACKED)
                        h1 = _dot8_f16x2(h1, x0, x1, x2, x3, d0, d1, d2, d3, PACKED)
            if XBF16:
                acc0 += h0 * s  # x 16 after the loop
                if BLOCK_M > 1:
                    acc1 += h1 * s
            else:
                acc0 += _pair_sum_f32(h0, PACKED) * s
                if BLOCK_M > 1:
                    acc1 += _pair_sum_f32(h1, PACKED) * s
        wrow += KW
        w_ptrs += KW * N
        x_ptrs += BLOCK_K // 4
    acc = tl.where(offs_m[:, None] == 0, tl.sum(acc0, axis=0)[None, :], tl.sum(acc1, axis=0)[None, :]) * 16.0
    _store_result(acc, offs_m, offs_n, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT_K)
