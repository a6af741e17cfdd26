"""Launch configurations per target, chosen from the active Triton driver's target.

As Triton's matmul tutorial (get_cuda_autotune_config / get_hip_autotune_config): one list per
target and kernel family, picked when a kernel is first used (never at import, which would
initialise the GPU driver). Under ``TRITON_INTERPRET=1`` one small fixed config with big tiles
is used and nothing is autotuned (the interpreter pays per program instance, not per element).

Families: "gemv" (M <= 2, split-K, no tl.dot: the fp32 GEMV), "gemv_packed" (the same for fp16 /
bf16 x and 4-bit fields: the packed GEMV), "gemv_preshuffled" (the packed GEMV on a qweight in
layout.py's pre-shuffled layouts; BLOCK_K <= 128, so that a tile sits in one group), "small_m"
(M <= 32, tl.dot, split-K), "large_m" (tiled tl.dot), "w8a8" (int8 tl.dot), and the float
kernels': "fp_dot" (fp_gemm.py: FP8 / FP4 weight-only, the dequantized tile in x's dtype through
tl.dot; every M, BLOCK_M 16 tiles for M <= 16) and "fp8_w8a8" (fp8_w8a8.py: tl.dot on fp8
operands; BLOCK_K 128, the FP8 block, and 256 per channel only). Meta-parameters:
BLOCK_M/BLOCK_N/BLOCK_K, GROUP_M (L2 swizzle of the tiled paths), ROWS (the packed GEMV's word
rows per step); ROCm adds waves_per_eu, matrix_instr_nonkdim, kpack (fp16 / bf16 MFMA operands
only: not fp8_w8a8) where the installed Triton's HIP backend takes them (``hip_options``: a Triton
that drops one keeps launching); each ROCm list starts with a 4-warp tile well inside the LDS (what
autotune=False runs). The tl.dot families end with configs for fp32 operands at a tl.dot K of 16
(``prune.FMA_BLOCK_K``: Triton's FMA dot spills at larger K tiles; fp_dot: BLOCK_K 16 for FP8, 32
for FP4's two half-tile dots), which the launchers give fp32 x only. ``prune.candidates`` keeps
the configs a launch can take; every one is compiled for sm90 and gfx942 without spills
(benchmarks/kernel_spills.py, tests/test_triton_compile.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import triton

FLOAT_FAMILIES = ("fp_dot", "fp8_w8a8")  # the float kernels' (fp_gemm.py, fp8_w8a8.py)
FAMILIES = ("gemv", "gemv_packed", "gemv_preshuffled", "small_m", "large_m", "w8a8", *FLOAT_FAMILIES)
M_KEY_MAX = 4096  # every launcher's M buckets: powers of 2 up to this


def m_key(m: int) -> int:
    """The autotuner's M bucket: the next power of 2 of M, at most M_KEY_MAX."""
    return min(1 << max(0, (m - 1).bit_length()), M_KEY_MAX)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on"}


def current_target() -> tuple[str, str]:
    """(backend, arch) of the active driver: ("cuda", "90"), ("hip", "gfx942"), or
    ("interpreter", "") under TRITON_INTERPRET=1."""
    if interpreting():
        return "interpreter", ""
    t = triton.runtime.driver.active.get_current_target()
    return t.backend, str(t.arch)


def _cfg(bm, bn, bk, warps, stages, gm=8, **extra):
    """A config; ``bm=None`` for the GEMV family, whose BLOCK_M the launcher sets from M."""
    meta = {"BLOCK_N": bn, "BLOCK_K": bk, **extra}
    if bm is not None:
        meta.update(BLOCK_M=bm, GROUP_M=gm)
    return triton.Config(meta, num_warps=warps, num_stages=stages)


@functools.cache
def hip_options() -> frozenset[str]:
    """The launch options the installed Triton's HIP backend takes (empty without one)."""
    try:
        from triton.backends.amd.compiler import HIPOptions
    except ImportError:
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(HIPOptions))


def _hip(**opts) -> dict:
    """The ROCm options of a config that this Triton knows; the rest are dropped."""
    return {k: v for k, v in opts.items() if k in hip_options()}


# fp32-operand tiles (BLOCK_M, BLOCK_N, warps) at BLOCK_K 16: spill-free on sm90 and gfx942
_FMA_LARGE = ((64, 128, 8), (64, 64, 4), (32, 128, 4), (128, 64, 8))
_FMA_SMALL_N = ((64, 4), (128, 4))


