"""The Triton kernels compile, ahead of time and with no GPU, for NVIDIA (sm80, sm90) and AMD
(gfx942): one source, each target's own autotune configs (CUDA/ROCm launch options included),
and each compiled config fits the target's shared memory (else it would fail at launch).

Triton ships the NVIDIA (ptxas) and AMD (lld) back ends in its wheel, so ``triton.compile``
with a ``GPUTarget`` builds a cubin / hsaco here. The interpreter tests check the arithmetic;
these check what the interpreter cannot: that every code path lowers to real GPU code (tl.dot
operand types, int8 accumulators, layouts of the reshapes, register-held tiles). The default
run compiles every code path with the first config of each family; ``-m exhaustive`` compiles
every path and every config of every family and target.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from quantspec.kernels.triton import configs  # noqa: E402
from quantspec.kernels.triton import w8a8 as w8a8_mod  # noqa: E402
from quantspec.kernels.triton import wq_gemm  # noqa: E402

TARGETS = {  # name -> (GPUTarget, shared memory per block in bytes)
    "sm90": (GPUTarget("cuda", 90, 32), 232448),
    "sm80": (GPUTarget("cuda", 80, 32), 166912),
    "gfx942": (GPUTarget("hip", "gfx942", 64), 65536),
}
HIP_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}

# code paths of the weight-only kernels: (activation dtype, bits, group, zeros, g_idx, even tiles)
WQ_VARIANTS = {
    "fp16-w4g128-sym": ("fp16", 4, 128, False, False, True),
    "bf16-w4g128-asym": ("bf16", 4, 128, True, False, True),
    "fp16-w4g128-gidx-masked": ("fp16", 4, 128, True, True, False),
    "bf16-w8pc": ("bf16", 8, wq_gemm.PER_CHANNEL_GROUP, False, False, True),
    "fp32-w3g32-masked": ("fp32", 3, 32, True, False, False),
    "fp16-w2g64": ("fp16", 2, 64, False, False, True),
}


def _cuda_or_hip(target: GPUTarget) -> tuple[str, str]:
    return target.backend, str(target.arch)


def _compile(fn, types: dict, constexprs: dict, cfg, target_name: str):
    target, smem_limit = TARGETS[target_name]
    meta = {k: v for k, v in cfg.kwargs.items() if k not in HIP_OPTIONS}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if target.backend == "hip":
        options.update({k: v for k, v in cfg.kwargs.items() if k in HIP_OPTIONS})
    consts = {**constexprs, **meta}
    signature = {name: ("constexpr" if name in consts else types[name]) for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=target,
                            options=options)
    assert kernel.metadata.shared <= smem_limit, (
        f"{fn.__name__} {cfg} needs {kernel.metadata.shared} B of shared memory on {target_name}")
    return kernel


def _wq_types(act: str) -> dict:
    return {"x_ptr": PTR[act], "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "gidx_ptr": "*i32",
            "b_ptr": PTR[act], "out_ptr": PTR[act], "part_ptr": "*fp32", "M": "i32", "N": "i32",
            "K": "i32", "stride_xm": "i32", "M_KEY": "i32", "code_mask": "i32"}


def _wq_constexprs(family: str, variant: str, cfg, split_k: int = 2) -> dict:
    act, bits, group, zeros, gidx, even = WQ_VARIANTS[variant]
    fb = wq_gemm.field_bits(bits)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[act]
    c = dict(FB=fb, GROUP=group, SYM_ZERO=float(1 << (bits - 1)), HAS_ZEROS=zeros, HAS_GIDX=gidx,
             HAS_BIAS=True, SPLIT_K=split_k, EVEN_K=even, EVEN_N=even)
    if family == "gemv":
        c["BLOCK_M"] = 1
    else:
        c["DOT_F32"] = act == "fp32"
        c["MAGIC16"] = wq_gemm._magic16(dtype, fb)
    return c


def _compile_family(family: str, target_name: str, variant: str, cfg):
    if family == "w8a8":
        types = {"qx_ptr": "*i8", "sx_ptr": "*fp32", "qw_ptr": "*i8", "sw_ptr": "*fp32", "b_ptr": "*fp16",
                 "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "M_KEY": "i32"}
        return _compile(w8a8_mod._w8a8_kernel, types, {"HAS_BIAS": True}, cfg, target_name)
    kernel = wq_gemm._wq_gemv_kernel if family == "gemv" else wq_gemm._wq_dot_kernel
    fn = kernel.fn  # under the EVEN_K / EVEN_N heuristics
    return _compile(fn, _wq_types(WQ_VARIANTS[variant][0]), _wq_constexprs(family, variant, cfg), cfg, target_name)


def _first_config(family: str, target_name: str):
    return configs.configs_for(family, _cuda_or_hip(TARGETS[target_name][0]))[0]


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
    kernel = _compile_family(family, target_name, variant, _first_config(family, target_name))
    assert kernel.asm.get("cubin" if target_name.startswith("sm") else "hsaco")


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_w8a8_compiles(target_name):
    kernel = _compile_family("w8a8", target_name, "", _first_config("w8a8", target_name))
    assert kernel.asm.get("cubin" if target_name.startswith("sm") else "hsaco")


@pytest.mark.exhaustive
@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("family", configs.FAMILIES)
def test_every_config_compiles(family, target_name):
    for cfg in configs.configs_for(family, _cuda_or_hip(TARGETS[target_name][0])):
        _compile_family(family, target_name, "fp16-w4g128-sym", cfg)


@pytest.mark.parametrize("target_name", ["sm90", "gfx942"])
@pytest.mark.parametrize("act,bits,zeros", [("bf16", 4, False), ("fp16", 4, True), ("bf16", 8, True)])
def test_grouped_moe_kernel_compiles(act, bits, zeros, target_name):
    """The grouped MoE GEMM (kernels/triton/moe_gemm.py) with the launcher's tiles."""
    from quantspec.kernels.triton import moe_gemm

    types = {"x_ptr": PTR[act], "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": PTR[act],
             "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "code_mask": "i32"}
    consts = dict(FB=wq_gemm.field_bits(bits), GROUP=128, SYM_ZERO=float(1 << (bits - 1)), HAS_ZEROS=zeros,
                  BLOCK_M=16, BLOCK_N=64, BLOCK_K=32)
    kernel = _compile(moe_gemm._moe_wq_kernel, types, consts, triton.Config({}, num_warps=4, num_stages=1),
                      target_name)
    assert kernel.asm.get("cubin" if target_name.startswith("sm") else "hsaco")


@pytest.mark.parametrize("target_name", ["sm90", "gfx942"])
@pytest.mark.parametrize("act,kind", [("bf16", 0), ("fp16", 1), ("fp32", 1)])
def test_float_weight_only_kernel_compiles(act, kind, target_name):
    """FP8 / FP4 weight-only (kernels/triton/fp_gemm.py) with its fixed GPU tiles."""
    from quantspec.kernels.triton import fp_gemm

    types = {"x_ptr": PTR[act], "c_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": PTR[act], "out_ptr": PTR[act],
             "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "M_KEY": "i32"}
    consts = dict(KIND=kind, GROUP=16 if kind else fp_gemm.PER_CHANNEL_GROUP, HAS_BIAS=True,
                  DOT_F32=act == "fp32")
    cfg = triton.Config(dict(fp_gemm._GPU_CONFIG), num_warps=4, num_stages=2)
    kernel = _compile(fp_gemm._fp_dot_kernel, types, consts, cfg, target_name)
    assert kernel.asm.get("cubin" if target_name.startswith("sm") else "hsaco")
