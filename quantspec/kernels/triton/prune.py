"""Which configs of a weight-only family's list (configs.py) suit a launch: the autotuner's
early prune per family (``PRUNE``) and the first fitting config of an untuned launch
(``fits``), both used by ``wq_gemm._launch``."""

from __future__ import annotations


def fits(family: str, cfg, m_key: int, block_m: int, preshuffled: int = 0) -> bool:
    """Whether a config suits the launch: GEMV tiles [BLOCK_M, BLOCK_K, BLOCK_N] small enough
    not to spill registers; small-M tiles no taller than M needs (16 covers M <= 16); a
    pre-shuffled qweight (layout.py) takes BLOCK_N a multiple of 16 and BLOCK_K of its K atom."""
    if preshuffled and not preshuffled_fits(cfg, preshuffled):
        return False
    if family == "gemv":
        return block_m * cfg.kwargs["BLOCK_K"] * cfg.kwargs["BLOCK_N"] <= 32768
    if family == "small_m":
        return cfg.kwargs["BLOCK_M"] <= max(16, m_key)
    return True


def preshuffled_fits(cfg, code: int = 1) -> bool:
    """Whether a tl.dot config reads a pre-shuffled qweight (PRESHUFFLED ``code``: 1 mma16x64, 2
    mfma16x128): BLOCK_N a multiple of 16, BLOCK_K of the layout's K atom (64, 128)."""
    return cfg.kwargs["BLOCK_N"] % 16 == 0 and cfg.kwargs["BLOCK_K"] % (64 * code) == 0


def _prune_gemv(cfgs, named_args, **kwargs):
    return [c for c in cfgs if fits("gemv", c, named_args["M_KEY"], kwargs["BLOCK_M"])] or cfgs[:1]


def _prune_small_m(cfgs, named_args, **kwargs):
    ps = kwargs.get("PRESHUFFLED", 0)
    return [c for c in cfgs if fits("small_m", c, named_args["M_KEY"], 0, ps)] or cfgs[:1]


def _prune_large_m(cfgs, named_args, **kwargs):
    ps = kwargs.get("PRESHUFFLED", 0)
    return [c for c in cfgs if fits("large_m", c, named_args["M_KEY"], 0, ps)] or cfgs[:1]


def _prune_gemv_ps(cfgs, named_args, **kwargs):
    return [c for c in cfgs if preshuffled_fits(c, kwargs["PRESHUFFLED"])] or cfgs[:1]


PRUNE = {"gemv": _prune_gemv, "gemv_packed": None, "gemv_preshuffled": _prune_gemv_ps, "small_m": _prune_small_m,
         "large_m": _prune_large_m}
