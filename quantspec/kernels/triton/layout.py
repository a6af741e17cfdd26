"""Pre-shuffled ("mma") layout of 4-bit qweight for the tl.dot kernel's swapped product.

The GPTQ layout (``wq_gemm.py``: int32 [ceil(K/8), N], a word = 8 consecutive K rows of one
column) is coalesced along N, but wgmma / mma.sync want each thread to hold, per 16-wide K step,
the A fragment of W.T: rows n = g and g + 8 (g = lane // 4) and columns k = 2c, 2c + 1, 2c + 8,
2c + 9 (c = lane % 4) of a 16 x 16 block. One GPTQ word is split over 4 threads, so the compiler
passes the tile through shared memory (STS.128 + LDSM) before wgmma.

``preshuffle`` rewrites the words so that one word holds one thread's fragment of one 16 x 16
block, nibble ``p = r1 + 2*r2 + 4*k0`` = code of (n = g + 8*r1, k = 2c + 8*r2 + k0), and a thread's
words for 4 consecutive K steps are adjacent (one 16-byte load):

* ``qweight_mma`` int32 [ceil(N/16), ceil(K/64), 128] (3-D, so that it is never taken for a GPTQ
  qweight: the launcher refuses either in the other's place); word ``[nb, kb, 16*g + 4*c + s]``
  covers rows n = 16*nb + g + {0, 8} and k = 64*kb + 16*s + 2*c + {0, 1, 8, 9}; N is padded to a
  multiple of 16 and K to 64 with code 0 (the kernel's x is 0 past K, its output masked past N).
* The nibble order makes the magic numbers convert two fields per 32-bit op: register j of a
  fragment (the pair wgmma reads from one 32-bit register: k0 = 0, 1) is nibbles j and j + 4,
  so ``((w >> 4*j) & 0x000F000F) | 0x64006400`` is the fp16 pair (1024 + code, 1024 + code);
  fp16 odd j skip the shift (``_fragment_register``).

``LAYOUT_MFMA`` ("mfma16x128", int32 [ceil(N/16), ceil(K/128), 256]) does the same for AMD's MFMA
16x16x16 with kpack 2 (``_load_wt_mfma``): lane l = 16 q + r holds row r and the 8 consecutive K
8 q .. 8 q + 7 of each 32-wide K block (the register group of kWidth 8), its words for 4 such
blocks adjacent. The GPTQ word already is such a group (8 consecutive K of one row), but the
coalesced load spreads a tile over the warps along K where MFMA splits N, so it passes through
LDS; the pair order within the word is the same as above (register j = K 2j, 2j + 1).

Supported: 4-bit fields (bits 4 and 3). Everything else keeps the GPTQ layout
(``preshuffle_reason`` says why). Scales and zeros keep their [G, N] layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pair_ops import _bf16_pair, _bf16_pair_f16, _bf16_zero_pair, _dot_zero_pair
from .wq_dequant import _code_minus_zero, _f16_pair

LAYOUT_GPTQ = "gptq"
LAYOUT_MMA = "mma16x64"
LAYOUT_MFMA = "mfma16x128"
LAYOUTS = (LAYOUT_GPTQ, LAYOUT_MMA, LAYOUT_MFMA)
PRESHUFFLED_CODE = {LAYOUT_GPTQ: 0, LAYOUT_MMA: 1, LAYOUT_MFMA: 2}  # _wq_dot_kernel's PRESHUFFLED
N_ATOM = 16  # rows of N in one atom


def preshuffle_reason(bits: int, group: int, has_gidx: bool) -> str | None:
    """Why the pre-shuffled layout cannot hold a weight (None: it can). ``group`` is the group
    length (a large number per channel); the kernel's K tile (<= 128) must sit in one group."""
    if bits not in (3, 4):
        return f"only 4-bit fields are pre-shuffled ({bits}-bit codes keep the GPTQ layout)"
    if has_gidx:
        return "a g_idx (act-order gathered per element) keeps the GPTQ layout"
    if group % 128:
        return f"group {group} is not a multiple of 128 (the K tile must sit in one group)"
    return None


