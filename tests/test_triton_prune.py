"""Which configs a weight-only launch may run (kernels/triton/prune.py), the autotuner's key, and
that the candidates of the paths that spilled before compile spill-free (no GPU: compiled here);
the same for the float kernels' families (fp_dot, fp8_w8a8)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from quantspec.kernels.triton import aot, configs, prune, wq_gemm  # noqa: E402

TARGETS = (("cuda", "90"), ("hip", "gfx942"))


def _meta(**kw):
    return {"GROUP": 128, "HAS_GIDX": False, "DOT_F32": False, "PRESHUFFLED": 0, **kw}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("family", ["small_m", "large_m"])
def test_fp32_operands_take_the_fma_tiles_only(family, target):
    """fp32 x runs Triton's FMA dot, which spilled at BLOCK_K >= 32 (sm90 large_m 13232 bytes);
    16-bit x never gets those narrow tiles."""
    cfgs = configs.configs_for(family, target)
    fp32 = prune.candidates(family, cfgs, 256, _meta(DOT_F32=True))
    f16 = prune.candidates(family, cfgs, 256, _meta())
    assert fp32 and all(c.kwargs["BLOCK_K"] == prune.FMA_BLOCK_K for c in fp32)
    assert f16 and all(c.kwargs["BLOCK_K"] > prune.FMA_BLOCK_K for c in f16)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("family", ["gemv", "small_m", "large_m"])
def test_the_group_size_prunes_tiles_that_straddle_groups(family, target):
    """Group 32: only K tiles inside one group (each scaled once, not gathered per element); a
    g_idx layer (every tile gathers) keeps the list's tiles that fit."""
    cfgs = configs.configs_for(family, target)
    meta = _meta(GROUP=32, BLOCK_M=1)
    g32 = prune.candidates(family, cfgs, 16, meta)
    assert g32 and all(32 % c.kwargs["BLOCK_K"] == 0 for c in g32)
    assert any(c.kwargs["BLOCK_K"] > 32 for c in prune.candidates(family, cfgs, 16, _meta(BLOCK_M=1)))
    gidx = prune.candidates(family, cfgs, 16, _meta(GROUP=32, HAS_GIDX=True, BLOCK_M=1))
    assert any(c.kwargs["BLOCK_K"] > 32 for c in gidx)


def test_g_idx_tiles_stay_small():
    """The tiles that spilled with g_idx (kernel-spills.md before the limit): the sm90 GEMV at
    1024 x 16 and 128 x 128, gfx942 tl.dot tiles of 8192 elements a thread, are not candidates."""
    gemv = prune.candidates("gemv", configs.configs_for("gemv", ("cuda", "90")), 1, _meta(HAS_GIDX=True, BLOCK_M=1))
    assert gemv and not any((c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) in ((1024, 16), (128, 128)) for c in gemv)
    large = prune.candidates("large_m", configs.configs_for("large_m", ("hip", "gfx942")), 256, _meta(HAS_GIDX=True))
    assert large
    for c in large:
        per_thread = c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] / (c.num_warps * 32)
        assert per_thread <= prune.GIDX_TILE_PER_THREAD


def test_the_first_hip_config_is_not_the_largest_tile():
    """autotune=False runs the list's first fitting config: on ROCm a 4-warp 128 x 128 tile, not
    256 x 256 with 8 warps near the LDS limit."""
    first = configs.configs_for("large_m", ("hip", "gfx942"))[0]
    assert (first.kwargs["BLOCK_M"], first.kwargs["BLOCK_N"], first.num_warps) == (128, 128, 4)


def test_hip_options_are_those_this_triton_takes(monkeypatch):
    """kpack, waves_per_eu, matrix_instr_nonkdim are passed only when the installed Triton's HIP
    backend declares them, so a Triton that drops kpack keeps launching."""
    assert {"kpack", "waves_per_eu", "matrix_instr_nonkdim"} <= configs.hip_options()
    assert all(c.kwargs.get("kpack") == 2 for c in configs.configs_for("small_m", ("hip", "gfx942"))
               if c.kwargs["BLOCK_K"] > 16)
    monkeypatch.setattr(configs, "hip_options", lambda: frozenset({"waves_per_eu"}))
    for family in configs.FAMILIES:
        for c in configs.configs_for(family, ("hip", "gfx942")):
            assert "kpack" not in c.kwargs and "matrix_instr_nonkdim" not in c.kwargs


