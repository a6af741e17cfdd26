"""Which configs of a family's list (configs.py) suit a launch: the autotuner's early prune per
family (``PRUNE``) and the first fitting config of an untuned launch (``candidates(...)[0]``),
both used by ``wq_gemm._launch`` and, for the float families, by ``launch``;
``benchmarks/kernel_spills.py`` compiles exactly these candidates.

``meta`` is the launch's constexprs (what the autotuner's prune receives as keyword arguments):
BLOCK_M (the GEMVs), PRESHUFFLED, DOT_F32, GROUP, HAS_GIDX; the float families' KIND (fp_dot:
0 FP8, 1 FP4) and GROUPED (fp8_w8a8: FP8_BLOCK scales), whose launchers (fp_gemm.py,
fp8_w8a8.py) use ``launch`` below.
"""

from __future__ import annotations

from . import configs

# fp32 operands take Triton's FMA dot (IEEE, no tensor cores), which keeps a thread's whole K
# slice of both operands in registers: BLOCK_K 16 tiles are its configs (larger K spills, e.g.
# sm90 128x256x32 13232 bytes, 64x64x32 416; benchmarks/results/kernel-spills.md)
FMA_BLOCK_K = 16
SMALL_M = 16  # the float families: M <= 16 takes the BLOCK_M 16 tiles, larger M the others
FP8_BLOCK = 128  # fp8_w8a8's grouped (FP8_BLOCK) K tile: one scale block per tile
# fp8_w8a8's grouped path holds two fp32 [BLOCK_M, BLOCK_N] tiles (the accumulator and the block's
# scaled product): at most this many accumulator elements a warp (64 a lane on NVIDIA); sm90
# 128 x 256 on 8 warps spilled 256 bytes, gfx942 128 x 128 on 4 (waves_per_eu 2) 14 VGPRs
GROUPED_TILE_PER_WARP = 2048
GIDX_TILE_PER_THREAD = 4096  # BLOCK_M x BLOCK_N x BLOCK_K per thread, tl.dot tiles with g_idx


def fits(family: str, cfg, m_key: int, meta: dict) -> bool:
    """Whether a config suits the launch: GEMV tiles [BLOCK_M, BLOCK_K, BLOCK_N] small enough
    not to spill registers; small-M tiles no taller than M needs (16 covers M <= 16); a
    pre-shuffled qweight (layout.py) takes BLOCK_N a multiple of 16 and BLOCK_K of its K atom;
    tl.dot tiles of fp32 operands (DOT_F32) the FMA dot's BLOCK_K, 16-bit ones larger K tiles.
    With g_idx (a scale gathered per weight) tiles are smaller still: the limits below are where
    benchmarks/results/kernel-spills.md saw spills (sm90 GEMV 1024 x 16 and 128 x 128; gfx942
    tl.dot tiles of 8192 elements a thread)."""
    if family in configs.FLOAT_FAMILIES:
        return float_fits(family, cfg, m_key, meta)
    preshuffled = meta.get("PRESHUFFLED", 0)
    if preshuffled and not preshuffled_fits(cfg, preshuffled):
        return False
    gidx = meta.get("HAS_GIDX", False)
    bn, bk = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"]
    if family == "gemv":
        return meta["BLOCK_M"] * bk * bn <= 32768 and (not gidx or (bk <= 64 and bn <= 512))
    if family in ("small_m", "large_m"):
        if (bk <= FMA_BLOCK_K) != bool(meta.get("DOT_F32", False)):
            return False
        if gidx and cfg.kwargs["BLOCK_M"] * bn * bk > GIDX_TILE_PER_THREAD * cfg.num_warps * 32:
            return False
        if family == "small_m":
            return cfg.kwargs["BLOCK_M"] <= max(16, m_key)
    return True