def _codes_kn(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """int64 codes [K, N] of a GPTQ-layout 4-bit qweight."""
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int64) * 4
    return ((w[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])[:k]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


# layout -> (K atom, the K atom's dims and the N atom's dims as a view of codes [K, N], the permute
# of (kb, *k dims, nb, *n dims) that orders them as [nb, kb, word, nibble])
_ATOMS = {
    # k = 64 kb + 16 s + 8 r2 + 2 c + k0, n = 16 nb + 8 r1 + g -> nb, kb, (g, c, s), (k0, r2, r1)
    LAYOUT_MMA: (64, (4, 2, 4, 2), (2, 8), (5, 0, 7, 3, 1, 4, 2, 6)),
    # k = 128 kb + 32 i + 8 q + 4 r2 + 2 r1 + k0, n = 16 nb + r -> nb, kb, (q, r, i), (k0, r2, r1)
    LAYOUT_MFMA: (128, (4, 4, 2, 2, 2), (16,), (6, 0, 2, 7, 1, 5, 3, 4)),
}


def atom_shape(layout: str, n: int, k: int) -> tuple[int, int, int]:
    """The pre-shuffled qweight's shape for N x K in ``layout``."""
    ka = _ATOMS[layout][0]
    return -(-n // N_ATOM), -(-k // ka), ka * N_ATOM // 8


def preshuffle(qweight: torch.Tensor, k: int, layout: str = LAYOUT_MMA) -> torch.Tensor:
    """GPTQ-layout 4-bit qweight int32 [ceil(K/8), N] -> the pre-shuffled ``layout`` (module doc)."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] != -(-k // 8):
        raise ValueError(f"qweight must be int32 [{-(-k // 8)}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    ka, kdims, ndims, perm = _ATOMS[layout]
    n = qweight.shape[1]
    nb, kb, words = atom_shape(layout, n, k)
    codes = torch.zeros((kb * ka, nb * N_ATOM), dtype=torch.int64, device=qweight.device)
    codes[:k, :n] = _codes_kn(qweight, k)
    t = codes.view(kb, *kdims, nb, *ndims).permute(*perm).reshape(nb, kb, words, 8)
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int64) * 4
    return _to_int32((t << shifts).sum(dim=-1))


def unshuffle(qweight_ps: torch.Tensor, k: int, n: int, layout: str = LAYOUT_MMA) -> torch.Tensor:
    """The inverse of ``preshuffle``: the GPTQ-layout qweight int32 [ceil(K/8), N]."""
    ka, kdims, ndims, perm = _ATOMS[layout]
    shape = atom_shape(layout, n, k)
    if qweight_ps.dtype != torch.int32 or tuple(qweight_ps.shape) != shape:
        raise ValueError(f"a {layout} qweight must be int32 {list(shape)}, got {qweight_ps.dtype} {tuple(qweight_ps.shape)}")
    nb, kb, _ = shape
    w = qweight_ps.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, device=w.device, dtype=torch.int64) * 4
    full_shape = (kb, *kdims, nb, *ndims)
    t = ((w[..., None] >> shifts) & 0xF).reshape([full_shape[p] for p in perm])
    inverse = sorted(range(len(perm)), key=lambda d: perm[d])
    codes = t.permute(*inverse).reshape(kb * ka, nb * N_ATOM)[:k, :n]
    kw = -(-k // 8)
    full = torch.zeros((kw * 8, n), dtype=torch.int64, device=w.device)
    full[:k] = codes
    return _to_int32((full.view(kw, 8, n) << shifts.view(1, 8, 1)).sum(dim=1))


@triton.jit
def _fragment_register(w, J: tl.constexpr, zr, x, DOT_F32: tl.constexpr, MAGIC16: tl.constexpr,
                       ZERO_PAIRS: tl.constexpr, ASM: tl.constexpr = 0):
    """Lanes 0 and 1 (k0 = 0, 1) of fragment register J of each word, code - zero in x's dtype
    (fp32 with DOT_F32). ``zr`` (broadcast over the word's row): the fp32 zero, with ZERO_PAIRS
    the uint32 pair ``(MAGIC16 + 16 - zero) * 0x10001`` (zero points < 16), with ASM the
    integer zero point (uint32).

    With a magic number (fp16 0x6400 = 1024, bf16 0x4300 = 128) both lanes come from 32-bit
    ops on the whole word: ``((w >> 4J) & 0x000F000F) | magic`` is base + code (one shift, one
    LOP3, then one HADD2 a pair takes base + zero off); with zero points the pair is added as an
    integer instead (``+ zr``: base + 16 + code - zero, exact, one IADD more) and the constant
    base + 16 taken off. fp16 odd J keep the fields in place (no shift): ``w' & 0x00F000F0`` with
    the magic is 1024 + 16 code, scaled by 1/16 in the HFMA2 that takes the rest off. ASM (2:
    PTX, 3: AMDGCN; never with ZERO_PAIRS): each pair one asm block with the pair -(base + zero)
    built from the integer (``wq_dequant._f16_pair``, ``pair_ops._bf16_pair`` / ``_bf16_pair_f16``)."""
    if ASM:
        tl.static_assert(not ZERO_PAIRS and not DOT_F32 and MAGIC16 != 0)
        if MAGIC16 == 0x6400 or ASM == 3:  # fp16 pairs (bf16 on AMD: converted, pair_ops._bf16_pair_f16)
            ODD_: tl.constexpr = J % 2 == 1
            ws = w >> (4 * (J - 1)) if ODD_ else w >> (4 * J)
            if MAGIC16 == 0x6400:
                return _f16_pair(ws, _dot_zero_pair(zr, ODD_), ODD_, ASM)
            else:
                return _bf16_pair_f16(ws, _dot_zero_pair(zr, ODD_), ODD_, ASM)
        else:
            return _bf16_pair(w >> (4 * J), _bf16_zero_pair(zr), ASM)
    if DOT_F32 or MAGIC16 == 0:
        t = (w >> (4 * J)) & 0x000F000F
        return _code_minus_zero(t & 0xF, zr, x, DOT_F32, 0), _code_minus_zero(t >> 16, zr, x, DOT_F32, 0)
    ODD: tl.constexpr = MAGIC16 == 0x6400 and J % 2 == 1
    ODD_FIX: tl.constexpr = 2**32 - (15 * 0x6400 * 65537) % 2**32  # 16 zr + this = (1024 + 16 (16 - z)) pairs
    if ODD:
        t = (w >> (4 * (J - 1))) & 0x00F000F0
    else:
        t = (w >> (4 * J)) & 0x000F000F
    if ZERO_PAIRS:  # + (1024 + 16 - z) in both lanes, the odd fields 16 times that
        t = t + (zr * 16 + ODD_FIX if ODD else zr)
        zc = 80.0 if ODD else (1040.0 if MAGIC16 == 0x6400 else 144.0)
    else:
        t = t | (MAGIC16 * 65537)
        zc = (zr + 64.0) if ODD else (zr + (1024.0 if MAGIC16 == 0x6400 else 128.0))
    lo = t.to(tl.uint16).to(x.dtype, bitcast=True)
    hi = (t >> 16).to(tl.uint16).to(x.dtype, bitcast=True)
    if ODD:  # an explicit fma: one HFMA2 whether or not the compiler contracts a * b - c
        sixteenth = tl.full(lo.shape, 0.0625, tl.float16)
        nz = (-zc).to(tl.float16)
        return tl.fma(lo, sixteenth, nz), tl.fma(hi, sixteenth, nz)
    return lo - zc.to(x.dtype), hi - zc.to(x.dtype)


@triton.jit
def _load_words(qw_ptr, k0, pid_n, K, N, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                KA: tl.constexpr, KB_OUTER: tl.constexpr = False):
    """uint32 words [BLOCK_N / 16, BLOCK_K / KA * 2 KA] of a pre-shuffled qweight with K atom KA (64:
    mma16x64, 128: mfma16x128): atoms pid_n * BLOCK_N / 16 .. along N, k0 / KA .. along K, each
    atom's 2 KA words in memory order; KB_OUTER: [BLOCK_K / KA, BLOCK_N / 16, 2 KA] (the K blocks
    outermost: the compiler spreads warps over N, a thread's K blocks stay its own). Atoms past the
    qweight read as 0 (EVEN: none are)."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // KA
    rows = pid_n * NB + tl.arange(0, NB)
    row_words = tl.cdiv(K, KA) * (2 * KA)
    if KB_OUTER:
        kbs = k0 // KA + tl.arange(0, KB)
        cols = kbs[:, None, None] * (2 * KA) + tl.arange(0, 2 * KA)[None, None, :]
        ptrs = qw_ptr + rows[None, :, None] * row_words + cols
        mask = (rows[None, :, None] < tl.cdiv(N, 16)) & (kbs[:, None, None] < tl.cdiv(K, KA))
    else:
        cols = (k0 // KA) * (2 * KA) + tl.arange(0, BLOCK_K * 2)
        ptrs = qw_ptr + rows[:, None] * row_words + cols[None, :]
        mask = (rows[:, None] < tl.cdiv(N, 16)) & (cols[None, :] < row_words)
    if EVEN:
        words = tl.load(ptrs)
    else:
        words = tl.load(ptrs, mask=mask, other=0)
    return words.to(tl.uint32, bitcast=True)


@triton.jit
def _load_wt_mma(qw_ptr, z, x, k0, pid_n, K, N, DOT_F32: tl.constexpr, MAGIC16: tl.constexpr,
                 EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, ASM: tl.constexpr = 0):
    """W.T [BLOCK_N, BLOCK_K] minus zero (``z`` fp32 [BLOCK_N]) of rows pid_n * BLOCK_N .. and
    columns k0 .. of a pre-shuffled qweight, in x's dtype (fp32 with DOT_F32). BLOCK_N a multiple
    of 16, BLOCK_K of 64. Each thread's words are its fragment's, so the permute and reshape at
    the end rename registers (no shared-memory step before the dot)."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    words = _load_words(qw_ptr, k0, pid_n, K, N, EVEN, BLOCK_N, BLOCK_K, 64)
    w = tl.reshape(words, (NB, KB, 8, 4, 4))  # nb, kb, g, c, s
    ZERO_PAIRS: tl.constexpr = HAS_ZEROS and MAGIC16 != 0 and not DOT_F32 and not ASM
    if ZERO_PAIRS:
        z = ((MAGIC16 + 16) - z.to(tl.int32)).to(tl.uint32) * 65537
    elif ASM:
        z = z.to(tl.uint32)  # the asm pairs' zero pairs are built from the integer
    z0, z1 = tl.split(tl.permute(tl.reshape(z, (NB, 2, 8)), (0, 2, 1)))  # rows g and g + 8
    z0 = tl.reshape(z0, (NB, 1, 8, 1, 1))
    z1 = tl.reshape(z1, (NB, 1, 8, 1, 1))
    a0, b0 = _fragment_register(w, 0, z0, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    a1, b1 = _fragment_register(w, 1, z1, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    a2, b2 = _fragment_register(w, 2, z0, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    a3, b3 = _fragment_register(w, 3, z1, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    # each join appends a minor dim: [nb, kb, g, c, s, k0, r1, r2] (register j = r1 + 2 r2)
    v = tl.join(tl.join(tl.join(a0, b0), tl.join(a1, b1)), tl.join(tl.join(a2, b2), tl.join(a3, b3)))
    # -> [nb, r1, g | kb, s, r2, c, k0]: n = 16 nb + 8 r1 + g, k = 64 kb + 16 s + 8 r2 + 2 c + k0
    v = tl.permute(v, (0, 6, 2, 1, 4, 7, 3, 5))
    return tl.reshape(v, (BLOCK_N, BLOCK_K))


@triton.jit
def _load_wt_mfma(qw_ptr, z, x, k0, pid_n, K, N, DOT_F32: tl.constexpr, MAGIC16: tl.constexpr,
                  EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_ZEROS: tl.constexpr, ASM: tl.constexpr = 0):
    """``_load_wt_mma`` for the mfma16x128 layout: word [nb, kb, 4 l + i] (lane l = 16 q + r) is
    row 16 nb + r, k = 128 kb + 32 i + 8 q + 2 j + k0 at nibble j + 4 k0: the 8 consecutive K of
    one row MFMA 16x16x16 with kpack 2 (kWidth 8) keeps in a lane, 4 K blocks of 32 a 16-byte
    load. BLOCK_K a multiple of 128."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 128
    words = _load_words(qw_ptr, k0, pid_n, K, N, EVEN, BLOCK_N, BLOCK_K, 128)
    w = tl.reshape(words, (NB, KB, 4, 16, 4))  # nb, kb, q, r, i
    ZERO_PAIRS: tl.constexpr = HAS_ZEROS and MAGIC16 != 0 and not DOT_F32 and not ASM
    if ZERO_PAIRS:
        z = ((MAGIC16 + 16) - z.to(tl.int32)).to(tl.uint32) * 65537
    elif ASM:
        z = z.to(tl.uint32)  # the asm pairs' zero pairs are built from the integer
    zr = tl.reshape(z, (NB, 1, 1, 16, 1))
    a0, b0 = _fragment_register(w, 0, zr, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    a1, b1 = _fragment_register(w, 1, zr, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    a2, b2 = _fragment_register(w, 2, zr, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    a3, b3 = _fragment_register(w, 3, zr, x, DOT_F32, MAGIC16, ZERO_PAIRS, ASM)
    v = tl.join(tl.join(tl.join(a0, b0), tl.join(a1, b1)), tl.join(tl.join(a2, b2), tl.join(a3, b3)))
    # [nb, kb, q, r, i, k0, r1, r2] -> [nb, r | kb, i, q, r2, r1, k0]
    v = tl.permute(v, (0, 3, 1, 4, 2, 7, 6, 5))
    return tl.reshape(v, (BLOCK_N, BLOCK_K))
