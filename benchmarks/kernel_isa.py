"""Machine code of every Triton kernel path, compiled here with no GPU (issue 33's offline part).

Per path (kernel family x scheme variant x target, each family's first config, as launched
before autotuning picks another): registers, spills (local memory / stack bytes on NVIDIA, the
VGPR/SGPR spill counts on AMD), shared memory, the main loop's instruction count (the longest
loop closed by a backward branch) and, from it, instructions per weight element: every thread
issues the loop body once per K tile, so per weight it is ``body x threads / (BLOCK_N x
BLOCK_K)`` (threads = warps x 32 on NVIDIA, x 64 on AMD's wavefronts); ``aot.machine_code``
reads them (SASS from Triton's own ``cuobjdump``, AMDGCN from the compiler). small_m and
large_m rows are what the launcher runs (on CUDA a pre-shuffled qweight where layout.py holds
it); small_m_gptq / small_m_mma / small_m_mfma: the small-M path on the GPTQ layout or on
layout.py's pre-shuffled mma16x64 (wgmma / mma.sync fragments) or mfma16x128 (MFMA kpack 2)
forced, for the variants those layouts hold. gemv_mma / gemv_mfma: the GEMV (M <= 2) on those
layouts (``wq_gemv_preshuffled.py``, first config of gemv_preshuffled that reads the layout), what
the launcher runs for a pre-shuffled qweight; ``_asm``: its pair operations as inline asm (as gemv_asm).
small_m_asm / small_m_mma_asm / small_m_mfma_asm: the small-M path (the launcher's layout /
mma16x64 / mfma16x128) with the pairs of code - zero as inline asm (``wq_gemm.dot_asm``: fp16 and bf16
x, 4-bit fields, PTX on CUDA, AMDGCN on ROCm). large_m_swap: the tiled path with SWAP_AB (the weight
wgmma's register operand on sm90; ``wq_gemm.SWAP_AB_LARGE_M_BACKENDS``, off until timed).

    python benchmarks/kernel_isa.py                 # writes benchmarks/results/kernel-isa.{md,json}
    python benchmarks/kernel_isa.py --targets sm90 --families gemv,small_m
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
def cases(targets: list[str], families: list[str], every: bool = False):
    """(family, variant, target, config, build) of each path: the config an untuned launch runs,
    or with ``every`` each config the launcher may run for it (``aot.launch_candidates``)."""
    import triton

    from quantspec.kernels.triton import aot

    def configs(family, target, variant, preshuffled=None):
        if every:
            return aot.launch_candidates(family, target, variant, preshuffled)
        return [aot.first_config(family, target, variant, preshuffled=preshuffled)]

    def float_configs(family, target, variant):  # every: M <= 16's and larger M's tiles; else M 256's first
        if every:
            return aot.launch_candidates(family, target, variant)
        return aot.launch_candidates(family, target, variant, m_key=256)[:1]

    for target in targets:
        for family in families:
            if family in ("gemv", "small_m", "large_m"):
                for variant in aot.WQ_VARIANTS:
                    for cfg in configs(family, target, variant):
                        yield (family, variant, target, cfg, lambda f=family, v=variant, t=target, c=cfg:
                               aot.compile_path(f, t, v, c))
            elif family == "large_m_swap":  # the tiled path with SWAP_AB (wq_gemm.SWAP_AB_LARGE_M_BACKENDS, off)
                for variant in aot.WQ_VARIANTS:
                    for cfg in configs("large_m", target, variant):
                        yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg:
                               aot.compile_path("large_m", t, v, c, swap_ab=True))
            elif family in ("small_m_asm", "small_m_mma_asm", "small_m_mfma_asm"):  # pairs as inline asm (dot_asm)
                code = {"small_m_asm": None, "small_m_mma_asm": 1, "small_m_mfma_asm": 2}[family]
                for variant in aot.WQ_VARIANTS:
                    if (aot.wq_constexprs("small_m", variant, target_name=target, asm=True, preshuffled=code)["ASM"]
                            and (code is None or aot.layout_reason(variant) is None)):
                        for cfg in configs("small_m", target, variant, code):
                            yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg, p=code:
                                   aot.compile_path("small_m", t, v, c, asm=True, preshuffled=p))
            elif family in ("small_m_gptq", "small_m_mma", "small_m_mfma"):  # the small-M path on one layout
                code = {"small_m_gptq": 0, "small_m_mma": 1, "small_m_mfma": 2}[family]
                for variant in aot.WQ_VARIANTS:
                    if aot.layout_reason(variant) is None:
                        for cfg in configs("small_m", target, variant, code):
                            yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg, p=code:
                                   aot.compile_path("small_m", t, v, c, preshuffled=p))
            elif family in ("gemv_mma", "gemv_mfma", "gemv_mma_asm", "gemv_mfma_asm"):  # the pre-shuffled GEMV
                code = 1 if family.startswith("gemv_mma") else 2
                asm = family.endswith("_asm")
                for variant in aot.WQ_VARIANTS:
                    if aot.layout_reason(variant) is None and aot.packed_variant(variant, target):
                        for cfg in configs("gemv_preshuffled", target, variant, code):
                            yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg, p=code, a=asm:
                                   aot.compile_path("gemv_preshuffled", t, v, c, asm=a, preshuffled=p))
            elif family == "gemv_asm":  # the packed GEMV with its pair operations as inline asm
                for variant in aot.WQ_VARIANTS:
                    if aot.packed_variant(variant, target):
                        for cfg in configs("gemv", target, variant):
                            yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg:
                                   aot.compile_path("gemv", t, v, c, asm=True))
            elif family == "w8a8":
                cfg = aot.first_config("w8a8", target)
                yield family, "int8", target, cfg, lambda t=target, c=cfg: aot.compile_path("w8a8", t, "", c)
            elif family == "moe":
                cfg = triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=1)
                yield family, "bf16-w4g128", target, cfg, lambda t=target: aot.compile_moe("bf16", 4, False, t)
            elif family == "fp":  # fp_gemm.py, the "fp_dot" configs an untuned launch at M 256 runs
                for variant in ("bf16-fp8-channel", "fp16-nvfp4"):
                    for cfg in float_configs("fp_dot", target, variant):
                        yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg:
                               aot.compile_path("fp_dot", t, v, c))
            elif family == "fp8":  # W8A8 on fp8 tl.dot (the target's flavour; "fp8_w8a8" configs)
                for variant in ("bf16-fp8-channel", "bf16-fp8-block"):
                    for cfg in float_configs("fp8_w8a8", target, variant):
                        yield (family, variant, target, cfg, lambda v=variant, t=target, c=cfg:
                               aot.compile_path("fp8_w8a8", t, v, c))


def markdown(result: dict) -> str:
    every = result["name"].endswith("-configs")
    which = ("Every config the launcher may run for the path (its autotune list, pruned for the variant), in list "
             "order; the first table is each path's lowest count without spills." if every else "Each family's first config;")
    lines = [f"# Triton kernels' machine code (compiled here, no GPU): {result['date']}", "",
             f"Triton {result['triton']}; command: `{result['command']}`. Raw data: {result.get('name', 'kernel-isa')}.json.",
             "Instructions per weight: the main loop's instructions x threads per block / (BLOCK_N x BLOCK_K), "
             f"thread-level (every thread issues the loop body once per K tile). {which} gemv "
             "rows are the GEMV the launcher runs for the variant (fp16 / bf16 x with 4-bit fields and no g_idx: "
             "the packed GEMV, first config of gemv_packed; else the fp32 GEMV).", ""]
    head = ["| target | family | variant | warps | BLOCK_M x BLOCK_N x BLOCK_K, stages | regs | spills | shared B | loop instr | instr/weight |",
            "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]

    def line(r):
        if "error" in r:
            return f"| {r['target']} | {r['family']} | {r['variant']} | - | - | - | - | - | - | {r['error']} |"
        return (f"| {r['target']} | {r['family']} | {r['variant']} | {r['num_warps']} | {r.get('block_m') or '-'} x "
                f"{r['block_n']} x {r['block_k']}, {r['num_stages']} | {r['registers']} | {r['spills']} | {r['shared_bytes']} "
                f"| {r['loop_instructions']} | {r['instructions_per_weight']} |")
    if every:
        best: dict[tuple, dict] = {}
        for r in result["rows"]:
            key = (r["target"], r["family"], r["variant"])
            if "error" not in r and not r["spills"] and (key not in best or r["instructions_per_weight"]
                                                         < best[key]["instructions_per_weight"]):
                best[key] = r
        lines += ["## Lowest per path", "", *head, *map(line, best.values()), "", "## Every config", ""]
    lines += [*head, *map(line, result["rows"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from quantspec.kernels.triton.aot import machine_code

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="sm90,gfx942")
    p.add_argument("--families", default="gemv,gemv_asm,gemv_mma,gemv_mfma,gemv_mma_asm,gemv_mfma_asm,small_m,"
                   "small_m_asm,small_m_gptq,small_m_mma,small_m_mma_asm,small_m_mfma,small_m_mfma_asm,large_m,large_m_swap,w8a8,"
                   "moe,fp,fp8")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None, help="results file stem (default kernel-isa, kernel-isa-configs with --every-config)")
    p.add_argument("--every-config", action="store_true",
                   help="every config the launcher may run for a weight-only path (its autotune list, pruned), not the first")
    args = p.parse_args(argv)
    name = args.name or ("kernel-isa-configs" if args.every_config else "kernel-isa")
    rows = []
    for family, variant, target, cfg, build in cases(args.targets.split(","), args.families.split(","), args.every_config):
        row = {"family": family, "variant": variant, "target": target, "config": str(cfg), "block_m": cfg.kwargs.get("BLOCK_M")}
        try:
            kernel = build()
            bn = cfg.kwargs.get("BLOCK_N", 64)
            bk = cfg.kwargs.get("BLOCK_K", 32)
            row.update(machine_code(kernel, target, cfg, bn, bk))
        except Exception as exc:  # a path that does not compile is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    save("kernel_isa.py", rows, argv, args.out, name, markdown)
    return 0


def save(script: str, rows: list[dict], argv: list[str] | None, out: Path, name: str, render) -> dict:
    """Write ``rows`` with the date, Triton's version and the command as ``out/name.json`` and
    ``render``'s table as ``out/name.md`` (printed too); returns the result."""
    import triton

    result = {"date": time.strftime("%Y-%m-%d"), "triton": triton.__version__, "name": name, "rows": rows,
              "command": f"python benchmarks/{script} " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    raise SystemExit(main())