def float_fits(family: str, cfg, m_key: int, meta: dict) -> bool:
    """The float families: BLOCK_M 16 for M <= 16 (``SMALL_M``) and taller tiles above (what the
    fixed tiles did); fp_dot's tl.dot K (BLOCK_K, or BLOCK_K / 2 for FP4's two half-tile dots) is
    the FMA dot's ``FMA_BLOCK_K`` for fp32 operands (DOT_F32: the FMA tiles of configs.py, BLOCK_K
    16 / 32) and BLOCK_K >= 64 for 16-bit ones (FP4 half tiles of whole NVFP4 / MXFP4 groups, and a
    tl.dot K of at least 16); fp8_w8a8's grouped path the K tile of one FP8 block and at most
    ``GROUPED_TILE_PER_WARP`` accumulator elements a warp."""
    bm, bk = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_K"]
    if (bm == SMALL_M) != (m_key <= SMALL_M):
        return False
    if family == "fp8_w8a8":
        return not meta.get("GROUPED", False) or (
            bk == FP8_BLOCK and bm * cfg.kwargs["BLOCK_N"] <= GROUPED_TILE_PER_WARP * cfg.num_warps)
    if meta.get("DOT_F32", False):
        return bk >> meta.get("KIND", 0) == FMA_BLOCK_K
    return bk >= 4 * FMA_BLOCK_K


def group_aligned(cfg, meta: dict) -> bool:
    """Whether a K tile lies in one quantization group (no g_idx, BLOCK_K divides GROUP): the
    tl.dot kernel then scales once per tile instead of gathering per element."""
    return not meta.get("HAS_GIDX", False) and meta.get("GROUP", 0) % cfg.kwargs["BLOCK_K"] == 0


def candidates(family: str, cfgs: list, m_key: int, meta: dict) -> list:
    """The configs of ``cfgs`` a launch may run, in list order: those that fit, and of them the
    group-aligned ones where any is (a scheme's group size prunes the tiles that straddle
    groups); the list's first config when none fits."""
    fit = [c for c in cfgs if fits(family, c, m_key, meta)]
    if family in ("gemv", "small_m", "large_m"):
        fit = [c for c in fit if group_aligned(c, meta)] or fit
    return fit or cfgs[:1]


def preshuffled_fits(cfg, code: int = 1) -> bool:
    """Whether a tl.dot config reads a pre-shuffled qweight (PRESHUFFLED ``code``: 1 mma16x64, 2
    mfma16x128): BLOCK_N a multiple of 16, BLOCK_K of the layout's K atom (64, 128)."""
    return cfg.kwargs["BLOCK_N"] % 16 == 0 and cfg.kwargs["BLOCK_K"] % (64 * code) == 0


def _pruner(family: str):
    def prune(cfgs, named_args, **kwargs):
        return candidates(family, cfgs, named_args["M_KEY"], kwargs)

    return prune


PRUNE = {"gemv": _pruner("gemv"), "gemv_packed": None, "gemv_preshuffled": _pruner("gemv_preshuffled"),
         "small_m": _pruner("small_m"), "large_m": _pruner("large_m"), "fp_dot": _pruner("fp_dot"),
         "fp8_w8a8": _pruner("fp8_w8a8")}


def launch(family: str, kernel, grid, args: tuple, meta: dict, m_key: int, autotune: bool, key: tuple[str, ...]):
    """Run ``kernel`` of a family: under the interpreter its one fixed config (the float families:
    BLOCK_M 16 for M <= 16), else autotuned over the target's list pruned for the launch
    (``PRUNE``; ``key``: the autotuner's key), or with ``autotune=False`` the list's first config
    that fits. No reset or restore runs between tuning runs (the float kernels store each element
    of ``out`` once: no atomics, no split-K)."""
    if configs.interpreting():
        cfg = dict(configs.interpreter_config(family))
        if family in configs.FLOAT_FAMILIES and m_key <= SMALL_M:
            cfg["BLOCK_M"] = SMALL_M
        kernel[grid](*args, **meta, **cfg)
        return
    target = configs.current_target()
    if autotune:
        configs.autotuned(kernel, family, target, key, PRUNE[family])[grid](*args, **meta)
        return
    cfg = candidates(family, configs.configs_for(family, target), m_key, meta)[0]
    if not fits(family, cfg, m_key, meta):
        scheme = ", ".join(f"{k}={meta[k]}" for k in key if k in meta)
        raise ValueError(f"no {family} config of {target} fits this launch ({scheme})")
    kernel[grid](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
