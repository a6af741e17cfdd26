"""Ahead-of-time compilation of every Triton kernel path, with no GPU, for NVIDIA and AMD targets.

Triton ships the NVIDIA (ptxas) and AMD (lld) back ends in its wheel, so ``triton.compile`` with
a ``GPUTarget`` builds a cubin / hsaco on any machine. ``compile_path(family, target, variant,
config)`` builds one code path (a kernel family, a scheme variant, a config) the way the
launchers specialize it; tests/test_triton_compile.py checks that every path lowers and fits the
target's shared memory. ``machine_code`` reads what was built (registers, spills, the main loop's
instructions per weight; ``resource_usage``: registers, spills and shared memory alone);
benchmarks/kernel_isa.py tabulates it for every path, benchmarks/kernel_spills.py the spills of
every config a launch may run (``launch_candidates``; the float kernels' fp_dot / fp8_w8a8 per
variant of ``FLOAT_VARIANTS``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import configs, prune, wq_gemm

TARGETS = {  # name -> (GPUTarget, shared memory per block in bytes)
    "sm90": (GPUTarget("cuda", 90, 32), 232448),
    "sm80": (GPUTarget("cuda", 80, 32), 166912),
    "gfx942": (GPUTarget("hip", "gfx942", 64), 65536),
}
HIP_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
DIVISIBLE = ("N", "K", "stride_xm")  # integer arguments a model's layers give as multiples of 16
PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}

# code paths of the weight-only kernels: (activation dtype, bits, group, zeros, g_idx, even tiles)
WQ_VARIANTS = {
    "fp16-w4g128-sym": ("fp16", 4, 128, False, False, True),
    "bf16-w4g128-asym": ("bf16", 4, 128, True, False, True),
    "fp16-w4g128-asym": ("fp16", 4, 128, True, False, True),
    "fp16-w4g128-gidx-masked": ("fp16", 4, 128, True, True, False),
    "bf16-w8pc": ("bf16", 8, wq_gemm.PER_CHANNEL_GROUP, False, False, True),
    "fp32-w3g32-masked": ("fp32", 3, 32, True, False, False),
    "fp16-w2g64": ("fp16", 2, 64, False, False, True),
}

# code paths of the float kernels. fp_dot (fp_gemm.py): (activation dtype, kind 0 FP8 / 1 FP4, group
# along K); fp8_w8a8 (fp8_w8a8.py): (activation dtype, grouped: FP8_BLOCK scales)
FP_VARIANTS = {
    "bf16-fp8-channel": ("bf16", 0, wq_gemm.PER_CHANNEL_GROUP),
    "fp16-fp8-block": ("fp16", 0, 128),
    "fp16-nvfp4": ("fp16", 1, 16),
    "bf16-mxfp4": ("bf16", 1, 32),
    "fp32-fp8-channel": ("fp32", 0, wq_gemm.PER_CHANNEL_GROUP),
    "fp32-nvfp4": ("fp32", 1, 16),
}
FP8_VARIANTS = {"bf16-fp8-channel": ("bf16", False), "bf16-fp8-block": ("bf16", True),
                "fp32-fp8-block": ("fp32", True)}
FLOAT_VARIANTS = {"fp_dot": FP_VARIANTS, "fp8_w8a8": FP8_VARIANTS}
FLOAT_M_KEYS = (16, 256)  # the float families' two tile sets: BLOCK_M 16 (M <= 16) and taller


class SharedMemoryExceeded(ValueError):
    """A compiled config needs more shared memory than the target has (it would fail at launch)."""


def target_key(target_name: str) -> tuple[str, str]:
    """(backend, arch) as ``configs.configs_for`` takes it."""
    target = TARGETS[target_name][0]
    return target.backend, str(target.arch)


def packed_variant(variant: str, target_name: str) -> bool:
    """Whether the launcher runs a weight-only variant's GEMV (M <= 2) on the packed GEMV."""
    act, bits, group, _, gidx, _ = WQ_VARIANTS[variant]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[act]
    return wq_gemm.gemv_packed(dtype, wq_gemm.field_bits(bits), group, gidx, TARGETS[target_name][0].backend) != 0


