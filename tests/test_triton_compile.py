"""The Triton kernels compile, ahead of time and with no GPU, for NVIDIA (sm80, sm90) and AMD
(gfx942): one source, each target's own autotune configs (CUDA/ROCm launch options included),
and each compiled config fits the target's shared memory (else it would fail at launch).

Triton ships the NVIDIA (ptxas) and AMD (lld) back ends in its wheel, so ``triton.compile``
with a ``GPUTarget`` builds a cubin / hsaco here. The interpreter tests check the arithmetic;
these check what the interpreter cannot: that every code path lowers to real GPU code (tl.dot
operand types, int8 accumulators, layouts of the reshapes, register-held tiles). The default
run compiles every code path with the first config of each family (the float kernels' families
fp_dot and fp8_w8a8: the first config per variant and tile class, spill-free, on sm90 and gfx942);
``-m exhaustive`` compiles every path and every config of every family and target
(benchmarks/kernel_spills.py records registers and spills of them all).
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from quantspec.kernels.triton import aot, configs  # noqa: E402
from quantspec.kernels.triton.aot import TARGETS, WQ_VARIANTS  # noqa: E402


def _binary(kernel, target_name: str):
    return kernel.asm.get("cubin" if target_name.startswith("sm") else "hsaco")


def _path_cases():
    """Default run: every code path for sm90 (GEMV and tl.dot), the main path for the others;
    -m exhaustive: every path for every target."""
    for target_name in TARGETS:
        for family in ("gemv", "small_m", "large_m"):
            for variant in WQ_VARIANTS:
                main = target_name == "sm90" and family != "large_m" or variant == "fp16-w4g128-sym"
                marks = () if main else (pytest.mark.exhaustive,)
                yield pytest.param(variant, family, target_name, marks=marks,
                                   id=f"{variant}-{family}-{target_name}")


@pytest.mark.parametrize("variant,family,target_name", list(_path_cases()))
def test_every_weight_only_path_compiles(variant, family, target_name):
    kernel = aot.compile_path(family, target_name, variant, aot.first_config(family, target_name, variant))
    assert _binary(kernel, target_name)


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_w8a8_compiles(target_name):
    kernel = aot.compile_path("w8a8", target_name, "", aot.first_config("w8a8", target_name))
    assert _binary(kernel, target_name)


@pytest.mark.exhaustive
@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("family", configs.FAMILIES)
def test_every_config_compiles(family, target_name):
    if family in aot.FLOAT_VARIANTS:  # every (variant, config) a launch runs, as kernel_spills.py
        if family == "fp8_w8a8" and target_name == "sm80":
            pytest.skip("fp8 tl.dot needs sm89+")
        for variant in aot.FLOAT_VARIANTS[family]:
            for cfg in aot.launch_candidates(family, target_name, variant):
                aot.compile_path(family, target_name, variant, cfg)
        return
    variant = "bf16-w8pc" if family == "gemv" else "fp16-w4g128-sym"  # gemv: the fp32 GEMV's configs
    for cfg in configs.configs_for(family, aot.target_key(target_name)):
        aot.compile_path(family, target_name, variant, cfg)


@pytest.mark.parametrize("target_name", ["sm90", "gfx942"])
@pytest.mark.parametrize("act,bits,zeros", [("bf16", 4, False), ("fp16", 4, True), ("bf16", 8, True)])
def test_grouped_moe_kernel_compiles(act, bits, zeros, target_name):
    """The grouped MoE GEMM (kernels/triton/moe_gemm.py) with the launcher's tiles."""
    assert _binary(aot.compile_moe(act, bits, zeros, target_name), target_name)


# The float families' variants, in the order a config takes its variant below: 16-bit tiles the
# heavier path (FP4: two dots and decodes a tile; FP8 block: two fp32 tiles), the rest their own
FLOAT_ORDER = {"fp_dot": ("fp16-nvfp4", "fp32-fp8-channel", "fp32-nvfp4"),
               "fp8_w8a8": ("bf16-fp8-block", "bf16-fp8-channel")}


def _float_config_cases(family: str):
    """Every config of a float family's list for sm90 and gfx942, once each, with the first
    variant of FLOAT_ORDER whose launch may run it (``aot.launch_candidates``: M <= 16 and above).
    benchmarks/kernel_spills.py compiles every (variant, config) pair."""
    for target_name in ("sm90", "gfx942"):
        runs = {v: {str(c) for c in aot.launch_candidates(family, target_name, v)} for v in FLOAT_ORDER[family]}
        seen = set()  # the default run: each list's first config per BLOCK_M class (16 rows, more), per variant
        for i, cfg in enumerate(configs.configs_for(family, aot.target_key(target_name))):
            variant = next((v for v in FLOAT_ORDER[family] if str(cfg) in runs[v]), None)
            first = (variant, cfg.kwargs["BLOCK_M"] <= 16) not in seen
            seen.add((variant, cfg.kwargs["BLOCK_M"] <= 16))
            yield pytest.param(target_name, variant, i, id=f"{target_name}-{i}-{variant}",
                               marks=() if first else pytest.mark.exhaustive)


