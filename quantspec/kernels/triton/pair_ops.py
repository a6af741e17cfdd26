"""Pair operations (two 16-bit lanes in a 32-bit register) for zero points, bf16 operands and AMD,
shared by the packed GEMVs (wq_gemv_packed.py, wq_gemv_preshuffled.py) and the tl.dot kernel's
inline-asm pairs (wq_dequant.py, layout.py); docs/decisions/packed-gemv.md.

* Zero pairs from the integer zero point, no conversion instruction (``_f16_pair_bits``).
* bf16 code - zero pairs: magic 0x4300 on CUDA (``_bf16_pair``), the fp16 pair converted on
  AMD (``_bf16_pair_f16``; gfx942 has no packed bf16 arithmetic).
* AMDGCN blocks: fp16 code - zero pairs (v_and_or_b32 + v_pk_add_f16 / v_pk_fma_f16), fp16
  lanes into fp32 sums (v_fma_mix_f32), the packed GEMV's chains.

Each asm template is a module constant (the tests emulate them instruction by instruction) and
each function computes the same bits in plain Triton (what the interpreter runs) as with asm.
"""

from __future__ import annotations

import triton
import triton.language as tl

# -- zero pairs from the integer -----------------------------------------------------------------
# The fp16 (bf16) value base + z * spacing, base a power of two and spacing its ulp, has the bits
# bits(base) + z while it stays below 2 * base: a pair of it is integer arithmetic (z * step + bits,
# doubled into both lanes), where the conversion route (u8 -> fp32 -> fma -> fp16 -> pack) costs
# about five instructions a pair.
F16_1024 = tl.constexpr(0x6400)  # 1024, spacing 1 up to 2048
F16_64 = tl.constexpr(0x5400)  # 64, spacing 1/16 up to 128
F16_4 = tl.constexpr(0x4400)  # 4, spacing 1/256 up to 8
BF16_128 = tl.constexpr(0x4300)  # bf16 128, spacing 1 up to 256 (7 stored mantissa bits)
SIGN16 = tl.constexpr(0x8000)


@triton.jit
def _f16_pair_bits(z, BASE_BITS: tl.constexpr, STEP: tl.constexpr):
    """The uint32 pair (v, v), v the 16-bit float with bits ``BASE_BITS + z * STEP`` (``z`` a uint32
    tensor). The caller keeps ``z * STEP`` inside the base's binade (no carry into the exponent),
    which makes v = base + z * STEP * spacing exactly."""
    v = z * STEP + BASE_BITS
    return v | (v << 16)


@triton.jit
def _gemv_zero_pairs(z):
    """The packed GEMVs' zero pairs (``wq_gemv_packed._dequant_f16x2``'s ``zc0``, ``zc1``) of integer
    zero points ``z`` (uint32, z < 64; a 4-bit code's are < 16): the fp16 pairs -(64 + z / 16)
    (bits 0xD400 + z) and -(4 + z / 16) (0xC400 + 16 z). Bit for bit ``_neg_pair_f16`` of the same
    values (test_packed_gemv_bit_tricks_match_their_emulation: every z < 64)."""
    return _f16_pair_bits(z, F16_64 | SIGN16, 1), _f16_pair_bits(z, F16_4 | SIGN16, 16)


@triton.jit
def _dot_zero_pair(z, ODD: tl.constexpr):
    """The fp16 pair that ``wq_dequant._f16_pair`` adds, for integer zero points ``z`` (uint32, z <
    64): even fields -(1024 + z) (bits 0xE400 + z), odd fields -(64 + z) (0xD400 + 16 z)."""
    if ODD:
        return _f16_pair_bits(z, F16_64 | SIGN16, 16)
    else:
        return _f16_pair_bits(z, F16_1024 | SIGN16, 1)


@triton.jit
def _bf16_zero_pair(z):
    """The bf16 pair -(128 + z) (bits 0xC300 + z) of integer zero points ``z`` (uint32, z < 128),
    for ``_bf16_pair``."""
    return _f16_pair_bits(z, BF16_128 | SIGN16, 1)