def first_config(family: str, target_name: str, variant: str | None = None,
                 preshuffled: bool | int | None = None) -> triton.Config:
    """The first config of a family's list for the target; with a weight-only ``variant``, the
    one an untuned launch runs (``launch_candidates``: the packed GEMV's list for "gemv" when the
    variant runs there, pre-shuffled where the variant is by default; ``preshuffled``: False,
    True / 1 (mma16x64) or 2 (mfma16x128) force one)."""
    if variant is None:
        return configs.configs_for(family, target_key(target_name))[0]
    return launch_candidates(family, target_name, variant, preshuffled)[0]


def launch_candidates(family: str, target_name: str, variant: str, preshuffled: bool | int | None = None,
                      m_key: int | None = None) -> list[triton.Config]:
    """The configs the launcher may run for a weight-only ``variant`` on the target, in list order
    (``prune.candidates`` with the launch's constexprs; ``m_key`` defaults to 16 for small_m,
    256 for large_m; for the float families fp_dot / fp8_w8a8, whose ``variant`` is one of
    ``FLOAT_VARIANTS``, to both ``FLOAT_M_KEYS``: their BLOCK_M 16 tiles, then the taller ones);
    empty where none fits (a layout no config of the target reads: the launcher refuses it)."""
    if family in FLOAT_VARIANTS:  # both tile sets unless m_key picks one
        meta = float_constexprs(family, variant)
        cfgs = configs.configs_for(family, target_key(target_name))
        keep = [c for mk in ((m_key,) if m_key else FLOAT_M_KEYS) for c in prune.candidates(family, cfgs, mk, meta)
                if prune.fits(family, c, mk, meta)]
        return list(dict.fromkeys(keep))
    if family == "gemv" and packed_variant(variant, target_name):
        family = "gemv_packed"
    meta = wq_constexprs(family, variant, target_name=target_name, preshuffled=preshuffled)
    cfgs = configs.configs_for(family, target_key(target_name))
    m_key = m_key or {"small_m": 16, "large_m": 256}.get(family, meta.get("BLOCK_M", 1))
    if family == "gemv_packed":
        return cfgs
    return [c for c in prune.candidates(family, cfgs, m_key, meta) if prune.fits(family, c, m_key, meta)]


def layout_reason(variant: str) -> str | None:
    """Why layout.py's pre-shuffled layout cannot hold a weight-only variant (None: it can)."""
    _, bits, group, _, gidx, _ = WQ_VARIANTS[variant]
    return wq_gemm.preshuffle_reason(bits, group, gidx)


def preshuffled_variant(family: str, variant: str, target_name: str) -> bool:
    """Whether the backend pre-shuffles a weight-only variant's qweight by default on the target
    (``wq_gemm.preshuffled_default``), so that the tl.dot ``family`` reads layout.py's layout."""
    _, bits, group, _, gidx, _ = WQ_VARIANTS[variant]
    return wq_gemm.preshuffled_default(family, TARGETS[target_name][0].backend, bits, group, gidx)


def compile_kernel(fn, types: dict, constexprs: dict, cfg: triton.Config, target_name: str):
    """``fn`` (a @triton.jit function) compiled for ``target_name`` with ``cfg``'s meta-parameters
    and launch options; raises SharedMemoryExceeded when it would not launch there."""
    target, smem_limit = TARGETS[target_name]
    meta = {k: v for k, v in cfg.kwargs.items() if k not in HIP_OPTIONS}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if target.backend == "hip":
        options.update({k: v for k, v in cfg.kwargs.items() if k in HIP_OPTIONS})
    consts = {**constexprs, **meta}
    signature = {name: ("constexpr" if name in consts else types[name]) for name in fn.arg_names}
    # what a launch specializes (Triton's get_*_specialization): pointers 16-byte aligned, and
    # integers divisible by 16, here the shapes and strides a real layer has (never M)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in consts and (types[name].startswith("*") or name in DIVISIBLE)}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs), target=target,
                            options=options)
    if kernel.metadata.shared > smem_limit:
        raise SharedMemoryExceeded(f"{fn.__name__} {cfg} needs {kernel.metadata.shared} B of shared memory "
                                   f"on {target_name} (limit {smem_limit})")
    return kernel


