"""Weight-only quantized linear: ``y = x @ dequant(W).T + bias`` with fp32 accumulation.

Layout (the Triton backend's ``prepare`` writes it):

* ``qweight`` int32 [ceil(K / PF), N], PF = 32 // FB codes per word packed along K, where the
  field width FB is ``bits`` (2, 4, 8) or 4 for 3-bit codes; field i of word j is row
  ``PF * j + i`` (bits ``FB*i .. FB*i+FB-1``). N is the contiguous dimension, so a tile's words
  are coalesced loads. Rows past K are zero.
* ``scales`` [G, N] (fp16, bf16 or fp32), ``zeros`` uint8 [G, N] or None (symmetric: implicit
  zero ``2**(bits-1)``), ``g_idx`` int32 [K] or None (then the group of row k is ``k // group``).

Three paths, picked by M: a GEMV for M <= 2 (no tl.dot), a small-M tl.dot path for M <= 32 and
a tiled tl.dot path above. The GEMV has three kernels: the packed GEMV (``_wq_gemv_f16x2_kernel``,
fp16 / bf16 x and 4-bit fields: pairs of fp16 weights made by magic-number bit tricks, two
weights an instruction), the same on a pre-shuffled qweight (``_wq_gemv_ps_kernel``,
wq_gemv_preshuffled.py) and the fp32 GEMV (``_wq_gemv_kernel``: every other case of the GPTQ
layout; a pre-shuffled qweight the packed GEMV cannot take runs the tl.dot kernel). The GEMVs
and the small-M path split K over programs; partial sums go to an fp32 [SPLIT_K, M, N] buffer,
summed (with bias and the cast) by a second small kernel: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .tiles import EVEN as _EVEN, store_result as _store_result, swizzled_tile
from .pair_ops import _group_zero_u32
from .wq_dequant import (
    _code_minus_zero, _dequant_gathered, _dot, _group_scale, _group_scale_zero, _load_codes, _load_codes_t,
    _load_wt_pairs, _magic_f32)
from .layout import LAYOUT_GPTQ, LAYOUTS, PRESHUFFLED_CODE, _load_wt_mfma, _load_wt_mma, atom_shape, preshuffle_reason
from .prune import launch
from .wq_gemv_packed import _wq_gemv_f16x2_kernel
from .wq_gemv_preshuffled import _wq_gemv_ps_kernel

# The autotuner's key: the shape (M in power-of-2 buckets up to M_KEY_MAX) and the scheme's
# constexprs, so that a layer of another scheme with the same N, K tunes its own config (the
# autotuner adds the tensors' dtypes itself; names a kernel lacks are skipped)
AUTOTUNE_KEY = ("M_KEY", "N", "K", "SPLIT_K", "FB", "GROUP", "HAS_ZEROS", "HAS_GIDX", "PRESHUFFLED", "ASM",
                "PACKED", "DOT_F32")
M_KEY_MAX = configs.M_KEY_MAX
GEMV_MAX_M = 2  # on an H200 the small-M tl.dot path beat the GEMV at M = 4 (kernels-h200.md)
SMALL_M_MAX = 32
PER_CHANNEL_GROUP = 1 << 30  # the "group" of per-channel scales: every row is in group 0


def field_bits(bits: int) -> int:
    """Width of one code's field in a packed word: 3-bit codes use 4-bit fields."""
    return 4 if bits == 3 else bits