def test_autotune_key_names_the_scheme():
    """Two layers of one N, K but another scheme (group size, zero points, g_idx, layout, inline asm,
    fp32 operands) tune their own config: every scheme constexpr of the tl.dot kernel is in the key,
    and M buckets go past 256."""
    dot_args = set(wq_gemm._wq_dot_kernel.fn.arg_names)
    for name in ("FB", "GROUP", "HAS_ZEROS", "HAS_GIDX", "PRESHUFFLED", "ASM", "DOT_F32"):
        assert name in wq_gemm.AUTOTUNE_KEY and name in dot_args
    assert "PACKED" in wq_gemm.AUTOTUNE_KEY and "PACKED" in wq_gemm._wq_gemv_f16x2_kernel.fn.arg_names
    assert wq_gemm.M_KEY_MAX >= 1024


CASES = [("large_m", "sm90", "fp32-w3g32-masked"), ("large_m", "gfx942", "fp32-w3g32-masked"),
         ("small_m", "sm90", "fp32-w3g32-masked"), ("large_m", "gfx942", "fp16-w4g128-gidx-masked")]


@pytest.mark.parametrize("family,target_name,variant", CASES)
def test_paths_that_spilled_now_compile_spill_free(family, target_name, variant):
    """Every candidate config of the paths that spilled (sm90 large_m fp32: 13232 bytes in the first
    config; gfx942 large_m g_idx: 12-381 in three) compiled: no spills. The whole sweep:
    benchmarks/kernel_spills.py."""
    cands = aot.launch_candidates(family, target_name, variant, m_key=32 if family == "small_m" else 256)
    assert cands
    for cfg in cands:
        kernel = aot.compile_path(family, target_name, variant, cfg)
        code = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
        assert code["spills"] == 0, (str(cfg), code)


def test_chosen_configs_lists_what_each_autotuner_picked(monkeypatch):
    """configs.chosen_configs (kernel_speed's "chosen config" column) reads every autotuner that
    ``autotuned`` built, keyed by family and the tuner's key."""
    class Tuner:  # what configs.chosen_configs reads of triton's Autotuner: its cache
        def __init__(self, cache):
            self.cache = cache

    small = configs.configs_for("small_m", ("cuda", "90"))[0]
    monkeypatch.setattr(configs, "_TUNERS", [("small_m", Tuner({(16, 4096, 4096): small})), ("gemv", Tuner({}))])
    assert configs.chosen_configs() == {"small_m (16, 4096, 4096)": str(small)}


# ---- the float kernels' families (fp_gemm.py: fp_dot; fp8_w8a8.py: fp8_w8a8) ----

FLOAT_TARGETS = (("cuda", "90"), ("cuda", "89"), ("hip", "gfx942"), ("hip", "gfx950"))


@pytest.mark.parametrize("target", FLOAT_TARGETS)
@pytest.mark.parametrize("family", ["fp_dot", "fp8_w8a8"])
def test_every_float_launch_keeps_configs_that_fit(family, target):
    """Every scheme path and M bucket keeps configs (autotune=False runs the first): BLOCK_M 16
    exactly for M <= 16 (the former fixed tiles' rule); fp_dot's fp32 x the FMA tiles (a tl.dot K
    of 16: BLOCK_K 16 for FP8, 32 for FP4's two half-tile dots), 16-bit x BLOCK_K 64 / 128 (an FP4
    half tile of whole NVFP4 / MXFP4 groups); the FP8 block path BLOCK_K 128, per channel 128 / 256."""
    cfgs = configs.configs_for(family, target)
    for variant in aot.FLOAT_VARIANTS[family]:
        meta = aot.float_constexprs(family, variant)
        for m in (1, 16, 17, 256, 5000):
            m_key = configs.m_key(m)
            cands = prune.candidates(family, cfgs, m_key, meta)
            assert cands and all(prune.fits(family, c, m_key, meta) for c in cands), (variant, m)
            assert all((c.kwargs["BLOCK_M"] == 16) == (m <= 16) for c in cands)
            bks = {c.kwargs["BLOCK_K"] for c in cands}
            if family == "fp8_w8a8":
                assert bks == {128} if meta["GROUPED"] else bks <= {128, 256}
            elif meta["DOT_F32"]:
                assert bks == {prune.FMA_BLOCK_K << meta["KIND"]}
            else:
                assert bks <= {64, 128}