def wq_types(act: str) -> dict:
    return {"x_ptr": PTR[act], "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "gidx_ptr": "*i32",
            "b_ptr": PTR[act], "out_ptr": PTR[act], "part_ptr": "*fp32", "M": "i32", "N": "i32",
            "K": "i32", "stride_xm": "i32", "M_KEY": "i32", "code_mask": "i32"}


def wq_constexprs(family: str, variant: str, split_k: int = 2, target_name: str = "sm90",
                  asm: bool | None = None, swap_ab: bool | None = None,
                  preshuffled: bool | int | None = None) -> dict:
    """The constexprs the launcher gives ``family``'s kernel for a weight-only ``variant``
    (``compile_path`` documents the overrides; ``asm`` None: the launcher's default,
    ``wq_gemm.ASM_PAIR_OPS`` for the GEMVs, ``wq_gemm.ASM_DOT_PAIR_OPS`` for the tl.dot kernel)."""
    act, bits, group, zeros, gidx, even = WQ_VARIANTS[variant]
    fb = wq_gemm.field_bits(bits)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[act]
    c = dict(FB=fb, GROUP=group, SYM_ZERO=float(1 << (bits - 1)), HAS_ZEROS=zeros, HAS_GIDX=gidx,
             HAS_BIAS=True, SPLIT_K=split_k, EVEN_K=even, EVEN_N=even)
    if family in ("gemv", "gemv_packed", "gemv_preshuffled"):
        c["BLOCK_M"] = 1
        asm = wq_gemm.ASM_PAIR_OPS if asm is None else asm
        packed = wq_gemm.gemv_packed(dtype, fb, group, gidx, TARGETS[target_name][0].backend, asm)
        if packed:  # the packed GEMV (else the fp32 one)
            c["PACKED"] = packed
        if family == "gemv_preshuffled":  # on a pre-shuffled qweight (True / None: mma16x64)
            c["PRESHUFFLED"] = int(preshuffled) if preshuffled else 1
    else:
        c["DOT_F32"] = act == "fp32"
        c["MAGIC16"] = wq_gemm._magic16(dtype, fb)
        if swap_ab is None:  # what the launcher runs on the target
            swap_ab = wq_gemm.swap_ab(family, TARGETS[target_name][0].backend, fb)
        c["SWAP_AB"] = swap_ab
        if preshuffled is None:  # what the launcher runs by default on the target
            preshuffled = wq_gemm.preshuffled_default(family, TARGETS[target_name][0].backend, bits, group, gidx)
        c["PRESHUFFLED"] = int(preshuffled)  # True: mma16x64 (1); 2: mfma16x128
        asm = wq_gemm.ASM_DOT_PAIR_OPS if asm is None else asm
        c["ASM"] = wq_gemm.dot_asm(TARGETS[target_name][0].backend, dtype, fb, gidx, asm)
    return c


