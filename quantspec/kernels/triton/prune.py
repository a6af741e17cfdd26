"""Which configs of a weight-only family's list (configs.py) suit a launch: the autotuner's
early prune per family (``PRUNE``) and the first fitting config of an untuned launch
(``candidates(...)[0]``), both used by ``wq_gemm._launch``; ``benchmarks/kernel_spills.py``
compiles exactly these candidates.

``meta`` is the launch's constexprs (what the autotuner's prune receives as keyword arguments):
BLOCK_M (the GEMVs), PRESHUFFLED, DOT_F32, GROUP, HAS_GIDX.
"""

from __future__ import annotations

# fp32 operands take Triton's FMA dot (IEEE, no tensor cores), which keeps a thread's whole K
# slice of both operands in registers: BLOCK_K 16 tiles are its configs (larger K spills, e.g.
# sm90 128x256x32 13232 bytes, 64x64x32 416; benchmarks/results/kernel-spills.md)
FMA_BLOCK_K = 16
GIDX_TILE_PER_THREAD = 4096  # BLOCK_M x BLOCK_N x BLOCK_K per thread, tl.dot tiles with g_idx


def fits(family: str, cfg, m_key: int, meta: dict) -> bool:
    """Whether a config suits the launch: GEMV tiles [BLOCK_M, BLOCK_K, BLOCK_N] small enough
    not to spill registers; small-M tiles no taller than M needs (16 covers M <= 16); a
    pre-shuffled qweight (layout.py) takes BLOCK_N a multiple of 16 and BLOCK_K of its K atom;
    tl.dot tiles of fp32 operands (DOT_F32) the FMA dot's BLOCK_K, 16-bit ones larger K tiles.
    With g_idx (a scale gathered per weight) tiles are smaller still: the limits below are where
    benchmarks/results/kernel-spills.md saw spills (sm90 GEMV 1024 x 16 and 128 x 128; gfx942
    tl.dot tiles of 8192 elements a thread)."""
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
         "small_m": _pruner("small_m"), "large_m": _pruner("large_m")}