def test_the_fp8_block_path_prunes_tiles_that_spilled():
    """Two fp32 tiles a thread on the grouped path: sm90's 128 x 256 on 8 warps (256 bytes of
    spills) and gfx942's 128 x 128 on 4 (waves_per_eu 2: 14 VGPRs) run per channel only."""
    for target, tile in ((("cuda", "90"), (128, 256, 8)), (("hip", "gfx942"), (128, 128, 4))):
        cfg = next(c for c in configs.configs_for("fp8_w8a8", target)
                   if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) == tile)
        assert prune.fits("fp8_w8a8", cfg, 256, {"GROUPED": False})
        assert not prune.fits("fp8_w8a8", cfg, 256, {"GROUPED": True})


def test_float_autotune_keys_name_the_scheme():
    """The float launchers' keys: the M bucket and the scheme's constexprs, every name an argument
    of the kernel (Triton 3.9's autotune refuses others); the autotuner's prune takes the launch."""
    from quantspec.kernels.triton import fp8_w8a8, fp_gemm

    launchers = ((fp_gemm._fp_dot_kernel, fp_gemm.AUTOTUNE_KEY, ("KIND", "GROUP", "DOT_F32"), "fp_dot"),
                 (fp8_w8a8._fp8_dot_kernel, fp8_w8a8.AUTOTUNE_KEY, ("GROUPED",), "fp8_w8a8"))
    for kernel, key, scheme, family in launchers:
        assert set(key) <= set(kernel.arg_names) and {"M_KEY", "N", "K", *scheme} <= set(key)
        cfgs = configs.configs_for(family, ("cuda", "90"))
        prune_by = {"early_config_prune": prune.PRUNE[family]}
        triton.autotune(configs=cfgs, key=list(key), prune_configs_by=prune_by)(kernel)  # refuses unknown names
        meta = aot.float_constexprs(family, next(iter(aot.FLOAT_VARIANTS[family])))
        kept = prune.PRUNE[family](cfgs, {"M_KEY": 1}, **meta)
        assert kept and all(c.kwargs["BLOCK_M"] == 16 for c in kept)
    assert [configs.m_key(m) for m in (1, 2, 3, 16, 17, 300, 10**6)] == [1, 2, 4, 16, 32, 512, configs.M_KEY_MAX]


def test_untuned_float_launch_runs_the_first_fitting_config(monkeypatch):
    """prune.launch with autotune=False (TritonBackend(autotune=False)): the target's first config
    that fits, HIP options included, as launch options."""
    launched = []

    class Kernel:  # records what a launch passes
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw)

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "current_target", lambda: ("hip", "gfx942"))
    prune.launch("fp8_w8a8", Kernel(), None, (), {"GROUPED": True, "HAS_BIAS": False}, 256, False, ())
    fp4 = {"KIND": 1, "GROUP": 16, "HAS_BIAS": False, "DOT_F32": False}
    prune.launch("fp_dot", Kernel(), None, (), fp4, 8, False, ())
    big, small = launched
    assert (big["BLOCK_M"], big["BLOCK_N"], big["BLOCK_K"], big["num_warps"]) == (128, 128, 128, 8)
    assert big["matrix_instr_nonkdim"] == 16 and "kpack" not in big and big["num_stages"] == 2
    assert small["BLOCK_M"] == 16 and small["BLOCK_K"] >= 64 and small["kpack"] == 2 and small["KIND"] == 1