def compile_path(family: str, target_name: str, variant: str, cfg: triton.Config,
                 asm: bool | None = None, swap_ab: bool | None = None,
                 preshuffled: bool | int | None = None):
    """One code path: ``family`` gemv / gemv_packed / small_m / large_m (weight-only, ``variant``
    of WQ_VARIANTS), w8a8, or the float kernels' fp_dot / fp8_w8a8 (``variant`` of FP_VARIANTS /
    FP8_VARIANTS), with ``cfg``. "gemv" compiles the GEMV the launcher runs for the variant: the
    packed GEMV (fp16 / bf16 x, 4-bit fields, no g_idx) or the fp32 one; ``asm``: the packed GEMV's
    pair operations as inline asm (``wq_gemm.ASM_PAIR_OPS``), for small_m / large_m the pairs of
    code - zero as inline asm (``wq_gemm.dot_asm``: PTX on CUDA, AMDGCN on ROCm; None: the
    launcher's default); ``swap_ab``: the tl.dot kernel's transposed product (None: as the
    launcher picks it, ``wq_gemm.swap_ab``); ``preshuffled``: qweight in layout.py's mma16x64
    layout (None: the backend's default for the target, ``wq_gemm.preshuffled_default``; True or
    1: mma16x64, 2: mfma16x128)."""
    if family == "fp_dot":
        act, kind, group = FP_VARIANTS[variant]
        return compile_fp(act, kind, target_name, cfg, group)
    if family == "fp8_w8a8":
        act, grouped = FP8_VARIANTS[variant]
        return compile_fp8(act, grouped, target_name, cfg)
    if family == "w8a8":
        from . import w8a8

        types = {"qx_ptr": "*i8", "sx_ptr": "*fp32", "qw_ptr": "*i8", "sw_ptr": "*fp32", "b_ptr": "*fp16",
                 "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "M_KEY": "i32"}
        return compile_kernel(w8a8._w8a8_kernel, types, {"HAS_BIAS": True}, cfg, target_name)
    if preshuffled is None and family in ("small_m", "large_m") and not prune.preshuffled_fits(cfg, 1):
        preshuffled = False  # a config the launcher prunes for pre-shuffled weights: the GPTQ layout's code
    consts = wq_constexprs(family, variant, target_name=target_name, asm=asm, swap_ab=swap_ab,
                           preshuffled=preshuffled)
    if family in ("gemv", "gemv_packed", "gemv_preshuffled"):  # the GEMV the launcher runs for the variant (M <= 2)
        if "PACKED" not in consts:
            if family != "gemv":
                raise ValueError(f"{variant} does not run on the packed GEMV on {target_name}")
            kernel = wq_gemm._wq_gemv_kernel
        elif family == "gemv_preshuffled":
            if layout_reason(variant) is not None:
                raise ValueError(f"{variant}: {layout_reason(variant)}")
            kernel = wq_gemm._wq_gemv_ps_kernel
        else:
            kernel = wq_gemm._wq_gemv_f16x2_kernel
            if "ROWS" not in cfg.kwargs:
                raise ValueError(f"{variant} runs on the packed GEMV: it takes a gemv_packed config (with ROWS)")
    else:
        kernel = wq_gemm._wq_dot_kernel
    return compile_kernel(kernel.fn, wq_types(WQ_VARIANTS[variant][0]), consts, cfg, target_name)


def compile_moe(act: str, bits: int, zeros: bool, target_name: str, block=(16, 64, 32)):
    """The grouped MoE GEMM (moe_gemm.py) with the launcher's tiles."""
    from . import moe_gemm

    types = {"x_ptr": PTR[act], "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": PTR[act],
             "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "code_mask": "i32"}
    consts = dict(FB=wq_gemm.field_bits(bits), GROUP=128, SYM_ZERO=float(1 << (bits - 1)), HAS_ZEROS=zeros,
                  BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2])
    return compile_kernel(moe_gemm._moe_wq_kernel, types, consts, triton.Config({}, num_warps=4, num_stages=1),
                          target_name)


def float_constexprs(family: str, variant: str) -> dict:
    """The scheme constexprs the float launchers give fp_dot / fp8_w8a8 for a variant (what the
    autotuner's prune receives)."""
    if family == "fp_dot":
        act, kind, group = FP_VARIANTS[variant]
        return {"KIND": kind, "GROUP": group, "HAS_BIAS": True, "DOT_F32": act == "fp32"}
    act, grouped = FP8_VARIANTS[variant]
    return {"GROUPED": grouped, "HAS_BIAS": True}


def _float_variant(variants: dict, *want) -> str:
    return next(v for v, spec in variants.items() if spec[:len(want)] == want)


def compile_fp(act: str, kind: int, target_name: str, cfg: triton.Config | None = None, group: int | None = None):
    """FP8 (kind 0) / FP4 (kind 1) weight-only (fp_gemm.py) with ``cfg`` (None: the first config
    an untuned launch at M 256 runs, from the target's "fp_dot" list); ``group`` along K (None:
    16 for FP4, per channel for FP8)."""
    from . import fp_gemm

    types = {"x_ptr": PTR[act], "c_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": PTR[act], "out_ptr": PTR[act],
             "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "M_KEY": "i32"}
    group = group if group is not None else (16 if kind else fp_gemm.PER_CHANNEL_GROUP)
    consts = dict(KIND=kind, GROUP=group, HAS_BIAS=True, DOT_F32=act == "fp32")
    if cfg is None:
        cfg = launch_candidates("fp_dot", target_name, _float_variant(FP_VARIANTS, act, kind), m_key=256)[0]
    return compile_kernel(fp_gemm._fp_dot_kernel, types, consts, cfg, target_name)


def compile_fp8(act: str, grouped: bool, target_name: str, cfg: triton.Config | None = None):
    """FP8 W8A8 (fp8_w8a8.py) with ``cfg`` (None: the first config an untuned launch at M 256
    runs, from the target's "fp8_w8a8" list), in the target's FP8 flavour (E4M3FNUZ on gfx942)."""
    from . import fp8_w8a8

    fnuz = fp8_w8a8.fp8_format(target_key(target_name)) == "e4m3fnuz"
    f8 = "*fp8e4b8" if fnuz else "*fp8e4nv"
    types = {"qx_ptr": f8, "sx_ptr": "*fp32", "qw_ptr": f8, "sw_ptr": "*fp32", "b_ptr": PTR[act],
             "out_ptr": PTR[act], "M": "i32", "N": "i32", "K": "i32", "stride_sxm": "i32", "M_KEY": "i32"}
    consts = dict(GROUPED=grouped, HAS_BIAS=True)
    if cfg is None:
        cfg = launch_candidates("fp8_w8a8", target_name, _float_variant(FP8_VARIANTS, "bf16", grouped), m_key=256)[0]
    return compile_kernel(fp8_w8a8._fp8_dot_kernel, types, consts, cfg, target_name)


def compile_fp8_quant(act: str, target_name: str):
    """The fp8 activation quantizer (dynamic, per token) in the target's flavour."""
    from . import fp8_w8a8

    types = {"x_ptr": PTR[act], "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32", "group": "i32", "stride_xm": "i32",
             "n_groups": "i32"}
    fnuz = fp8_w8a8.fp8_format(target_key(target_name)) == "e4m3fnuz"
    consts = dict(STATIC=False, FNUZ=fnuz, BLOCK_K=1024)
    return compile_kernel(fp8_w8a8._quant_fp8_kernel, types, consts, triton.Config({}, num_warps=4, num_stages=1),
                          target_name)


# -- reading the machine code -------------------------------------------------------------

SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def sass_loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop of a SASS listing (between a backward branch's target
    and the branch, both included); [] without a loop."""
    lines, best = [], []
    for line in sass.splitlines():
        m = SASS_LINE.search(line)
        if not m:
            continue
        here = int(m.group(1), 16)
        lines.append((here, m.group(2)))
        b = BRANCH.search(m.group(2))
        if b and int(b.group(1), 16) < here:
            body = [ins for a, ins in lines if int(b.group(1), 16) <= a]
            best = body if len(body) > len(best) else best
    return best


def sass_loop(sass: str) -> int:
    """Instructions of the longest loop of a SASS listing (``sass_loop_body``); 0 without a loop."""
    return len(sass_loop_body(sass))


def amdgcn_loop_body(asm: str) -> list[str]:
    """The instructions of the largest loop of an AMDGCN listing, by LLVM's own block annotations
    (``; =>This Inner Loop Header`` / ``in Loop: Header=BB0_8``): the blocks of one innermost loop."""
    body: dict[str, list[str]] = {}
    current = None
    for ln in (raw.strip() for raw in asm.splitlines()):
        label = re.match(r"^\.L(BB\d+_\d+):(.*)$", ln)
        if label:
            note = label.group(2)
            head = re.search(r"Header=(BB\d+_\d+)", note)
            current = head.group(1) if head else (label.group(1) if "Loop Header" in note else None)
            continue
        if re.match(r"^\.L\w+:", ln):  # a local label inside a block (debug line marks)
            continue
        if re.match(r"^[A-Za-z_.][\w.]*:", ln):  # a function's or section's label: out of loops
            current = None
            continue
        if current and ln and not ln.startswith((";", ".", "//")):
            body.setdefault(current, []).append(ln)
    return max(body.values(), key=len, default=[])


def amdgcn_loop(asm: str) -> int:
    """Instructions of the largest loop of an AMDGCN listing (``amdgcn_loop_body``)."""
    return len(amdgcn_loop_body(asm))


SHARED_OPS = {"sm": re.compile(r"(STS|LDS|STSM|LDSM|BAR)\b"), "gfx": re.compile(r"(ds_\w+|s_barrier)\b")}


def loop_shared_ops(kernel, target_name: str) -> list[str]:
    """The main loop's instructions that touch shared memory (NVIDIA: STS / LDS / STSM / LDSM / BAR;
    AMD: ds_* / s_barrier): a register layout change inside the loop shows here."""
    if target_name.startswith("sm"):
        loop = [re.sub(r"^@!?U?P\w+\s+", "", ins) for ins in sass_loop_body(cuobjdump(kernel.asm["cubin"]))]
        pattern = SHARED_OPS["sm"]
    else:
        loop, pattern = amdgcn_loop_body(kernel.asm["amdgcn"]), SHARED_OPS["gfx"]
    return [ins for ins in loop if pattern.match(ins)]


def cuobjdump(cubin: bytes, flag: str = "-sass") -> str:
    """Triton's own cuobjdump run on a cubin (``-sass``: the SASS listing; ``-res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True).stdout


def cuda_usage(cubin: bytes) -> dict:
    res, sass = cuobjdump(cubin, "-res-usage"), cuobjdump(cubin)
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    return {"registers": int(fields.get("REG", 0)), "stack_bytes": int(fields.get("STACK", 0)),
            "local_bytes": int(fields.get("LOCAL", 0)), "loop_instructions": sass_loop(sass),
            "spills": int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0))}