@_EVEN
@triton.jit
def _wq_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, b_ptr, out_ptr, part_ptr,
                    M, N, K, stride_xm, M_KEY, code_mask,
                    FB: tl.constexpr, GROUP: tl.constexpr, SYM_ZERO: tl.constexpr,
                    HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """M <= GEMV_MAX_M rows, no tl.dot: grid (cdiv(N, BLOCK_N), SPLIT_K); each program reduces a K range.

    A tile inside one group (no g_idx, GROUP % BLOCK_K == 0) is reduced on the integer codes
    (code - zero, exact in fp32) and scaled once per column; otherwise each element is
    dequantized with its gathered scale. ``code_mask`` = 2**FB - 1, at run time (see
    ``_load_codes``).
    """
    PF: tl.constexpr = 32 // FB
    KW: tl.constexpr = BLOCK_K // PF
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, KW)[:, None] * PF + tl.arange(0, PF)[None, :]  # [KW, PF]: row of each code
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
        k0 = t * BLOCK_K
        if HAS_GIDX or GROUP % BLOCK_K != 0:
            w = _dequant_gathered(qw_ptr, code_mask, s_ptr, z_ptr, gidx_ptr, k0, offs_n, K, N, FB, GROUP,
                                  SYM_ZERO, HAS_ZEROS, HAS_GIDX, EVEN_K and EVEN_N, BLOCK_K, BLOCK_N)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xmask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=xmask, other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
        else:
            codes = _load_codes(qw_ptr, code_mask, k0, offs_n, K, N, FB, EVEN_K and EVEN_N, BLOCK_K)
            s, z = _group_scale_zero(s_ptr, z_ptr, k0 // GROUP, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            qz = _magic_f32(codes, (z + 8388608.0)[None, None, :])  # [KW, PF, BN] code - zero
            for mi in tl.static_range(BLOCK_M):  # rows >= M read row mi % M and are never stored
                x_row = x_ptr + (mi % M) * stride_xm + k0
                if EVEN_K:
                    xm = tl.load(x_row + rows)
                else:
                    xm = tl.load(x_row + rows, mask=k0 + rows < K, other=0.0)
                a = tl.sum(tl.sum(xm.to(tl.float32)[:, :, None] * qz, axis=1), axis=0)  # [BN]
                acc += tl.where(offs_m[:, None] == mi, (a * s)[None, :], 0.0)
    _store_result(acc, offs_m, offs_n, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT_K)


@_EVEN
@triton.jit
def _wq_dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, b_ptr, out_ptr, part_ptr,
                   M, N, K, stride_xm, M_KEY, code_mask,
                   FB: tl.constexpr, GROUP: tl.constexpr, SYM_ZERO: tl.constexpr,
                   HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                   MAGIC16: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   SWAP_AB: tl.constexpr = False, PRESHUFFLED: tl.constexpr = 0, ASM: tl.constexpr = 0):
    """Tiled tl.dot: grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K), GROUP_M swizzle.

    Inside one group the weight operand is code - zero, built in x's dtype with no conversion
    instruction when MAGIC16 is set (fp16: ``0x6400 | code`` is 1024 + code; bf16, codes < 128:
    ``0x4300 | code`` is 128 + code; both exact), else through fp32. Small tiles (BLOCK_M <= 32:
    decode, memory-bound) multiply the scale into the dot's fp32 result, once per column; large
    tiles scale the operand so that the dots chain in one accumulator. A tile of several groups
    (g_idx, small groups) dequantizes each element in fp32. DOT_F32: fp32 operands, IEEE dot.
    SWAP_AB computes the transposed product, acc.T [BLOCK_N, BLOCK_M] += W.T @ x.T (the weight
    the left operand, x.T read from memory), transposed back for the store.
    ``code_mask`` is unused: the constant mask compiles better here (one signature for both).
    PRESHUFFLED: qweight in a ``layout.py`` layout, 1 mma16x64 (wgmma / mma.sync), 2 mfma16x128
    (MFMA kpack 2); 4-bit fields, the K tile in one group, no g_idx; unpacked as W.T with two
    fields per 32-bit op and no shared-memory step. ASM (``dot_asm``: 2 PTX, 3 AMDGCN; fp16 / bf16
    x, 4-bit fields): the pairs of code - zero as inline asm, the zero pair built
    from the integer zero point (``wq_dequant._f16_pair``, ``pair_ops._bf16_pair``), on every layout.
    """
    CODE_MASK: tl.constexpr = (1 << FB) - 1
    tl.static_assert(not ASM or (FB == 4 and not DOT_F32 and MAGIC16 != 0))
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, k_tiles)):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if SWAP_AB:  # x.T [BLOCK_K, BLOCK_M]
            x_ptrs = x_ptr + offs_k[:, None] + offs_m[None, :] * stride_xm
            if EVEN_K:
                x = tl.load(x_ptrs, mask=offs_m[None, :] < M, other=0.0)
            else:
                x = tl.load(x_ptrs, mask=(offs_m[None, :] < M) & (offs_k[:, None] < K), other=0.0)
        else:
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
            else:
                x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if PRESHUFFLED:
            tl.static_assert(FB == 4 and not HAS_GIDX and GROUP % BLOCK_K == 0)
            tl.static_assert(BLOCK_N % 16 == 0 and BLOCK_K % (64 * PRESHUFFLED) == 0)
            s, z = _group_scale_zero(s_ptr, z_ptr, k0 // GROUP, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            if PRESHUFFLED == 2:
                wt = _load_wt_mfma(qw_ptr, z, x, k0, pid_n, K, N, DOT_F32, MAGIC16, EVEN_K and EVEN_N,
                                   BLOCK_N, BLOCK_K, HAS_ZEROS, ASM)
            else:
                wt = _load_wt_mma(qw_ptr, z, x, k0, pid_n, K, N, DOT_F32, MAGIC16, EVEN_K and EVEN_N,
                                  BLOCK_N, BLOCK_K, HAS_ZEROS, ASM)  # W.T [BLOCK_N, BLOCK_K], code - zero
            if SWAP_AB and BLOCK_M <= 32:
                acc += _dot(x, wt, None, SWAP_AB, DOT_F32) * s[:, None]
            elif SWAP_AB:
                acc = _dot(x, wt * s.to(wt.dtype)[:, None], acc, SWAP_AB, DOT_F32)
            elif BLOCK_M <= 32:
                acc += _dot(x, tl.trans(wt), None, SWAP_AB, DOT_F32) * s[None, :]
            else:
                acc = _dot(x, tl.trans(wt * s.to(wt.dtype)[:, None]), acc, SWAP_AB, DOT_F32)
        elif HAS_GIDX or GROUP % BLOCK_K != 0:
            w = _dequant_gathered(qw_ptr, CODE_MASK, s_ptr, z_ptr, gidx_ptr, k0, offs_n, K, N, FB, GROUP,
                                  SYM_ZERO, HAS_ZEROS, HAS_GIDX, EVEN_K and EVEN_N, BLOCK_K, BLOCK_N)
            acc = _dot(x, tl.trans(w) if SWAP_AB else w, acc, SWAP_AB, DOT_F32)
        elif SWAP_AB and ASM:
            s = _group_scale(s_ptr, k0 // GROUP, offs_n, N, EVEN_N)
            z = _group_zero_u32(z_ptr, k0 // GROUP, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            wt = _load_wt_pairs(qw_ptr, k0, offs_n, K, N, z, EVEN_K and EVEN_N, BLOCK_K, ASM, MAGIC16 != 0x6400)
            if BLOCK_M <= 32:
                acc += _dot(x, wt, None, SWAP_AB, DOT_F32) * s[:, None]
            else:
                acc = _dot(x, wt * s.to(wt.dtype)[:, None], acc, SWAP_AB, DOT_F32)
        elif SWAP_AB:
            codes = _load_codes_t(qw_ptr, CODE_MASK, k0, offs_n, K, N, FB, EVEN_K and EVEN_N, BLOCK_K)
            s, z = _group_scale_zero(s_ptr, z_ptr, k0 // GROUP, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            wt = _code_minus_zero(codes, z[:, None], x, DOT_F32, MAGIC16)  # W.T [BLOCK_N, BLOCK_K]
            if BLOCK_M <= 32:
                acc += _dot(x, wt, None, SWAP_AB, DOT_F32) * s[:, None]
            else:
                acc = _dot(x, wt * s.to(wt.dtype)[:, None], acc, SWAP_AB, DOT_F32)
        else:
            codes = _load_codes(qw_ptr, CODE_MASK, k0, offs_n, K, N, FB, EVEN_K and EVEN_N, BLOCK_K)
            s, z = _group_scale_zero(s_ptr, z_ptr, k0 // GROUP, offs_n, N, SYM_ZERO, HAS_ZEROS, EVEN_N)
            if DOT_F32:
                wq = tl.reshape(_magic_f32(codes, (z + 8388608.0)[None, None, :]), (BLOCK_K, BLOCK_N))
            elif MAGIC16 != 0:
                base = 1024.0 if MAGIC16 == 0x6400 else 128.0
                v = (codes | MAGIC16).to(tl.uint16).to(x.dtype, bitcast=True)
                wq = tl.reshape(v - (z + base).to(x.dtype)[None, None, :], (BLOCK_K, BLOCK_N))
            else:
                wq = tl.reshape(_magic_f32(codes, (z + 8388608.0)[None, None, :]), (BLOCK_K, BLOCK_N)).to(x.dtype)
            if BLOCK_M <= 32:  # the scale of column n: along acc's columns, or rows with SWAP_AB
                if SWAP_AB:
                    acc += _dot(x, wq, None, SWAP_AB, DOT_F32) * s[:, None]
                else:
                    acc += _dot(x, wq, None, SWAP_AB, DOT_F32) * s[None, :]
            else:
                acc = _dot(x, wq * s.to(wq.dtype)[None, :], acc, SWAP_AB, DOT_F32)
    if SWAP_AB:
        acc = tl.trans(acc)
    _store_result(acc, offs_m, offs_n, M, N, pid_k, b_ptr, out_ptr, part_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s part[s, m, n] (+ bias[n]), cast to out's dtype. Grid cdiv(M*N, BLOCK).
    Offsets in int64 (M * N may pass 2**31)."""
    size = tl.cast(M, tl.int64) * N
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _magic16(dtype: torch.dtype, fb: int) -> int:
    """The 16-bit pattern that turns a code into ``base + code`` in x's dtype with one OR (fp16:
    0x6400 = 1024, codes < 1024; bf16: 0x4300 = 128, codes < 128), or 0: build in fp32. The
    interpreter computes bf16 wrongly, so bf16 runs there in fp32 (DOT_F32)."""
    if dtype == torch.float16:
        return 0x6400
    if dtype == torch.bfloat16 and fb <= 4 and not configs.interpreting():
        return 0x4300
    return 0


# The inline-asm pair operations (PACKED 2 / 3) are compiled and counted here but have not run on a
# GPU yet: until the gpu-marked tests (tests/test_triton_kernels.py) pass with them on hardware, the
# launcher runs the plain-Triton pair operations (PACKED 1, what the interpreter tests) on every
# target; ``asm=True`` (the AOT compiles, the gpu test of the asm path) selects them.
ASM_PAIR_OPS = False


# The same for the tl.dot kernel (ASM, ``dot_asm``: 4-bit fields, fp16 and bf16 x, CUDA and ROCm,
# with and without zero points; each pair of code - zero one asm block). Compiled here, sm90 small-M
# fp16 W4 g128 sym goes from 3.328 to 2.984 instructions per weight on mma16x64 and from 4.891 to 3.75
# on the GPTQ layout (docs/decisions/preshuffled-layout.md; bf16 asym and gfx942 in
# benchmarks/results/kernel-isa.md). Off until the gpu-marked tests pass with it and a GPU session
# times it (benchmarks/gpu_session.sh, phase asm).
ASM_DOT_PAIR_OPS = False


def dot_asm(backend: str, dtype: torch.dtype, fb: int, has_gidx: bool, asm: bool = ASM_DOT_PAIR_OPS) -> int:
    """ASM of ``_wq_dot_kernel``: with ``asm``, fp16 or bf16 x, 4-bit fields and no g_idx, 2 (PTX) on
    CUDA, 3 (AMDGCN) on ROCm; else 0, the plain-Triton pair operations (the interpreter, fp32 x; a
    g_idx tile is dequantized per element, with no pairs)."""
    if not asm or fb != 4 or has_gidx or dtype not in (torch.float16, torch.bfloat16):
        return 0
    return {"cuda": 2, "hip": 3}.get(backend, 0)


# The small-M tl.dot path computes the transposed product (``SWAP_AB``) on these backends: compiled
# here (benchmarks/results/kernel-isa.md, docs/decisions/small-m-swap-ab.md) it takes sm90's main
# loop from 6.09 to 4.89 instructions per weight (fp16 W4 g128; the weight the register operand of
# wgmma) and gfx942's from 9.25 to 4.5; except 2-bit fields on CUDA (sm90 8.05 -> 9.33, kept
# plain). Not yet timed on a GPU; the interpreter keeps the plain product (the interpreter tests
# force SWAP_AB in test_small_m_swap_ab_matches_reference).
SWAP_AB_BACKENDS: frozenset[str] = frozenset({"cuda", "hip"})


# The tiled (large-M) path with SWAP_AB: on sm90 wgmma then reads the dequantized weight from
# registers instead of a shared-memory copy. Compiled here (fp16 W4 g128 sym, GPTQ layout, 128 x 256
# x 64, 8 warps): main loop 405 -> 374 instructions (6.33 -> 5.84 per weight), STS 96 -> 41, shared
# memory 128 -> 80 KB (kernel-isa.md, large_m_swap rows); on the mma16x64 layout 3.80 -> 4.06. Not
# timed: off until a GPU run decides (gpu_session.sh phase swap, kernel_speed.py --swap-large-m).
SWAP_AB_LARGE_M_BACKENDS: frozenset[str] = frozenset()


def swap_ab(family: str, backend: str, fb: int) -> bool:
    """Whether ``_wq_dot_kernel`` runs with SWAP_AB for a family ("small_m" / "large_m") on a
    backend ("cuda", "hip", "interpreter") with ``fb``-bit code fields."""
    backends = SWAP_AB_BACKENDS if family == "small_m" else SWAP_AB_LARGE_M_BACKENDS
    return backend in backends and not (backend == "cuda" and fb == 2)


# Backends whose TritonBackend pre-shuffles qweight by default (layout.py's mma16x64, where
# ``layout.preshuffle_reason`` allows it; docs/decisions/preshuffled-layout.md). None yet: compiled
# here, CUDA sm90 small-M goes from 4.89 to 3.33 instructions per weight (fp16 W4 g128 sym; bf16
# asym 5.44 -> 3.88) with no STS / LDSM of the weight tile, and M <= 2 keeps a packed GEMV
# (wq_gemv_preshuffled.py: sm90 fp16 2.86 / bf16 4.45 per weight against the GPTQ one's 2.77 / 4.55;
# 2.22 / 4.05 against 2.28 / 4.23 with the pair operations as inline asm), but the tiled path loses
# its BLOCK_K 32 configs, and nothing of it has run on a GPU. Opt in with
# ``TritonBackend(weight_layout="mma16x64")``; the next GPU session decides by timing
# (benchmarks/kernel_speed.py --weight-layout). ROCm: the CUDA fragment is not MFMA's; mfma16x128
# is opt-in there too.
PRESHUFFLED_BACKENDS: frozenset[str] = frozenset()


def preshuffled_default(family: str, backend: str, bits: int, group: int, has_gidx: bool) -> bool:
    """Whether a weight is pre-shuffled by default on ``backend`` (and so ``family`` runs
    ``_wq_dot_kernel`` with PRESHUFFLED); the GPTQ-layout GEMV families (gemv, gemv_packed) never
    read that layout (a pre-shuffled weight runs its M <= 2 on gemv_preshuffled)."""
    return (family in ("small_m", "large_m") and backend in PRESHUFFLED_BACKENDS
            and preshuffle_reason(bits, group, has_gidx) is None)


def gemv_packed(dtype: torch.dtype, fb: int, group: int, has_gidx: bool, backend: str,
                asm: bool = ASM_PAIR_OPS) -> int:
    """PACKED mode of the packed GEMV (``_wq_gemv_f16x2_kernel``) for x's dtype, the field
    width, the group length (``PER_CHANNEL_GROUP`` per channel), g_idx and the target backend:
    with ``asm``, 2 (pair operations as PTX inline asm: CUDA) or 3 (as AMDGCN inline asm: ROCm);
    1 (the same IEEE operations lane by lane in plain Triton: the interpreter, and every target
    without ``asm``) or 0 (not this kernel: the fp32 GEMV, ``_wq_gemv_kernel``). A word's 8 rows
    must share a group."""
    if dtype not in (torch.float16, torch.bfloat16) or fb != 4 or group % 8 or has_gidx:
        return 0
    return {"cuda": 2, "hip": 3}.get(backend, 1) if asm else 1


def _packed_x_ok(x: torch.Tensor) -> bool:
    """The packed GEMV reads x 16 bytes at a time, from row starts plus multiples of 8 elements."""
    return x.data_ptr() % 16 == 0 and (x.shape[0] == 1 or x.stride(0) % 8 == 0) and x.shape[1] % 8 == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _compute_units(device: torch.device) -> int:
    """SMs (CUDA) or CUs (ROCm); a small number under the interpreter."""
    if configs.interpreting() or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_split_k(m: int, n: int, k: int, units: int) -> int:
    """Split K until the grid has ~2 programs per compute unit (M <= 32) or one (larger M, whose
    tiles are bigger), keeping >= 4 K-tiles of 64 per split; at most 16. Large M splits only
    when its tiles alone leave compute units idle (e.g. N = 4096, M = 256: 64 tiles of 128 x 128
    on 132 SMs)."""
    small = m <= SMALL_M_MAX
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, SMALL_M_MAX if small else 128)
    want = 2 * units if small else units
    split = 1
    while split < 16 and tiles * split < want and k // (64 * split * 2) >= 4:
        split *= 2
    return split


def _launch(family, kernel, grid, args, meta, m_key, autotune):
    launch(family, kernel, grid, args, meta, m_key, autotune, AUTOTUNE_KEY)


def wq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    split_k: int | None = None,
    autotune: bool = True,
    layout: str = LAYOUT_GPTQ,
) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight-only quantized W, in one fused dequant-GEMM.

    x:        [M, K] fp16, bf16 or fp32 (rows contiguous).
    qweight:  int32 [ceil(K / PF), N], PF = 32 // field_bits(bits), packed along K; with
              ``layout`` "mma16x64" / "mfma16x128" the pre-shuffled int32 [ceil(N/16),
              ceil(K/64), 128] / [ceil(N/16), ceil(K/128), 256] of ``layout.preshuffle`` (M <= 2
              with fp16 / bf16 x then runs the pre-shuffled GEMV, the rest the tl.dot kernel).
    scales:   [G, N] fp16, bf16 or fp32.
    zeros:    uint8 [G, N] integer zero points, or None (symmetric: 2**(bits-1)).
    g_idx:    int32 [K] group of each row of qweight, or None (``k // group_size``).
    bias:     [N] or None.
    bits:     2, 3, 4 or 8. group_size: -1 (per channel) or the group length.
    split_k:  K splits (None: from the grid size and the GPU's compute units).
    autotune: False runs the first fitting config of the target's list (no tuning runs).
    layout:   "gptq" (default), "mma16x64" or "mfma16x128": which layout ``qweight`` holds; a
              qweight in another layout, or a scheme the layout cannot hold, is refused (ValueError).
    Returns [M, N] in x's dtype. Raises ValueError on shapes or dtypes it cannot take.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    m, k = x.shape
    fb = field_bits(bits)
    pf = 32 // fb
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    preshuffled = PRESHUFFLED_CODE[layout]
    if preshuffled:
        n = scales.shape[1] if scales.dim() == 2 else -1
        want = atom_shape(layout, n, k)
        if qweight.dtype != torch.int32 or tuple(qweight.shape) != want:
            raise ValueError(f"layout {layout!r}: qweight must be the pre-shuffled int32 {list(want)}, got "
                             f"{qweight.dtype} {tuple(qweight.shape)}")
        reason = preshuffle_reason(bits, PER_CHANNEL_GROUP if group_size == -1 else group_size, g_idx is not None)
        if reason is not None:
            raise ValueError(f"layout {layout!r} cannot hold this weight: {reason}")
    else:
        if qweight.dim() != 2:
            raise ValueError(f"qweight is {qweight.dim()}-D: a pre-shuffled qweight needs its layout= (mma16x64, mfma16x128)")
        n = qweight.shape[1]
        if qweight.dtype != torch.int32 or qweight.shape[0] != triton.cdiv(k, pf):
            raise ValueError(f"qweight must be int32 [{triton.cdiv(k, pf)}, N], got "
                             f"{qweight.dtype} {tuple(qweight.shape)}")
    if scales.dim() != 2 or scales.shape[1] != n:
        raise ValueError(f"scales must be [G, {n}], got {tuple(scales.shape)}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise ValueError(f"zeros must be uint8 {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}")
    if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32):
        raise ValueError(f"g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    for t in (qweight, scales, zeros, g_idx, bias):
        if t is not None and not t.is_contiguous():
            raise ValueError("qweight, scales, zeros, g_idx and bias must be contiguous")
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    if split_k is None:
        split_k = default_split_k(m, n, k, _compute_units(x.device))
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    part = torch.empty((split_k, m, n), device=x.device, dtype=torch.float32) if split_k > 1 else out
    group = PER_CHANNEL_GROUP if group_size == -1 else group_size
    meta = dict(FB=fb, GROUP=group, SYM_ZERO=float(1 << (bits - 1)), HAS_ZEROS=zeros is not None,
                HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None, SPLIT_K=split_k)
    dummy = scales  # never read: the matching HAS_* flag is False
    m_key = configs.m_key(m)
    args = (x, qweight, scales, dummy if zeros is None else zeros, dummy if g_idx is None else g_idx,
            dummy if bias is None else bias, out, part, m, n, k, x.stride(0), m_key, (1 << fb) - 1)
    backend = "interpreter" if configs.interpreting() else configs.current_target()[0]
    # the packed GEMV's variant (0: none); only asked where a GEMV can run
    packed = (gemv_packed(x.dtype, fb, group, g_idx is not None, backend, ASM_PAIR_OPS)
              if m <= GEMV_MAX_M and _packed_x_ok(x) else 0)
    if m <= GEMV_MAX_M and (packed or not preshuffled):  # a pre-shuffled qweight: the packed GEMV only
        grid = lambda meta_: (triton.cdiv(n, meta_["BLOCK_N"]), split_k)  # noqa: E731
        meta["BLOCK_M"] = _next_pow2(m)
        if preshuffled:
            _launch("gemv_preshuffled", _wq_gemv_ps_kernel, grid, args,
                    {**meta, "PACKED": packed, "PRESHUFFLED": preshuffled}, m_key, autotune)
        elif packed:
            _launch("gemv_packed", _wq_gemv_f16x2_kernel, grid, args, {**meta, "PACKED": packed}, m_key, autotune)
        else:
            _launch("gemv", _wq_gemv_kernel, grid, args, meta, m_key, autotune)
    else:
        family = "small_m" if m <= SMALL_M_MAX else "large_m"
        grid = lambda meta_: (  # noqa: E731
            triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]), split_k)
        interp_bf16 = configs.interpreting() and x.dtype == torch.bfloat16
        meta["DOT_F32"] = x.dtype == torch.float32 or interp_bf16
        meta["MAGIC16"] = _magic16(x.dtype, fb)
        meta["SWAP_AB"] = swap_ab(family, backend, fb)
        meta["PRESHUFFLED"] = preshuffled
        meta["ASM"] = dot_asm(backend, x.dtype, fb, g_idx is not None, ASM_DOT_PAIR_OPS)
        _launch(family, _wq_dot_kernel, grid, args, meta, m_key, autotune)
    if split_k > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, dummy if bias is None else bias, out, m, n, SPLIT_K=split_k,
            HAS_BIAS=bias is not None, BLOCK=block)
    return out