# fp_dot's fp32-operand (FMA dot) tiles (BLOCK_M, BLOCK_N, warps) at a tl.dot K of 16: BLOCK_K 16
# for FP8, 32 for FP4 (two dots of BLOCK_K / 2 code rows, twice the decode: FP4 takes BLOCK_M 32,
# whose 64 x 64 x 32 spilled 536 bytes on sm90); spill-free on sm90 and gfx942
_FP_FMA = {16: ((64, 64, 4), (64, 128, 8), (16, 64, 4), (16, 128, 4)),
           32: ((32, 64, 8), (32, 128, 8), (16, 64, 4), (16, 128, 4))}


def _fp_dot_fma(stages: int) -> list[triton.Config]:
    return [_cfg(bm, bn, bk, w, stages) for bk, tiles in _FP_FMA.items() for bm, bn, w in tiles]


def _packed_cfg(bn, bk, warps, stages, lanes, **extra):
    """A packed-GEMV config: ROWS word rows per step, so that each thread holds 4 columns of one
    row (warps x lanes x 4 / BLOCK_N; with BLOCK_N 128 and 4 warps of 32, one warp per row)."""
    return _cfg(None, bn, bk, warps, stages, ROWS=max(1, warps * lanes * 4 // bn), **extra)


def get_cuda_autotune_config(family: str, arch: str) -> list[triton.Config]:
    """NVIDIA lists; sm90 gets deeper pipelines (more shared memory) than sm80."""
    deep = 4 if arch.startswith("9") or arch.startswith("10") else 3
    if family == "gemv":  # BLOCK_M comes from the launcher (next power of 2 of M)
        return [
            _cfg(None, bn, bk, w, s)
            for bn, bk, w, s in [
                (128, 64, 4, deep), (256, 32, 4, deep), (256, 64, 8, 3), (512, 32, 4, deep),
                (512, 16, 4, deep), (512, 32, 8, 3), (1024, 16, 8, 3), (128, 128, 4, 3),
            ]
        ]
    if family == "gemv_packed":  # instructions per weight: BLOCK_K 128-256 amortizes each tile's own work
        return [
            _packed_cfg(bn, bk, w, s, 32)
            for bn, bk, w, s in [
                (128, 128, 4, 3), (128, 256, 4, 3), (256, 64, 4, deep), (64, 128, 2, deep), (256, 128, 8, 3),
                (128, 64, 4, deep), (512, 32, 4, deep),
            ]
        ]
    if family == "gemv_preshuffled":  # BLOCK_K 64 configs are pruned for mfma16x128 (its K atom is 128)
        return [_cfg(None, bn, bk, w, s) for bn, bk, w, s in [
            (128, 128, 4, 3), (64, 128, 4, deep), (256, 128, 8, 3), (128, 64, 4, deep), (256, 64, 4, deep)]]
    if family == "small_m":
        return [
            _cfg(bm, bn, bk, w, s)
            for bm in (16, 32)
            for bn, bk, w, s in [
                (64, 128, 4, deep), (128, 64, 4, deep), (128, 128, 4, 3), (256, 64, 8, 3), (256, 128, 8, 3),
                (64, 64, 4, deep), (128, 32, 4, deep), (256, 32, 8, deep),
            ]
        ] + [_cfg(bm, bn, 16, w, 3) for bm in (16, 32) for bn, w in _FMA_SMALL_N]
    if family in ("large_m", "w8a8"):
        bk2 = 128 if family == "w8a8" else 64  # int8 tiles: twice the K per byte of smem
        fma = [_cfg(bm, bn, 16, w, 3) for bm, bn, w in _FMA_LARGE] if family == "large_m" else []
        return [
            _cfg(128, 256, bk2 // 2, 8, 3), _cfg(128, 128, bk2, 8, 3), _cfg(128, 128, bk2 // 2, 4, deep),
            _cfg(64, 256, bk2 // 2, 4, deep), _cfg(256, 128, bk2 // 2, 8, 3), _cfg(64, 128, bk2, 4, deep),
            _cfg(128, 64, bk2, 4, deep), _cfg(64, 64, bk2, 4, deep), _cfg(32, 128, bk2, 4, deep),
        ] + fma
    big = deep == 4  # sm90+ (wgmma): sm80 / sm89 (mma.sync fragments) spill the largest tiles below
    if family == "fp_dot":  # 16-bit operands: BLOCK_K 64 / 128. M > 16 tiles first (the former fixed
        # 64 x 64 x 64), then BLOCK_M 16 (M <= 16), then the FMA tiles. Shared memory: the fp32 scales
        # are loaded per weight (4 of the 5 bytes a weight takes in an FP8 stage)
        tiles = [(64, 64, 64, 4, deep), (64, 128, 64, 8, deep), (128, 64, 64, 8, deep),
                 (16, 64, 128, 4, deep), (16, 128, 64, 4, deep)]
        if big:  # FP4 128 x 128 x 64 spilled 1432 bytes on sm80, 224 on sm89; 16-row ones 8 on sm80
            tiles[3:3] = [(128, 128, 64, 8, 3)]
            tiles += [(16, 128, 128, 4, 3), (16, 256, 64, 8, 3)]
        return [_cfg(bm, bn, bk, w, s) for bm, bn, bk, w, s in tiles] + _fp_dot_fma(3)
    if family == "fp8_w8a8":  # fp8 wgmma / mma.sync; BLOCK_K 128 (one FP8 block), 256 per channel only
        tiles = [(64, 128, 128, 4, deep), (128, 64, 128, 4, deep), (64, 64, 128, 4, deep),
                 (16, 64, 128, 4, deep), (16, 128, 128, 4, deep), (16, 256, 128, 8, 3), (16, 64, 256, 4, 3),
                 (16, 128, 256, 4, 3)]
        if big:  # sm89 spilled 632 bytes at 128 x 256 (per channel), 8 at 128 x 128 (grouped)
            tiles[1:1] = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3)]
        return [_cfg(bm, bn, bk, w, s) for bm, bn, bk, w, s in tiles]
    raise ValueError(f"unknown kernel family {family!r}; use one of {FAMILIES}")


def get_hip_autotune_config(family: str, arch: str) -> list[triton.Config]:
    """AMD lists (CDNA3 gfx942 first in mind): num_stages 2 (stream pipeliner), waves_per_eu
    occupancy hints, 16x16 MFMA (matrix_instr_nonkdim=16), kpack 2 for fp16/bf16 MFMA on
    gfx942 (gfx950 forces kpack=1 itself)."""
    kp = 1 if arch == "gfx950" else 2
    amd = _hip(matrix_instr_nonkdim=16, kpack=kp)
    if family == "gemv":
        return [
            _cfg(None, bn, bk, w, 2, **_hip(waves_per_eu=wpe))
            for bn, bk, w, wpe in [
                (128, 64, 4, 0), (256, 32, 4, 0), (512, 32, 8, 0), (512, 16, 4, 2),
                (256, 64, 8, 2), (1024, 16, 8, 0),
            ]
        ]
    if family == "gemv_packed":
        return [
            _packed_cfg(bn, bk, w, 2, 64, **_hip(waves_per_eu=wpe))
            for bn, bk, w, wpe in [
                (128, 128, 4, 0), (256, 128, 4, 0), (128, 128, 4, 2), (256, 64, 4, 0), (512, 64, 8, 0),
                (128, 64, 4, 0),
            ]
        ]
    if family == "gemv_preshuffled":
        return [_cfg(None, bn, bk, w, 2, **_hip(waves_per_eu=wpe)) for bn, bk, w, wpe in [
            (128, 128, 4, 0), (256, 128, 4, 0), (128, 128, 2, 0), (128, 128, 4, 2), (256, 64, 4, 0)]]
    if family == "small_m":
        return [
            _cfg(bm, bn, bk, w, 2, **_hip(waves_per_eu=wpe), **amd)
            for bm in (16, 32)
            for bn, bk, w, wpe in [(64, 128, 4, 2), (128, 64, 4, 0), (128, 128, 8, 0), (64, 64, 4, 2), (128, 32, 4, 0)]
        ] + [_cfg(bm, bn, 16, w, 2) for bm in (16, 32) for bn, w in _FMA_SMALL_N]
    if family in ("large_m", "w8a8"):
        bk = 128 if family == "w8a8" else 64
        wpe0, wpe2 = _hip(waves_per_eu=0), _hip(waves_per_eu=2)
        fma = [_cfg(bm, bn, 16, w, 2) for bm, bn, w in _FMA_LARGE] if family == "large_m" else []
        return [  # first (autotune=False): a 4-warp tile well inside the LDS, not 256 x 256
            _cfg(128, 128, bk, 4, 2, **wpe2, **amd),
            _cfg(256, 256, bk // 2, 8, 2, **wpe0, **amd),
            _cfg(128, 256, bk // 2, 8, 2, **wpe0, **amd),
            _cfg(128, 128, bk // 2, 8, 2, **wpe0, **amd),
            _cfg(64, 128, bk, 4, 2, **wpe2, **amd),
            _cfg(64, 64, bk, 4, 2, **wpe2, **amd),
            _cfg(64, 128, 128, 4, 2, **wpe2, **amd),  # BLOCK_K 128: a qweight in layout.py's mfma16x128
        ] + fma
    if family == "fp_dot":  # fp16 / bf16 MFMA operands (the dequantized tile): kpack as the others
        return [  # first (autotune=False): the former fixed 4-warp 64 x 64 x 64
            _cfg(bm, bn, bk, w, 2, **_hip(waves_per_eu=wpe), **amd)
            for bm, bn, bk, w, wpe in [  # BLOCK_K x BLOCK_N <= 8192: an FP8 stage takes 5 bytes a weight of LDS
                (64, 64, 64, 4, 2), (64, 128, 64, 8, 0), (128, 64, 64, 8, 0), (128, 128, 64, 8, 0),
                (16, 64, 64, 4, 2), (16, 128, 64, 4, 0), (16, 64, 128, 4, 0),
            ]
        ] + _fp_dot_fma(2)
    if family == "fp8_w8a8":  # fp8 MFMA operands: no kpack (its 2 is for fp16 / bf16)
        nk16 = _hip(matrix_instr_nonkdim=16)
        return [  # first (autotune=False): a 4-warp 128 x 128 x 128 tile (32 KB of LDS; pruned when grouped)
            _cfg(bm, bn, bk, w, 2, **_hip(waves_per_eu=wpe), **nk16)
            for bm, bn, bk, w, wpe in [
                (128, 128, 128, 4, 2), (128, 128, 128, 8, 0), (128, 256, 128, 8, 0), (256, 128, 128, 8, 0),
                (64, 128, 128, 4, 2), (64, 64, 128, 4, 2),
                (16, 64, 128, 4, 2), (16, 128, 128, 4, 0), (16, 256, 128, 4, 0), (16, 128, 256, 4, 0),
            ]
        ]
    raise ValueError(f"unknown kernel family {family!r}; use one of {FAMILIES}")


def interpreter_config(family: str) -> dict[str, int]:
    """The one fixed config used under TRITON_INTERPRET=1 (big tiles: few program instances)."""
    if family == "gemv":
        return {"BLOCK_N": 128, "BLOCK_K": 128}
    if family == "gemv_packed":
        return {"BLOCK_N": 128, "BLOCK_K": 128, "ROWS": 4}
    if family == "gemv_preshuffled":
        return {"BLOCK_N": 128, "BLOCK_K": 128}
    if family == "small_m":
        return {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1}
    if family in ("large_m", "w8a8", *FLOAT_FAMILIES):  # the float launchers take BLOCK_M 16 for M <= 16
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 2}
    raise ValueError(f"unknown kernel family {family!r}; use one of {FAMILIES}")


def configs_for(family: str, target: tuple[str, str]) -> list[triton.Config]:
    """The autotune list of a family for a target ("cuda" or "hip")."""
    backend, arch = target
    if backend == "cuda":
        return get_cuda_autotune_config(family, arch)
    if backend == "hip":
        return get_hip_autotune_config(family, arch)
    raise ValueError(f"no autotune configs for target {backend!r} (only cuda and hip)")


@functools.cache
def autotuned(kernel, family: str, target: tuple[str, str], key: tuple[str, ...], prune=None):
    """``triton.autotune`` applied to ``kernel`` with the family's list for ``target``.

    Built on first use and memoised per (kernel, family, target), so the driver is queried
    only when a kernel actually launches. ``prune`` drops configs a layer cannot take.
    """
    prune_by = {"early_config_prune": prune} if prune is not None else None
    tuner = triton.autotune(
        configs=configs_for(family, target), key=list(key), prune_configs_by=prune_by,
        do_bench=_tuning_bench,
    )(kernel)
    _TUNERS.append((family, tuner))
    return tuner


_TUNERS: list = []  # (family, autotuner) as ``autotuned`` made them (memoised there), for ``chosen_configs``


def chosen_configs() -> dict[str, str]:
    """Every config the autotuners have chosen in this process: {"family key": config}."""
    return {f"{family} {key}": str(cfg) for family, tuner in _TUNERS
            for key, cfg in getattr(tuner, "cache", {}).items()}


def _tuning_bench(fn, quantiles=None):
    """The autotuner's timer: do_bench with short runs (5 ms warm-up, 25 ms timed: thousands of
    calls of a microsecond kernel), so tuning a new shape costs well under a second."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, quantiles=quantiles)