@triton.jit
def _group_zero_u32(z_ptr, g, offs_n, N, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr):
    """Integer zero points (uint32) [BLOCK_N] of group g (SYM_ZERO without zero points)."""
    if not HAS_ZEROS:
        return tl.full(offs_n.shape, SYM_ZERO, tl.float32).to(tl.uint32)  # a constant
    elif EVEN_N:
        return tl.load(z_ptr + g * N + offs_n).to(tl.uint32)
    else:
        return tl.load(z_ptr + g * N + offs_n, mask=offs_n < N, other=0).to(tl.uint32)


# -- bf16 code - zero pairs (the tl.dot kernel's operand with bf16 x) ------------------------------
# (w & 0x000F000F) | 0x43004300 read as bf16 lanes is (128 + c_lo, 128 + c_hi) exactly: bf16 keeps 7
# mantissa bits, 128 = 2**7 has spacing 1 up to 256, and a code c < 16 sits in the low mantissa
# bits. Minus the pair 128 + z it is c - z, an integer below 16 in magnitude: exact in bf16, so
# the fma's one rounding changes nothing (test_dot_pair_blocks_match_the_plain_pair_ops: every code,
# both lanes, every z < 16). A field at bits 4-7 would reach the exponent's low bit (bit 7), so
# unlike fp16 each pair takes its own shift (fields (j, j + 4) at w >> 4j). fma.rn.bf16x2 times
# 1.0 (sm_80 on; sub.bf16x2 needs sm_90); lop3 LUT 0xEA = (a & b) | c.
PTX_BF16_PAIR = tl.constexpr("{.reg .b32 t, one; mov.b32 one, 0x3F803F80; "
                             "lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 $0, t, one, $2;}")