def _compiled_spill_free(family: str, target_name: str, variant: str | None, index: int):
    assert variant is not None, "a config no launch runs"
    cfg = configs.configs_for(family, aot.target_key(target_name))[index]
    kernel = aot.compile_path(family, target_name, variant, cfg)
    use = aot.resource_usage(kernel, target_name)
    assert use["spills"] == 0 and use["registers"] > 0, (str(cfg), use)
    return kernel, cfg


@pytest.mark.parametrize("target_name,variant,index", list(_float_config_cases("fp_dot")))
def test_float_weight_only_kernel_compiles(target_name, variant, index):
    """FP8 / FP4 weight-only (kernels/triton/fp_gemm.py): every config of the target's "fp_dot"
    list compiles as a launch runs it (16-bit tiles on NVFP4, the FMA tiles on fp32 x) with no
    spills (the former fixed 64 x 64 x 64 spilled 4400-5024 bytes on sm90 with fp32 x)."""
    kernel, _ = _compiled_spill_free("fp_dot", target_name, variant, index)
    assert _binary(kernel, target_name)


@pytest.mark.parametrize("family", ["fp_dot", "fp8_w8a8"])
def test_float_families_have_a_list_per_vendor(family):
    """The float kernels' configs differ per vendor: NVIDIA deeper pipelines on sm90 than sm89;
    AMD num_stages 2, 16x16 MFMA, waves_per_eu, every option one the installed Triton's HIP
    backend takes (HIPOptions accepts them), kpack 2 only for fp_dot's fp16 / bf16 operands (not
    on fp8 operands, nor on gfx950), and a 4-warp first config (autotune=False) for M > 16."""
    from triton.backends.amd.compiler import HIPOptions

    sm90, sm89 = (configs.configs_for(family, ("cuda", arch)) for arch in ("90", "89"))
    hip, gfx950 = (configs.configs_for(family, ("hip", arch)) for arch in ("gfx942", "gfx950"))
    assert [str(c) for c in sm90] != [str(c) for c in hip]
    assert max(c.num_stages for c in sm90) > max(c.num_stages for c in sm89) >= 3
    assert {c.num_stages for c in hip} == {2}
    meta = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"}
    for c in hip + gfx950:
        opts = {k: v for k, v in c.kwargs.items() if k not in meta}
        assert set(opts) <= configs.hip_options(), opts
        HIPOptions(arch="gfx942", num_warps=c.num_warps, num_stages=c.num_stages, **opts)
    tl_dot = [c for c in hip if c.kwargs["BLOCK_K"] >= 64]  # not the FMA tiles (fp32 x)
    assert all(c.kwargs["matrix_instr_nonkdim"] == 16 for c in tl_dot)
    assert any(c.kwargs["waves_per_eu"] for c in tl_dot)
    kpack = {c.kwargs.get("kpack") for c in tl_dot}
    assert kpack == ({2} if family == "fp_dot" else {None})
    assert all(c.kwargs.get("kpack", 1) == 1 for c in gfx950)
    first = next(c for c in hip if c.kwargs["BLOCK_M"] > 16)
    assert first is hip[0] and first.num_warps == 4 and first.kwargs["BLOCK_M"] * first.kwargs["BLOCK_N"] <= 128 * 128


@pytest.mark.parametrize("target_name", ["sm90", "gfx942"])
@pytest.mark.parametrize("family", ["gemv", "small_m", "large_m"])
def test_the_main_w4_paths_do_not_spill(family, target_name):
    """fp16 W4 g128 (the common checkpoint) on every weight-only path: no register spills, and
    the main loop is found in the machine code (benchmarks/kernel_isa.py tabulates every path)."""
    cfg = aot.first_config(family, target_name, "fp16-w4g128-sym")
    kernel = aot.compile_path(family, target_name, "fp16-w4g128-sym", cfg)
    code = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
    assert code["spills"] == 0, code
    assert code["loop_instructions"] > 0 and code["registers"] > 0


