"""The weight-only tl.dot and GEMV kernels' building blocks (wq_gemm.py): packed codes read from
``qweight`` (K-major as ``_load_codes``, or transposed for the swapped product as
``_load_codes_t``), code - zero without conversion instructions (pairs of 4-bit fields as one asm
block each with ASM: ``_f16_pair``, PTX or AMDGCN; bf16 pairs and the zero pairs in pair_ops.py),
per-element dequantization of tiles spanning several groups, and the tl.dot of either orientation
(``_dot``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .pair_ops import (
    AMD_PAIR_EVEN,
    AMD_PAIR_ODD,
    MAGIC_F16,
    MASK_HI,
    MASK_LO,
    SIXTEENTH_F16,
    _bf16_pair,
    _bf16_pair_f16,
    _bf16_zero_pair,
    _dot_zero_pair,
    _f16_pair_plain,
)


@triton.jit
def _load_codes(qw_ptr, code_mask, k0, offs_n, K, N, FB: tl.constexpr, EVEN: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """uint32 codes [KW, PF, BLOCK_N] of rows k0 .. k0 + BLOCK_K (field i of word j is row
    k0 + PF*j + i): each word loaded once, its fields split by one broadcast shift and
    ``code_mask`` (2**FB - 1; passed at run time, the compiler keeps shift, and-or as two
    instructions instead of a bit-field extract and an or). Words past K or N read as 0 (EVEN:
    none are, no masks)."""
    PF: tl.constexpr = 32 // FB
    KW: tl.constexpr = BLOCK_K // PF
    offs_w = k0 // PF + tl.arange(0, KW)
    ptrs = qw_ptr + offs_w[:, None] * N + offs_n[None, :]
    if EVEN:
        words = tl.load(ptrs)
    else:
        words = tl.load(ptrs, mask=(offs_w[:, None] < tl.cdiv(K, PF)) & (offs_n[None, :] < N), other=0)
    shifts = (tl.arange(0, PF) * FB).to(tl.uint32)
    return (words.to(tl.uint32, bitcast=True)[:, None, :] >> shifts[None, :, None]) & code_mask


@triton.jit
def _load_words_t(qw_ptr, k0, offs_n, K, N, FB: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint32 words [BLOCK_N, BLOCK_K / PF] of rows k0 .. k0 + BLOCK_K, columns ``offs_n`` (0 past K or N)."""
    PF: tl.constexpr = 32 // FB
    KW: tl.constexpr = BLOCK_K // PF
    offs_w = k0 // PF + tl.arange(0, KW)
    ptrs = qw_ptr + offs_w[None, :] * N + offs_n[:, None]
    if EVEN:
        words = tl.load(ptrs)
    else:
        words = tl.load(ptrs, mask=(offs_w[None, :] < tl.cdiv(K, PF)) & (offs_n[:, None] < N), other=0)
    return words.to(tl.uint32, bitcast=True)