def resource_usage(kernel, target_name: str) -> dict:
    """Registers, spills and shared memory alone, as ``machine_code`` reads them, without reading
    the listing's main loop (cuobjdump -sass of a long kernel takes a second)."""
    if target_name.startswith("sm"):
        res = cuobjdump(kernel.asm["cubin"], "-res-usage")
        fields = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", res)}
        use = {"registers": fields.get("REG", 0), "spills": fields.get("LOCAL", 0) + fields.get("STACK", 0)}
    else:
        use = {k: v for k, v in hip_usage(kernel.asm["amdgcn"]).items() if k in ("registers", "spills")}
    return {**use, "shared_bytes": int(kernel.metadata.shared)}


def hip_usage(asm: str) -> dict:
    def field(name: str) -> int:
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0

    return {"registers": field("vgpr_count"), "sgprs": field("sgpr_count"),
            "spills": field("vgpr_spill_count") + field("sgpr_spill_count"),
            "loop_instructions": amdgcn_loop(asm)}


def machine_code(kernel, target_name: str, cfg, block_n: int, block_k: int) -> dict:
    """Registers, spills, shared memory and the main loop's instructions (total and per weight
    element: ``body x threads / (block_n x block_k)``) of a kernel compiled for ``target_name``."""
    lanes = 32 if target_name.startswith("sm") else 64
    use = cuda_usage(kernel.asm["cubin"]) if target_name.startswith("sm") else hip_usage(kernel.asm["amdgcn"])
    threads = cfg.num_warps * lanes
    per_weight = use["loop_instructions"] * threads / (block_n * block_k) if use["loop_instructions"] else None
    return {**use, "shared_bytes": int(kernel.metadata.shared), "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "block_n": block_n, "block_k": block_k, "threads": threads,
            "instructions_per_weight": round(per_weight, 3) if per_weight else None}