@pytest.mark.parametrize("target_name", ["sm90", "gfx942"])
@pytest.mark.parametrize("path", ["int8", "fp8", "fp8-block"])
def test_the_w8a8_paths_do_not_spill(path, target_name):
    """The int8 and FP8 W8A8 kernels compiled as a launch specializes them (16-byte aligned
    pointers, N and K multiples of 16: ``aot.DIVISIBLE``): no spills, the main loop found. Without
    that specialization the int8 kernel spilled 624 B per thread on sm90 (every address kept
    per element)."""
    if path == "int8":
        cfg = aot.first_config("w8a8", target_name)
        kernel = aot.compile_path("w8a8", target_name, "", cfg)
    else:  # the first "fp8_w8a8" config an untuned launch at M 256 runs (what compile_fp8 builds)
        variant = "bf16-fp8-block" if path == "fp8-block" else "bf16-fp8-channel"
        cfg = aot.launch_candidates("fp8_w8a8", target_name, variant, m_key=256)[0]
        kernel = aot.compile_fp8("bf16", path == "fp8-block", target_name)
    code = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
    assert code["spills"] == 0, code
    assert code["loop_instructions"] > 0 and code["registers"] > 0


def test_loop_readers_on_known_listings():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   HFMA2 R4, R4, R5, R6 ;
        /*0030*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
    """
    assert aot.sass_loop(sass) == 4  # 0x10 .. 0x40
    gcn = """
    s_mov_b32 s0, 0
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
.Ltmp3:
    v_add_u32 v1, v1, v2
    s_add_i32 s0, s0, 1
    s_cbranch_scc1 .LBB0_1
.LBB0_2:
    s_endpgm
    """
    assert aot.amdgcn_loop(gcn) == 3


@pytest.mark.parametrize("target_name", ["sm90", "gfx942"])
@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_w8a8_compiles(grouped, target_name):
    """The fp8 tl.dot kernel lowers to the target's fp8 MMA: wgmma on e4m3 operands on sm90,
    MFMA on FNUZ fp8 (bf8/fp8 "fp8_fp8") on gfx942, and the activation quantizer compiles."""
    kernel = aot.compile_fp8("bf16", grouped, target_name)
    if target_name == "sm90":
        assert re.search(r"wgmma\.mma_async\.sp?\S*\.e4m3\.e4m3", kernel.asm["ptx"]), "no fp8 wgmma in the PTX"
    else:
        assert re.search(r"v_mfma_f32_\w+_fp8_fp8", kernel.asm["amdgcn"]), "no fp8 MFMA in the AMDGCN"
    aot.compile_fp8_quant("bf16", target_name)


@pytest.mark.parametrize("target_name,variant,index", list(_float_config_cases("fp8_w8a8")))
def test_fp8_w8a8_configs_compile_spill_free(target_name, variant, index):
    """Every config of the target's "fp8_w8a8" list, on the grouped (FP8 block) path where it
    launches there (BLOCK_K 128, ``prune.GROUPED_TILE_PER_WARP``), else per channel: no spills,
    and the MMA: gfx942 the FNUZ fp8 MFMA; sm90 wgmma on e4m3 operands, except the 16-row tiles
    (M <= 16), where Triton takes mma.sync (MMAv2) and converts the fp8 operands to fp16 (exact)."""
    kernel, cfg = _compiled_spill_free("fp8_w8a8", target_name, variant, index)
    if target_name == "gfx942":
        assert re.search(r"v_mfma_f32_\w+_fp8_fp8", kernel.asm["amdgcn"]), "no fp8 MFMA"
    elif cfg.kwargs["BLOCK_M"] >= 64:
        assert re.search(r"wgmma\.mma_async\.sp?\S*\.e4m3\.e4m3", kernel.asm["ptx"]), "no fp8 wgmma"
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in kernel.asm["ptx"]


# The packed GEMV (M <= 2, fp16 / bf16 x, 4-bit fields) in the first config: the main loop's
# instructions per weight (thread-level: loop body x threads / (BLOCK_N x BLOCK_K)) stay within
# these budgets. Measured with Triton 3.9 (the fp32 GEMV it replaced: sm90 fp16 6.047, bf16 6.625,
# gfx942 fp16 10.0): pair operations as inline asm (``asm``, not yet run on a GPU) sm90 fp16
# 2.281, bf16 asym 3.961 (4.227 before the zero pairs were built from the integer), gfx942 fp16
# 2.328, bf16 asym 3.094 (3.797 before v_fma_mix_f32 and the one-statement chains); in plain Triton
# (what the launcher runs until the asm path has passed the gpu tests) sm90 fp16 2.766, bf16 4.508,
# gfx942 fp16 3.188, bf16 4.547. An H200 SM streaming 4-bit weights at full bandwidth has about 3.5
# instructions per weight to spend (kernels-h200.md).
GEMV_BUDGETS = {("sm90", "fp16-w4g128-sym", True): 2.35, ("sm90", "bf16-w4g128-asym", True): 4.05,
                ("gfx942", "fp16-w4g128-sym", True): 2.4, ("gfx942", "bf16-w4g128-asym", True): 3.2,
                ("sm90", "fp16-w4g128-sym", False): 2.85, ("gfx942", "fp16-w4g128-sym", False): 3.3,
                ("sm90", "bf16-w4g128-asym", False): 4.6, ("gfx942", "bf16-w4g128-asym", False): 4.65}
# instructions that convert a zero point to fp16 (the u8 -> fp32 -> fp16 route; pair_ops builds the
# pairs from the integer) and, for bf16 x on AMD with asm, a weight lane to fp32 (v_fma_mix_f32 reads
# it in place; the scales' conversions remain, one per column)
ZERO_CONVERSIONS = {"sm90": re.compile(r"^(I2FP|F2F|F2FP)\b"), "gfx942": re.compile(r"^(v_cvt_f32_ubyte\d|v_cvt_f16_f32)")}


def _loop(kernel, target_name: str) -> list[str]:
    """The main loop's instructions, predicates dropped."""
    if target_name.startswith("sm"):
        return [re.sub(r"^@!?U?P\w+\s+", "", ins) for ins in aot.sass_loop_body(aot.cuobjdump(kernel.asm["cubin"]))]
    return aot.amdgcn_loop_body(kernel.asm["amdgcn"])


@pytest.mark.parametrize("target_name,variant,asm", list(GEMV_BUDGETS))
def test_the_w4_gemv_instruction_budget(target_name, variant, asm):
    """No spills and the budget; with zero points no zero point is converted in the loop; bf16 x
    on AMD with asm multiplies the fp16 lanes in place (v_fma_mix_f32, no lane conversions)."""
    cfg = aot.first_config("gemv", target_name, variant)
    kernel = aot.compile_path("gemv", target_name, variant, cfg, asm=asm)
    code = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
    assert code["spills"] == 0, code
    assert code["instructions_per_weight"] <= GEMV_BUDGETS[target_name, variant, asm], code
    loop = _loop(kernel, target_name)
    assert not [ins for ins in loop if ZERO_CONVERSIONS[target_name].match(ins)], "a zero point converted in the loop"
    if target_name == "gfx942" and asm and variant.startswith("bf16"):
        assert sum(ins.startswith("v_fma_mix_f32") for ins in loop) == 64, "bf16 products not v_fma_mix_f32"
        assert sum(ins.startswith("v_cvt_f32_f16") for ins in loop) <= 4, "weight lanes converted to fp32"


def test_amdgcn_templates_read_halves_as_llvm_does():
    """The AMDGCN templates (pair_ops) spell their operand modifiers as LLVM's own code for gfx942
    does for the same operations, so that their meaning is the compiler's, not a reading of the ISA
    guide (the tests' ``_run_amdgcn`` emulates that meaning): an fp32 fma of an fp16 lane is
    v_fma_mix_f32 with op_sel_hi:[0,1,0] (src1 f16) and, for the high lane, op_sel:[0,1,0] (a
    two-line kernel); the high lane's conversion is v_cvt_f32_f16_sdwa ... src0_sel:WORD_1 (the
    plain packed GEMV for bf16 x, whose weight lanes LLVM converts)."""
    import triton.language as tl
    from triton.compiler import ASTSource

    from quantspec.kernels.triton import pair_ops

    @triton.jit
    def plain(a_ptr, x_ptr, o_ptr):
        offs = tl.arange(0, 64)
        a = tl.load(a_ptr + offs)
        x = tl.load(x_ptr + offs)
        y = tl.load(x_ptr + offs + 64)
        lo = a.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (a >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        tl.store(o_ptr + offs, tl.fma(y, hi, tl.fma(x, lo, y)))

    src = ASTSource(fn=plain, signature={"a_ptr": "*u32", "x_ptr": "*fp32", "o_ptr": "*fp32"}, constexprs={})
    gcn = triton.compile(src, target=TARGETS["gfx942"][0]).asm["amdgcn"]
    lo_mix, hi_mix = "op_sel_hi:[0,1,0]", "op_sel:[0,1,0] op_sel_hi:[0,1,0]"
    assert re.search(r"v_fma_mix_f32 v\d+, v\d+, v\d+, v\d+ " + re.escape(lo_mix) + "\n", gcn), gcn
    assert re.search(r"v_fma_mix_f32 v\d+, v\d+, v\d+, v\d+ " + re.escape(hi_mix) + "\n", gcn), gcn
    for template in (pair_ops.AMD_MIX2.value, pair_ops.AMD_MIX8.value):
        lines = template.splitlines()
        assert all(ln.endswith(lo_mix) and "op_sel:" not in ln for ln in lines[0::2]), template
        assert all(ln.endswith(hi_mix) for ln in lines[1::2]), template
    sdwa = "src0_sel:WORD_1"
    cfg = aot.first_config("gemv", "gfx942", "bf16-w4g128-asym")
    gemv = aot.compile_path("gemv", "gfx942", "bf16-w4g128-asym", cfg, asm=False).asm["amdgcn"]
    assert re.search(r"v_cvt_f32_f16_sdwa v\d+, v\d+ dst_sel:DWORD dst_unused:UNUSED_PAD " + sdwa, gemv)
    assert "v_cvt_f32_f16_sdwa $1, $1 dst_sel:DWORD dst_unused:UNUSED_PAD " + sdwa in pair_ops.AMD_BF16_PAIR_EVEN.value


# The small-M tl.dot path with SWAP_AB (acc.T += W.T @ x.T) on the GPTQ layout, what the launcher runs on
# both targets for a weight that is not pre-shuffled:
# instructions per weight within these budgets (measured with Triton 3.9: sm90 fp16 4.891, bf16
# 5.438, gfx942 fp16 4.5, bf16 12.188; the plain product: 6.094, 7.625, 9.25, 14.875).
SWAP_AB_BUDGETS = {("sm90", "fp16-w4g128-sym"): 5.0, ("sm90", "bf16-w4g128-asym"): 5.6,
                   ("gfx942", "fp16-w4g128-sym"): 4.7, ("gfx942", "bf16-w4g128-asym"): 12.5}


@pytest.mark.parametrize("target_name,variant", list(SWAP_AB_BUDGETS))
def test_small_m_swap_ab_budget_and_operands(target_name, variant):
    """No spills and the budget; on sm90 the dequantized weight is wgmma's register operand
    (``HGMMA ... R<a>, gdesc[..]``: A from registers, x.T the shared-memory descriptor) and
    reaches it without a scalar store per element (the plain product's 64 STS.U16 per thread)."""
    assert aot.wq_gemm.swap_ab("small_m", aot.TARGETS[target_name][0].backend, 4)
    cfg = aot.first_config("small_m", target_name, variant)
    kernel = aot.compile_path("small_m", target_name, variant, cfg, swap_ab=True, preshuffled=False)
    code = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
    assert code["spills"] == 0, code
    assert code["instructions_per_weight"] <= SWAP_AB_BUDGETS[target_name, variant], code
    if target_name == "sm90":
        sass = aot.cuobjdump(kernel.asm["cubin"])
        assert re.search(r"HGMMA\.64x16x16\.F32\S* R\d+, R\d+, gdesc\[", sass), "wgmma A is not a register operand"
        assert "STS.U16" not in sass


# The same path on a pre-shuffled qweight (layout.py; 1: mma16x64, 2: mfma16x128; opt-in),
# measured with Triton 3.9: sm90 fp16 3.328, bf16 3.875, sm80 fp16 4.172; gfx942 mfma16x128 fp16
# 3.344, bf16 10.219 (mma16x64 there: 4.031, 11.781).
PRESHUFFLED_BUDGETS = {("sm90", "fp16-w4g128-sym", 1): 3.45, ("sm90", "bf16-w4g128-asym", 1): 4.0,
                       ("sm80", "fp16-w4g128-sym", 1): 4.3, ("gfx942", "fp16-w4g128-sym", 2): 3.45,
                       ("gfx942", "bf16-w4g128-asym", 2): 10.5}


@pytest.mark.parametrize("target_name,variant,code", list(PRESHUFFLED_BUDGETS))
def test_small_m_preshuffled_budget_and_operands(target_name, variant, code):
    """No spills and the budget; on sm90 the weight tile reaches wgmma's register operand with no
    shared-memory layout change (no STS.128 / LDSM of the dequantized tile: each thread's 16-byte
    load is its fragment) and no per-element byte permutes of the pairs; on gfx942 (mfma16x128)
    shared memory holds x alone (BLOCK_K x 16 fp16: the weight tile skips LDS)."""
    cfg = aot.first_config("small_m", target_name, variant, preshuffled=code)
    kernel = aot.compile_path("small_m", target_name, variant, cfg, swap_ab=True, preshuffled=code)
    code_ = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
    assert code_["spills"] == 0, code_
    assert code_["instructions_per_weight"] <= PRESHUFFLED_BUDGETS[target_name, variant, code], code_
    if target_name == "gfx942":
        assert code_["shared_bytes"] <= cfg.kwargs["BLOCK_K"] * 16 * 2 * 2, code_
    if target_name == "sm90":
        sass = aot.cuobjdump(kernel.asm["cubin"])
        assert re.search(r"HGMMA\.64x16x16\.F32\S* R\d+, R\d+, gdesc\[", sass), "wgmma A is not a register operand"
        assert "LDSM" not in sass and not re.search(r"\sSTS(\.U16|\.128)?\s", sass), "weight tile through shared memory"
        assert sass.count("PRMT") <= 2, "pairs re-packed byte by byte"


# The same path with its pairs of code - zero as inline asm (ASM, ``wq_gemm.dot_asm``: fp16 and bf16 x,
# 4-bit fields, with and without zero points; PTX on CUDA, AMDGCN on ROCm; off by default until run on a
# GPU), first config, measured with Triton 3.9 (instructions per weight, plain -> asm): sm90 fp16 sym
# mma16x64 3.328 -> 2.984, GPTQ 4.891 -> 3.75; fp16 asym 3.672 -> 3.156, 5.438 -> 4.125; bf16 asym
# 3.875 -> 3.391, 5.438 -> 4.297; sm80 fp16 sym mma16x64 4.172 -> 2.578, GPTQ 6.734 -> 3.484; gfx942
# fp16 sym mfma16x128 3.344 -> 2.875, GPTQ 4.5 -> 3.781; fp16 asym 3.656 -> 3.0, 5.188 -> 4.594; bf16
# asym 10.219 -> 4.781, 12.188 -> 6.094 (LLVM rounds each bf16 subtraction through fp32 there). Layout
# code 0: GPTQ, 1: mma16x64, 2: mfma16x128.
DOT_ASM_BUDGETS = {
    ("sm90", "fp16-w4g128-sym", 1): 3.05, ("sm90", "fp16-w4g128-sym", 0): 3.85,
    ("sm90", "fp16-w4g128-asym", 1): 3.25, ("sm90", "fp16-w4g128-asym", 0): 4.2,
    ("sm90", "bf16-w4g128-asym", 1): 3.45, ("sm90", "bf16-w4g128-asym", 0): 4.4,
    ("sm80", "fp16-w4g128-sym", 1): 2.7, ("sm80", "fp16-w4g128-sym", 0): 3.6,
    ("gfx942", "fp16-w4g128-sym", 2): 2.95, ("gfx942", "fp16-w4g128-sym", 0): 3.85,
    ("gfx942", "fp16-w4g128-asym", 2): 3.1, ("gfx942", "fp16-w4g128-asym", 0): 4.7,
    ("gfx942", "bf16-w4g128-asym", 2): 4.9, ("gfx942", "bf16-w4g128-asym", 0): 6.2}


@pytest.mark.parametrize("target_name,variant,code", list(DOT_ASM_BUDGETS))
def test_small_m_asm_pairs(target_name, variant, code):
    """With ASM: no spills, the budget, fewer instructions than the plain path and no more
    shared-memory ones in the loop. CUDA: no mask re-made per use (plain Triton: an IMAD.MOV per
    LOP3; here the magic numbers, 1/16 and the zero pairs' multipliers, at most 2 sym and 6 asym)
    and, on mma16x64, no PRMT (the GPTQ layout keeps the plain path's: its pairs are re-paired for
    the trip through shared memory); the PTX holds the blocks. gfx942: one v_and_or_b32 a pair
    (plain Triton: v_and_b32 + v_or_b32), v_pk_add_f16 / v_pk_fma_f16, and for bf16 one v_perm_b32 a
    pair and no fp32 -> bf16 rounding sequence (v_cmp_o_f32 + v_cndmask per lane)."""
    cfg = aot.first_config("small_m", target_name, variant, preshuffled=code)
    plain, asm = (aot.compile_path("small_m", target_name, variant, cfg, swap_ab=True, preshuffled=code, asm=a)
                  for a in (False, True))
    bn, bk = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"]
    m_plain, m_asm = aot.machine_code(plain, target_name, cfg, bn, bk), aot.machine_code(asm, target_name, cfg, bn, bk)
    assert m_asm["spills"] == 0, m_asm
    assert m_asm["instructions_per_weight"] <= DOT_ASM_BUDGETS[target_name, variant, code], m_asm
    assert m_asm["loop_instructions"] < m_plain["loop_instructions"], (m_plain, m_asm)
    assert len(aot.loop_shared_ops(asm, target_name)) <= len(aot.loop_shared_ops(plain, target_name))
    loop = _loop(asm, target_name)
    pairs = bn * bk // (2 * cfg.num_warps * (32 if target_name.startswith("sm") else 64))  # a thread's
    if target_name.startswith("sm"):
        movs = sum(ins.startswith("IMAD.MOV") for ins in loop)
        assert movs <= (2 if variant == "fp16-w4g128-sym" else 6), [ins for ins in loop if "MOV" in ins]
        assert not any("MOV" in ins and re.search(r"0xf000f0?\b", ins) for ins in loop), "a mask re-made in the loop"
        if code:
            assert not any(ins.startswith("PRMT") for ins in loop), "pairs re-packed byte by byte"
        ptx = asm.asm["ptx"]
        if variant.startswith("bf16"):
            assert "fma.rn.bf16x2" in ptx and "0x43004300" in ptx
        else:
            assert "lop3.b32" in ptx and "add.rn.f16x2" in ptx and "fma.rn.f16x2" in ptx
    else:
        ops = [ins.split()[0] for ins in loop]
        assert ops.count("v_and_or_b32") == pairs and "v_and_b32_e32" not in ops, ops
        assert "v_pk_add_f16" in ops and "v_pk_fma_f16" in ops
        if variant.startswith("bf16"):
            assert ops.count("v_perm_b32") >= pairs and "v_cmp_o_f32_e64" not in ops and "v_cndmask_b32_e64" not in ops


def test_dot_asm_only_where_asked():
    """ASM is off by default on every target (``wq_gemm.ASM_DOT_PAIR_OPS``: what the launcher and
    the AOT compiles read), and asked for it is set for fp16 and bf16 x with 4-bit fields and no
    g_idx: 2 (PTX) on CUDA, 3 (AMDGCN) on ROCm; fp32 x, other field widths and g_idx keep the plain
    path."""
    assert not aot.wq_gemm.ASM_DOT_PAIR_OPS
    for target_name in TARGETS:
        for variant in WQ_VARIANTS:
            act, bits, _, _, gidx, _ = WQ_VARIANTS[variant]
            for family in ("small_m", "large_m"):
                assert not aot.wq_constexprs(family, variant, target_name=target_name)["ASM"]
                want = {"cuda": 2, "hip": 3}[TARGETS[target_name][0].backend] if act != "fp32" and bits == 4 and not gidx else 0
                assert aot.wq_constexprs(family, variant, target_name=target_name, asm=True)["ASM"] == want


# The GEMV (M <= 2) on a pre-shuffled qweight (wq_gemv_preshuffled.py; 1: mma16x64 on sm90, 2:
# mfma16x128 on gfx942), first config, pair operations in plain Triton (what runs) and as inline
# asm, measured with Triton 3.9: sm90 fp16 2.859 / asm 2.219, bf16 asym 4.469 / 3.906; gfx942 fp16
# 3.25 / 2.297, bf16 asym 4.766 / 3.344 (the GPTQ-layout packed GEMV: sm90 2.766 / 2.281, 4.508 /
# 3.961; gfx942 3.188 / 2.328, 4.547 / 3.094; docs/decisions/preshuffled-layout.md).
PRESHUFFLED_GEMV_BUDGETS = {  # (target, variant, layout code, asm): instructions per weight
    ("sm90", "fp16-w4g128-sym", 1, False): 2.95, ("sm90", "bf16-w4g128-asym", 1, False): 4.5,
    ("sm90", "fp16-w4g128-sym", 1, True): 2.3, ("sm90", "bf16-w4g128-asym", 1, True): 3.95,
    ("gfx942", "fp16-w4g128-sym", 2, False): 3.35, ("gfx942", "bf16-w4g128-asym", 2, False): 4.85,
    ("gfx942", "fp16-w4g128-sym", 2, True): 2.35, ("gfx942", "bf16-w4g128-asym", 2, True): 3.4}


@pytest.mark.parametrize("target_name,variant,code,asm", list(PRESHUFFLED_GEMV_BUDGETS))
def test_preshuffled_gemv_budget(target_name, variant, code, asm):
    """No spills and the budget; no shared memory in the loop on sm90 (it holds the final
    cross-thread sum only: each thread's 16-byte loads are the words it computes with)."""
    cfg = aot.first_config("gemv_preshuffled", target_name, variant, preshuffled=code)
    kernel = aot.compile_path("gemv_preshuffled", target_name, variant, cfg, asm=asm, preshuffled=code)
    code_ = aot.machine_code(kernel, target_name, cfg, cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"])
    assert code_["spills"] == 0, code_
    assert code_["instructions_per_weight"] <= PRESHUFFLED_GEMV_BUDGETS[target_name, variant, code, asm], code_
    assert code_["shared_bytes"] <= cfg.kwargs["BLOCK_N"] * 4 * 2, code_
    assert not aot.loop_shared_ops(kernel, target_name), "shared memory in the loop"


# The same GEMV with zero points at 4 rows a thread (the lists' other configs: gfx942 mfma16x128
# 256 x 128 x 4 warps and 128 x 128 x 2, sm90 mma16x64 256 x 64): a zero load with as many elements
# as threads is a layout anchor, and loaded after the words it gave its layout to the dequantized
# pairs, which went through shared memory (Triton 3.9, plain / asm: gfx942 7.922 / 5.297 with 160 / 64
# LDS instructions in the loop, sm90 7.328 / 4.883 with 256 / 64). Loaded before the words (then 4.602
# / 3.055 and 22 / 16; sm90 4.484 / 3.945 and 28 / 22), only the zero pairs and one partial sum are
# converted (with the zero pairs built from the integer: gfx942 4.578 / 3.0 and 3.016, sm90 4.414 /
# 3.875). Budgets (instructions per weight, asm False / True) and the bound on shared-memory
# instructions in the loop:
ROWS4_ZERO_BUDGETS = {("gfx942", 256, 128, 4): (4.7, 3.1), ("gfx942", 128, 128, 2): (4.7, 3.1),
                      ("sm90", 256, 64, 4): (4.5, 3.95)}
ROWS4_SHARED_OPS = 32


@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize("target_name,bn,bk,warps", list(ROWS4_ZERO_BUDGETS))
def test_preshuffled_gemv_zero_points_at_4_rows_a_thread(target_name, bn, bk, warps, asm):
    code = 1 if target_name == "sm90" else 2
    cfg = next(c for c in configs.configs_for("gemv_preshuffled", aot.target_key(target_name))
               if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps) == (bn, bk, warps))
    kernel = aot.compile_path("gemv_preshuffled", target_name, "bf16-w4g128-asym", cfg, asm=asm, preshuffled=code)
    code_ = aot.machine_code(kernel, target_name, cfg, bn, bk)
    assert code_["spills"] == 0, code_
    assert code_["instructions_per_weight"] <= ROWS4_ZERO_BUDGETS[target_name, bn, bk, warps][asm], code_
    assert len(aot.loop_shared_ops(kernel, target_name)) <= ROWS4_SHARED_OPS, "dequantized pairs through shared memory"


def _store_offset_types(ttir: str) -> list[str]:
    """The element type of the offsets each ``tt.store``'s address was built with (the addptr
    that defines the stored pointer)."""
    defs = dict(re.findall(r"(%[\w.]+) = (tt\.addptr .*)", ttir))
    types = []
    for ptr in re.findall(r"tt\.store (%[\w.]+),", ttir):
        m = re.search(r"tensor<[\dx]+x(i\d+)>|, (i\d+) ", defs.get(ptr, ""))
        types.append((m.group(1) or m.group(2)) if m else "?")
    return types


@pytest.mark.parametrize("split_k", [1, 2])
def test_stores_address_in_int64(split_k):
    """The epilogue (tiles.store_result: output or split-K partials) and the split-K reduction
    index in int64, so that M x N past 2**31 elements (a long prefill through a wide layer) does
    not wrap; with int32 offsets these stores read tensor<...xi32>."""
    from quantspec.kernels.triton import wq_gemm

    cfg = aot.first_config("large_m", "sm90", "fp16-w4g128-sym")
    consts = aot.wq_constexprs("large_m", "fp16-w4g128-sym", split_k=split_k)
    kernel = aot.compile_kernel(wq_gemm._wq_dot_kernel.fn, aot.wq_types("fp16"), consts, cfg, "sm90")
    assert _store_offset_types(kernel.asm["ttir"]) == ["i64"]
    types = {"part_ptr": "*fp32", "b_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "N": "i32"}
    reduce = aot.compile_kernel(wq_gemm._splitk_reduce_kernel, types,
                                {"SPLIT_K": 2, "HAS_BIAS": True, "BLOCK": 1024},
                                triton.Config({}, num_warps=4, num_stages=1), "sm90")
    ttir = reduce.asm["ttir"]
    assert _store_offset_types(ttir) == ["i64"]
    assert re.search(r"tt\.addptr %\S+, %\S+ : tensor<1024x!tt\.ptr<f32>>, tensor<1024xi64>", ttir), \
        "partials read with int32 offsets"


@pytest.mark.parametrize("target,flavour", [
    (("hip", "gfx942"), "e4m3fnuz"), (("hip", "gfx940"), "e4m3fnuz"), (("hip", "gfx950"), "e4m3fn"),
    (("cuda", "90"), "e4m3fn"), (("cuda", "89"), "e4m3fn"), (("cuda", "100"), "e4m3fn")])
def test_fp8_flavour_per_target(target, flavour):
    """MI300 (gfx94x) multiplies E4M3FNUZ (bias 8, max 240); MI355 (gfx950) and NVIDIA take OCP E4M3FN:
    the W8A8 kernel's activation codes and the prepared weights follow this choice."""
    from quantspec.kernels.triton.fp8_w8a8 import FP8_FORMATS, fp8_format

    assert fp8_format(target) == flavour and FP8_FORMATS[flavour] == (240.0 if flavour == "e4m3fnuz" else 448.0)
