"""Registers and spills of every config the launcher may run, compiled here with no GPU (issue 33:
"zero spills everywhere").

kernel_isa.py reads each path's first config; the autotuner may pick any config that survives
the launch's pruning (``prune.candidates``: tiles that fit the launch, the group-aligned ones
where any is, fp32 operands on the FMA tiles). This compiles each of them, per target, kernel
family and scheme variant (``aot.launch_candidates``; small_m at M_KEY 32, so both BLOCK_M), and
lists those that spill (local memory / stack bytes on NVIDIA, VGPR/SGPR spills on AMD). The float
kernels' families fp_dot (fp_gemm.py) and fp8_w8a8 (fp8_w8a8.py) are compiled per variant of
``aot.FP_VARIANTS`` / ``aot.FP8_VARIANTS``, each candidate at M <= 16 (BLOCK_M 16) and above.

    python benchmarks/kernel_spills.py                 # writes benchmarks/results/kernel-spills.{md,json}
    python benchmarks/kernel_spills.py --targets sm90 --families large_m --out /tmp/spills
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = Path(__file__).resolve().parent / "results"
M_KEYS = {"small_m": 32, "large_m": 256}


def cases(targets: list[str], families: list[str]):
    """(target, family, variant, config, layout) of every candidate config."""
    from quantspec.kernels.triton import aot

    for target in targets:
        for family in families:
            if family in aot.FLOAT_VARIANTS:  # fp_dot / fp8_w8a8: both tile sets (aot.FLOAT_M_KEYS)
                for variant in aot.FLOAT_VARIANTS[family]:
                    for cfg in aot.launch_candidates(family, target, variant):
                        yield target, family, variant, cfg, None
                continue
            for variant in aot.WQ_VARIANTS:
                layouts = [None]  # the launcher's default layout
                if family in ("small_m", "large_m", "gemv_preshuffled") and aot.layout_reason(variant) is None:
                    own = [1] if target.startswith("sm") else [1, 2]  # NVIDIA takes mma16x64 for mfma16x128
                    layouts = own if family == "gemv_preshuffled" else [None, False, *own]
                if family == "gemv_preshuffled" and not aot.packed_variant(variant, target):
                    continue
                for layout in dict.fromkeys(layouts):
                    for cfg in aot.launch_candidates(family, target, variant, layout, M_KEYS.get(family)):
                        yield target, family, variant, cfg, layout


def compile_row(target: str, family: str, variant: str, cfg, layout) -> dict:
    from quantspec.kernels.triton import aot

    row = {"target": target, "family": family, "variant": variant, "layout": layout, "config": str(cfg),
           "block": [cfg.kwargs.get("BLOCK_M"), cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"]],
           "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    fam = "gemv_packed" if family == "gemv" and aot.packed_variant(variant, target) else family
    try:
        kernel = aot.compile_path(fam, target, variant, cfg, preshuffled=layout)
        row.update(aot.resource_usage(kernel, target))  # registers, spills, shared_bytes
    except aot.SharedMemoryExceeded as exc:  # the launcher's autotuner skips a config that cannot launch
        row["skipped"] = f"shared memory: {str(exc).splitlines()[0][:120]}"
    except Exception as exc:  # a config that does not compile is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return row


LAYOUT_NAMES = {None: "default", False: "gptq", 1: "mma16x64", 2: "mfma16x128"}


def markdown(result: dict) -> str:
    rows = result["rows"]
    compiled = [r for r in rows if "spills" in r]
    spilling = [r for r in compiled if r["spills"]]
    lines = [f"# Spills of every launchable Triton config (compiled here, no GPU): {result['date']}", "",
             f"Triton {result['triton']}; command: `{result['command']}`. Raw data: {result['name']}.json. "
             "Every config `prune.candidates` keeps for a launch (per target, family, scheme variant and qweight "
             "layout: the launcher's default, GPTQ, mma16x64, and on AMD mfma16x128, where layout.py holds the "
             "variant; TritonBackend gives an NVIDIA GPU mma16x64 for mfma16x128; the float kernels' fp_dot and "
             "fp8_w8a8 per variant of aot.FP_VARIANTS / FP8_VARIANTS, at M <= 16 and above), "
             "compiled and read as in kernel-isa.md.", "",
             f"**{len(compiled)} configs compiled, {len(spilling)} spill**; "
             f"{sum('error' in r for r in rows)} did not compile, "
             f"{sum('skipped' in r for r in rows)} exceed the target's shared memory (never launched).", "",
             "| target | family | configs | max regs | spilling |", "|---|---|---:|---:|---:|"]
    groups: dict[tuple, list] = {}
    for r in compiled:
        groups.setdefault((r["target"], r["family"]), []).append(r)
    for (target, family), rs in groups.items():
        lines.append(f"| {target} | {family} | {len(rs)} | {max(r['registers'] for r in rs)} "
                     f"| {sum(1 for r in rs if r['spills'])} |")
    if spilling or any("error" in r for r in rows):
        lines += ["", "| target | family | variant | layout | BLOCK M x N x K | warps | regs | spills / error |",
                  "|---|---|---|---|---|---:|---:|---|"]
        for r in rows:
            if r.get("spills") or "error" in r:
                lines.append(f"| {r['target']} | {r['family']} | {r['variant']} | {LAYOUT_NAMES[r['layout']]} "
                             f"| {' x '.join(str(b) for b in r['block'])} | {r['num_warps']} "
                             f"| {r.get('registers', '-')} | {r.get('spills', r.get('error'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from kernel_isa import save

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="sm90,gfx942")
    p.add_argument("--families", default="gemv,gemv_preshuffled,small_m,large_m,fp_dot,fp8_w8a8")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    p.add_argument("--name", default="kernel-spills")
    args = p.parse_args(argv)
    rows = []
    for case in cases(args.targets.split(","), args.families.split(",")):
        rows.append(compile_row(*case))
        print(json.dumps(rows[-1]), flush=True)
    save("kernel_spills.py", rows, argv, args.out, args.name, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