@triton.jit
def _bf16_pair(ws, nz, ASM: tl.constexpr):
    """bf16 (lo, hi) = code - zero of the 4-bit fields at bits 0-3 and 16-19 of uint32 ``ws``, ``nz``
    the uint32 bf16 pair -(128 + zero) (``_bf16_zero_pair``). ASM 2: one PTX block
    (``PTX_BF16_PAIR``); else the same exact values through fp32 (a bf16 lane is an fp32's high
    half: the conversions and the sum are exact), which the interpreter computes right."""
    if ASM == 2:
        p = tl.inline_asm_elementwise(PTX_BF16_PAIR, "=r,r,r", [ws, nz], dtype=tl.uint32, is_pure=True, pack=1)
        return p.to(tl.uint16).to(tl.bfloat16, bitcast=True), (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        t = (ws & 0x000F000F) | 0x43004300
        lo = (t << 16).to(tl.float32, bitcast=True) + (nz << 16).to(tl.float32, bitcast=True)
        hi = (t & 0xFFFF0000).to(tl.float32, bitcast=True) + (nz & 0xFFFF0000).to(tl.float32, bitcast=True)
        return lo.to(tl.bfloat16), hi.to(tl.bfloat16)


# -- AMDGCN fp16 code - zero pairs (``wq_dequant._f16_pair`` with ASM 3) ---------------------------
# the register operands of the AMDGCN blocks (the tests' emulation reads these same constants)
MASK_LO = tl.constexpr(0x000F000F)  # the fields at bits 0-3 and 16-19
MASK_HI = tl.constexpr(0x00F000F0)  # bits 4-7 and 20-23 (odd fields in place)
MAGIC_F16 = tl.constexpr(0x64006400)  # (1024, 1024)
SIXTEENTH_F16 = tl.constexpr(0x2C002C00)  # (1/16, 1/16)
PERM_HIGH_HALVES = tl.constexpr(0x07060302)  # v_perm_b32: the high halves of the two sources
# v_and_or_b32 (plain Triton's and + or, which LLVM keeps as two instructions) then v_pk_add_f16 with
# the zero pair (odd fields: v_pk_fma_f16 times 1/16). $0 early-clobbered (written before $2 is
# read); gfx9's VOP3 takes no literal, so the mask, the magic and 1/16 come in registers ($3-$5).
AMD_PAIR_EVEN = tl.constexpr("v_and_or_b32 $0, $1, $3, $4\nv_pk_add_f16 $0, $0, $2")
AMD_PAIR_ODD = tl.constexpr("v_and_or_b32 $0, $1, $3, $4\nv_pk_fma_f16 $0, $0, $5, $2")
# bf16 on AMD: that fp16 pair, each lane converted to fp32 (exact) and the two high halves packed by
# v_perm_b32 (selector 0x07060302: bytes 2, 3 of the second source, then of the first), which is the
# bf16 pair: |code - zero| < 16 has at most 4 significant bits, so the dropped low halves are zero.
# $1 scratch (the fp16 pair, then the high lane in fp32); $2 the word, $3 the fp16 zero pair, $4
# mask, $5 magic, $6 the selector, $7 1/16 (odd fields).
_AMD_TO_BF16 = ("\nv_cvt_f32_f16_e32 $0, $1\nv_cvt_f32_f16_sdwa $1, $1 dst_sel:DWORD dst_unused:UNUSED_PAD "
                "src0_sel:WORD_1\nv_perm_b32 $0, $1, $0, $6")
AMD_BF16_PAIR_EVEN = tl.constexpr("v_and_or_b32 $1, $2, $4, $5\nv_pk_add_f16 $1, $1, $3" + _AMD_TO_BF16)
AMD_BF16_PAIR_ODD = tl.constexpr("v_and_or_b32 $1, $2, $4, $5\nv_pk_fma_f16 $1, $1, $7, $3" + _AMD_TO_BF16)


@triton.jit
def _f16_pair_plain(ws, nz, ODD: tl.constexpr):
    """``wq_dequant._f16_pair``'s plain-Triton form: fp16 (lo, hi) = code - zero of the fields
    (ws & 0x000F000F) | 0x64006400 (ODD: 0x00F000F0, times 1/16) plus the fp16 pair ``nz``."""
    t = (ws & (0x00F000F0 if ODD else 0x000F000F)) | 0x64006400
    lo = t.to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (t >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    n = nz.to(tl.uint16).to(tl.float16, bitcast=True)
    if ODD:
        sixteenth = tl.full(lo.shape, 0.0625, tl.float16)
        return tl.fma(lo, sixteenth, n), tl.fma(hi, sixteenth, n)
    return lo + n, hi + n


@triton.jit
def _bf16_pair_f16(ws, nz, ODD: tl.constexpr, ASM: tl.constexpr):
    """bf16 (lo, hi) = code - zero through the fp16 pair of ``wq_dequant._f16_pair`` (its fields and
    ``nz``, the fp16 pair of ``_dot_zero_pair``). ASM 3: one AMDGCN block (``AMD_BF16_PAIR_*``);
    else plain Triton: the same fp16 operations, the lanes converted to bf16 (exact)."""
    if ASM == 3:
        mask = tl.full(ws.shape, MASK_HI if ODD else MASK_LO, tl.uint32)
        magic = tl.full(ws.shape, MAGIC_F16, tl.uint32)
        sel = tl.full(ws.shape, PERM_HIGH_HALVES, tl.uint32)
        if ODD:
            p, _ = tl.inline_asm_elementwise(
                AMD_BF16_PAIR_ODD, "=&v,=&v,v,v,v,v,v,v",
                [ws, nz, mask, magic, sel, tl.full(ws.shape, SIXTEENTH_F16, tl.uint32)],
                dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        else:
            p, _ = tl.inline_asm_elementwise(AMD_BF16_PAIR_EVEN, "=&v,=&v,v,v,v,v,v", [ws, nz, mask, magic, sel],
                                             dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        return p.to(tl.uint16).to(tl.bfloat16, bitcast=True), (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        lo, hi = _f16_pair_plain(ws, nz, ODD)
        return lo.to(tl.float32).to(tl.bfloat16), hi.to(tl.float32).to(tl.bfloat16)


# -- AMDGCN chains of the packed GEMV (PACKED 3) -----------------------------------------------------
# LLVM's hazard recognizer cannot see into inline asm: on gfx942 it puts an s_nop between two asm
# statements when the second reads what the first wrote (it assumes the first may forward a partial
# write), so a chain of dependent pair operations goes into one statement. v_fma_mix_f32: fp32 x
# times the fp16 lane of a pair (op_sel_hi marks src1 f16, op_sel picks its high half) plus fp32, one
# rounding; the lane's conversion is exact, so it is the plain form's conversion and fp32 fma.
AMD_DEQUANT_PAIR = tl.constexpr("v_and_or_b32 $0, $1, $2, $3\nv_pk_fma_f16 $0, $0, $4, $5")
AMD_FMA4_F16X2 = tl.constexpr("v_pk_fma_f16 $0, $2, $6, $1\nv_pk_fma_f16 $0, $3, $7, $0\n"
                              "v_pk_fma_f16 $0, $4, $8, $0\nv_pk_fma_f16 $0, $5, $9, $0")
_MIX_LO = "v_fma_mix_f32 $0, ${x}, ${d}, ${c} op_sel_hi:[0,1,0]"
_MIX_HI = "v_fma_mix_f32 $0, ${x}, ${d}, ${c} op_sel:[0,1,0] op_sel_hi:[0,1,0]"
# $1 acc, $2-$9 x0..x7, $10-$13 d0..d3: x_i times lo(d_i), x_{i+4} times hi(d_i), i = 0..3, in order
AMD_MIX8 = tl.constexpr("\n".join(
    (_MIX_LO.format(x=2 + i, d=10 + i, c=1 if i == 0 else 0) + "\n" + _MIX_HI.format(x=6 + i, d=10 + i, c=0))
    for i in range(4)))
AMD_MIX2 = tl.constexpr(_MIX_LO.format(x=1, d=3, c=4) + "\n" + _MIX_HI.format(x=2, d=3, c=0))  # $1 xa, $2 xb, $3 d, $4 acc


@triton.jit
def _amd_dequant_pair(w, m, c, zc):
    """((w & m) | 0x64006400) * c + zc per fp16 lane, rounded once (``wq_gemv_packed._dequant_pair``):
    v_and_or_b32 and v_pk_fma_f16 in one block."""
    magic = tl.full(w.shape, MAGIC_F16, tl.uint32)
    return tl.inline_asm_elementwise(AMD_DEQUANT_PAIR, "=&v,v,v,v,v,v", [w, m, magic, c, zc], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _amd_fma4_f16x2(h, x0, x1, x2, x3, d0, d1, d2, d3):
    """h + x0 d0 + x1 d1 + x2 d2 + x3 d3 per fp16 lane, four v_pk_fma_f16 in this order (one block)."""
    return tl.inline_asm_elementwise(AMD_FMA4_F16X2, "=&v,v,v,v,v,v,v,v,v,v", [h, x0, x1, x2, x3, d0, d1, d2, d3],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _amd_mix8(acc, x0, x1, x2, x3, x4, x5, x6, x7, d0, d1, d2, d3):
    """acc + x0 lo(d0) + x4 hi(d0) + x1 lo(d1) + x5 hi(d1) + ... + x7 hi(d3) in fp32 (fp32 x, fp16
    pairs d), eight v_fma_mix_f32 in this order (one block)."""
    return tl.inline_asm_elementwise(AMD_MIX8, "=&v,v,v,v,v,v,v,v,v,v,v,v,v,v",
                                     [acc, x0, x1, x2, x3, x4, x5, x6, x7, d0, d1, d2, d3],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fma_pair_f32(xa, xb, d, acc, PACKED: tl.constexpr):
    """acc + xa * lo(d) + xb * hi(d) in fp32 (fp32 ``xa``, ``xb``, ``acc``, fp16 pairs ``d``), two fmas
    in this order, the lanes converted exactly: PACKED 3 one block of two v_fma_mix_f32
    (``AMD_MIX2``), else plain Triton."""
    if PACKED == 3:
        return tl.inline_asm_elementwise(AMD_MIX2, "=&v,v,v,v,v", [xa, xb, d, acc], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        lo = d.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (d >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.fma(xb, hi, tl.fma(xa, lo, acc))