@triton.jit
def _load_codes_t(qw_ptr, code_mask, k0, offs_n, K, N, FB: tl.constexpr, EVEN: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """uint32 codes of W.T [BLOCK_N, BLOCK_K] (rows k0 .. k0 + BLOCK_K along dim 1). 8- and 4-bit
    fields are split by one shift and mask each and put back in order by tl.join (a new minor
    dimension, in registers: a thread keeps its word's codes, K-contiguous, as the left tl.dot
    operand wants them); a broadcast shift (``_load_codes``) makes the compiler spread one word's
    fields over threads and pass the tile through shared memory one element at a time."""
    PF: tl.constexpr = 32 // FB
    w = _load_words_t(qw_ptr, k0, offs_n, K, N, FB, EVEN, BLOCK_K)
    if FB == 8:  # fields (a, b) of join(join(f0, f2), join(f1, f3)) hold field 2a + b
        c = tl.join(tl.join(w & code_mask, (w >> 16) & code_mask), tl.join((w >> 8) & code_mask, w >> 24))
    elif FB == 4:  # (a, b, c): field 4a + 2b + c
        c = tl.join(tl.join(tl.join(w & code_mask, (w >> 16) & code_mask),
                            tl.join((w >> 8) & code_mask, (w >> 24) & code_mask)),
                    tl.join(tl.join((w >> 4) & code_mask, (w >> 20) & code_mask),
                            tl.join((w >> 12) & code_mask, w >> 28)))
    else:
        c = (w[:, :, None] >> (tl.arange(0, PF) * FB).to(tl.uint32)[None, None, :]) & code_mask
    return tl.reshape(c, (offs_n.shape[0], BLOCK_K))


# fp16 code - zero of two 4-bit fields as one PTX block (``_f16_pair`` with ASM, CUDA): the
# mask-and-or is one lop3 with both constants immediates (plain Triton's LOP3 takes the mask from a
# register, re-made by an IMAD.MOV per use on sm90) and the fp16 pair op reads its result. $1: the
# word, its fields at bits 0-3 / 16-19 (even) or 4-7 / 20-23 (odd); $2: the fp16 pair -(zero + 1024)
# (odd: -(zero + 64)). lop3 LUT 0xEA = (a & b) | c (a = 0xF0, b = 0xCC, c = 0xAA); 0x2C00 = 1/16.
PTX_PAIR_EVEN = tl.constexpr("{.reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; add.rn.f16x2 $0, t, $2;}")
PTX_PAIR_ODD = tl.constexpr("{.reg .b32 t, m; mov.b32 m, 0x2C002C00; lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA; "
                            "fma.rn.f16x2 $0, t, m, $2;}")


@triton.jit
def _f16_pair(ws, nz, ODD: tl.constexpr, ASM: tl.constexpr):
    """fp16 (lo, hi) = code - zero of the 4-bit fields at bits 0-3 and 16-19 of uint32 ``ws``
    (ODD: 4-7 and 20-23, no shift), ``nz`` the uint32 fp16 pair (-(zero + 1024), same) (ODD:
    -(zero + 64)): ``(ws & 0x000F000F) | 0x64006400`` is 1024 + code a lane (ODD: mask
    0x00F000F0, 1024 + 16 code), plus nz (ODD: times 1/16 plus nz, one fma). Exact (integers below
    2048, one rounding). ASM 2: one PTX block (``PTX_PAIR_EVEN`` / ``PTX_PAIR_ODD``; CUDA), 3: one
    AMDGCN block (``pair_ops.AMD_PAIR_EVEN`` / ``AMD_PAIR_ODD``: v_and_or_b32, v_pk_add_f16 /
    v_pk_fma_f16), else the same IEEE operations lane by lane in plain Triton: the same bits."""
    if ASM == 3:
        mask = tl.full(ws.shape, MASK_HI if ODD else MASK_LO, tl.uint32)
        magic = tl.full(ws.shape, MAGIC_F16, tl.uint32)
        if ODD:
            p = tl.inline_asm_elementwise(AMD_PAIR_ODD, "=&v,v,v,v,v,v",
                                          [ws, nz, mask, magic, tl.full(ws.shape, SIXTEENTH_F16, tl.uint32)],
                                          dtype=tl.uint32, is_pure=True, pack=1)
        else:
            p = tl.inline_asm_elementwise(AMD_PAIR_EVEN, "=&v,v,v,v,v", [ws, nz, mask, magic],
                                          dtype=tl.uint32, is_pure=True, pack=1)
    elif ASM:
        p = tl.inline_asm_elementwise(PTX_PAIR_ODD if ODD else PTX_PAIR_EVEN, "=r,r,r", [ws, nz],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return _f16_pair_plain(ws, nz, ODD)
    lo = p.to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _load_wt_pairs(qw_ptr, k0, offs_n, K, N, z, EVEN: tl.constexpr, BLOCK_K: tl.constexpr,
                   ASM: tl.constexpr, BF16: tl.constexpr):
    """W.T [BLOCK_N, BLOCK_K] code - zero of 4-bit GPTQ words, fp16 (BF16: bf16), two fields a
    pair op; ``z`` the integer zero points (uint32 [BLOCK_N]). fp16: fields (i, i + 4) are the
    ``_f16_pair`` of w >> 8 (i // 2), i odd in place; bf16: the ``pair_ops._bf16_pair`` of w >> 4i
    (ASM 3: the fp16 pairs converted, ``pair_ops._bf16_pair_f16``).
    The lanes joined back in ``_load_codes_t``'s order (field 4a + 2b + c at (a, b, c))."""
    w = _load_words_t(qw_ptr, k0, offs_n, K, N, 4, EVEN, BLOCK_K)
    if BF16 and ASM != 3:
        nb = _bf16_zero_pair(z)[:, None]
        l0, h0 = _bf16_pair(w, nb, ASM)  # fields 0, 4
        l1, h1 = _bf16_pair(w >> 4, nb, ASM)  # 1, 5
        l2, h2 = _bf16_pair(w >> 8, nb, ASM)  # 2, 6
        l3, h3 = _bf16_pair(w >> 12, nb, ASM)  # 3, 7
    else:
        w8 = w >> 8
        ne = _dot_zero_pair(z, False)[:, None]
        no = _dot_zero_pair(z, True)[:, None]
        if BF16:  # AMD: fp16 pairs converted (pair_ops._bf16_pair_f16)
            l0, h0 = _bf16_pair_f16(w, ne, False, ASM)  # fields 0, 4
            l1, h1 = _bf16_pair_f16(w, no, True, ASM)  # 1, 5
            l2, h2 = _bf16_pair_f16(w8, ne, False, ASM)  # 2, 6
            l3, h3 = _bf16_pair_f16(w8, no, True, ASM)  # 3, 7
        else:
            l0, h0 = _f16_pair(w, ne, False, ASM)  # fields 0, 4
            l1, h1 = _f16_pair(w, no, True, ASM)  # 1, 5
            l2, h2 = _f16_pair(w8, ne, False, ASM)  # 2, 6
            l3, h3 = _f16_pair(w8, no, True, ASM)  # 3, 7
    c = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
    return tl.reshape(c, (offs_n.shape[0], BLOCK_K))


@triton.jit
def _code_minus_zero(codes, z, x, DOT_F32: tl.constexpr, MAGIC16: tl.constexpr):
    """code - zero (broadcast) as exact fp32 (DOT_F32), or in x's dtype (MAGIC16 or via fp32)."""
    if DOT_F32:
        r = _magic_f32(codes, z + 8388608.0)
    elif MAGIC16 != 0:
        base = 1024.0 if MAGIC16 == 0x6400 else 128.0
        r = (codes | MAGIC16).to(tl.uint16).to(x.dtype, bitcast=True) - (z + base).to(x.dtype)
    else:
        r = _magic_f32(codes, z + 8388608.0).to(x.dtype)
    return r


@triton.jit
def _magic_f32(codes, zf):
    """codes - zero as exact fp32, with no int->float conversion instruction (those run at a
    fraction of the ALU rate): ``code | 0x4B000000`` read as fp32 is 2**23 + code, and
    ``zf`` = zero + 2**23."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - zf


@triton.jit
def _group_scale(s_ptr, g, offs_n, N, EVEN_N: tl.constexpr):
    """fp32 scales [BLOCK_N] of group g."""
    if EVEN_N:
        return tl.load(s_ptr + g * N + offs_n).to(tl.float32)
    else:
        return tl.load(s_ptr + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)


@triton.jit
def _group_zero(z_ptr, g, offs_n, N, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr):
    """fp32 zero points [BLOCK_N] of group g (SYM_ZERO without zero points)."""
    if not HAS_ZEROS:
        return tl.full(offs_n.shape, SYM_ZERO, tl.float32)
    elif EVEN_N:
        return tl.load(z_ptr + g * N + offs_n).to(tl.float32)
    else:
        return tl.load(z_ptr + g * N + offs_n, mask=offs_n < N, other=0).to(tl.float32)


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, g, offs_n, N, SYM_ZERO: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr):
    """fp32 scales and zero points [BLOCK_N] of group g."""
    s = _group_scale(s_ptr, g, offs_n, N, EVEN_N)
    return s, _group_zero(z_ptr, g, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)


@triton.jit
def _dequant_gathered(qw_ptr, code_mask, s_ptr, z_ptr, gidx_ptr, k0, offs_n, K, N,
                      FB: tl.constexpr, GROUP: tl.constexpr, SYM_ZERO: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, EVEN: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_K, BLOCK_N] fp32 dequantized rows k0 .. k0 + BLOCK_K when one tile holds several
    groups: a scale (and zero) gathered per element, from g_idx or from k // GROUP. Rows past
    K are not zero (the caller's x is 0 there); columns past N are."""
    codes = _load_codes(qw_ptr, code_mask, k0, offs_n, K, N, FB, EVEN, BLOCK_K)
    q = tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    if HAS_GIDX:
        g = tl.load(gidx_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        g = offs_k // GROUP
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    else:
        z = SYM_ZERO
    return (q - z) * s


@triton.jit
def _dot(x, w, acc, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + x @ w (x [BLOCK_M, BLOCK_K], w [BLOCK_K, BLOCK_N]), or with SWAP_AB acc + w @ x (w given
    as W.T [BLOCK_N, BLOCK_K], x as x.T [BLOCK_K, BLOCK_M], acc [BLOCK_N, BLOCK_M]); acc None:
    the product alone. DOT_F32: fp32 operands, IEEE dot."""
    if DOT_F32:
        if SWAP_AB:
            out = tl.dot(w, x.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    elif SWAP_AB:
        out = tl.dot(w.to(x.dtype), x, acc)
    else:
        out = tl.dot(x, w.to(x.dtype), acc)
    return out
