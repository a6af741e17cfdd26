"""CPU kernel benchmark: the ``cpu`` backend vs torch's int4 op, dense bf16/fp32 and the reference.

One W4 g128 (symmetric, RTN) linear per shape; for each M every kernel is timed in turn, round
after round (so machine noise hits all of them alike); the median of the rounds is reported,
warm-up excluded. Effective GB/s counts the bytes of the weight tensors each kernel reads.

    python benchmarks/kernels_cpu.py                 # full table, writes benchmarks/results/
    python benchmarks/kernels_cpu.py --quick         # M = 1, 16 on 4096x4096 only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from quantspec.kernels.cpu import CpuBackend, panels_supported, prepare_ext
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.rtn import rtn
from quantspec.quant.scheme import QuantScheme

KERNELS = ("ours", "ours_rows", "torch_int4", "dense_bf16", "dense_fp32", "reference")
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def build_kernels(n: int, k: int, group: int = 128) -> dict[str, tuple[Callable, int]]:
    """name -> (fn(x_bf16) -> y, weight bytes read per call), all for one random W4 layer."""
    torch.manual_seed(0)
    scheme = QuantScheme(bits=4, group_size=group)
    result = rtn(torch.randn(n, k) * 0.02, scheme)
    cpu, ref = CpuBackend(), ReferenceBackend()
    ours = cpu.prepare(result, torch.bfloat16)
    refp = ref.prepare(result, torch.float32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(result.qweight.to(torch.int32), 1)
    s = result.scales.float()
    sz = torch.stack([s, torch.zeros_like(s)], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    w_bf16 = result.dequantize(torch.bfloat16)
    w_fp32 = result.dequantize(torch.float32)
    bound = cpu.bind(ours, scheme, n, k)  # what QuantLinear calls (None: torch's fallback)
    kernels = {
        "ours": ((lambda x: bound(x, ours, None)) if bound is not None
                 else (lambda x: cpu.linear(x, ours, scheme, n, k, None)),
                 nbytes(t for name, t in ours.items() if name in ("w", "scales", "zeros"))),
        "torch_int4": (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz),
                       nbytes([packed, sz])),
        "dense_bf16": (lambda x: x @ w_bf16.T, nbytes([w_bf16])),
        "dense_fp32": (lambda x: (x.float() @ w_fp32.T).to(x.dtype), nbytes([w_fp32])),
        "reference": (lambda x: ref.linear(x, refp, scheme, n, k, None),
                      nbytes([refp["codes"], refp["scales"]])),
    }
    if panels_supported():  # ours is the panel layout here: time the rows layout beside it
        rows = prepare_ext(result, "rows")
        bound_rows = cpu.bind(rows, scheme, n, k)
        kernels["ours_rows"] = (lambda x: bound_rows(x, rows, None),
                                nbytes(rows[name] for name in ("w", "scales", "zeros")))
    return kernels


SLOW = {"reference": 3}  # rounds cap for kernels that take seconds per call


def time_side_by_side(kernels: dict, x: torch.Tensor, rounds: int, warmup: int = 2) -> dict:
    """Median microseconds per kernel; kernels alternate within each round."""
    for name, (fn, _) in kernels.items():
        for _ in range(1 if name in SLOW else warmup):
            fn(x)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for r in range(rounds):
        for name, (fn, _) in kernels.items():
            if r >= SLOW.get(name, rounds):
                continue
            t0 = time.perf_counter()
            fn(x)
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_cpu_benchmark(shapes_ms: list[tuple[int, int, list[int]]], rounds: int = 15,
                      include_reference: bool = True) -> list[dict]:
    """One row per (N, K, M, kernel): us, effective GB/s, speed-up vs dense bf16."""
    rows = []
    for n, k, ms in shapes_ms:
        kernels = build_kernels(n, k)
        if not include_reference:
            kernels.pop("reference")
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            us = time_side_by_side(kernels, x, rounds)
            for name, (_, wbytes) in kernels.items():
                rows.append({
                    "N": n, "K": k, "M": m, "kernel": name, "us": round(us[name], 1),
                    "GB/s": round(wbytes / us[name] / 1e3, 1),
                    "speedup_vs_bf16": round(us["dense_bf16"] / us[name], 2),
                })
            print(f"N={n} K={k} M={m}: " + ", ".join(f"{a} {us[a]:.0f}us" for a in kernels),
                  flush=True)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    names = [k for k in KERNELS if any(r["kernel"] == k for r in rows)]
    lines = [header, "",
             "| N x K | M | " + " | ".join(f"{k} us (GB/s)" for k in names) + " | ours vs bf16 |",
             "|---|---|" + "---|" * (len(names) + 1)]
    keyed = {(r["N"], r["K"], r["M"], r["kernel"]): r for r in rows}
    for n, k, m in dict.fromkeys((r["N"], r["K"], r["M"]) for r in rows):
        cells = [f"{keyed[(n, k, m, c)]['us']:.0f} ({keyed[(n, k, m, c)]['GB/s']})" for c in names]
        lines.append(f"| {n}x{k} | {m} | " + " | ".join(cells)
                     + f" | {keyed[(n, k, m, 'ours')]['speedup_vs_bf16']}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M = 1, 16 on 4096x4096 only")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        plan = [(4096, 4096, [1, 16])]
    else:
        plan = [(4096, 4096, [1, 2, 4, 8, 16, 32, 128]), (14336, 4096, [1, 2, 4]),
                (4096, 14336, [1, 2, 4])]
    rows = run_cpu_benchmark(plan, args.rounds, args.reference)
    meta = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "scheme": "w4g128 sym (RTN)", "activations": "bf16", "rounds": args.rounds,
            "statistic": "median us, warm-up excluded", "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "cpu-kernels" + (f"-{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    header = (f"# CPU kernels: {meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, "
              f"{meta['scheme']}, bf16 activations, median of {args.rounds} ({meta['date']})")
    text = markdown(rows, header)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
