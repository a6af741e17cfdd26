"""CPU kernel benchmark: the ``cpu`` backend vs torch's int4 op, dense bf16/fp32 and the reference.

One W4 g128 (symmetric, RTN) linear per shape; for each M every kernel is timed in turn, round
after round (so machine noise hits all of them alike); the median of the rounds is reported,
warm-up excluded. Effective GB/s counts the bytes of the weight tensors each kernel reads.

``read`` is the floor for a memory-bound product: one plain pass over a buffer as large as the
``ours`` weights (a small C++ loop, built on first use), timed in the same rotation, so it sees
the same cache state. ``ours vs read`` = read time / ours time (1.0 = at the machine's read
bandwidth). With ``--cold`` every kernel cycles through copies of its weights twice the size of
the last-level cache, so each call streams its weights from DRAM while the code and small data
stay cached (the state of decoding a model larger than the cache); without it, the weights of
this one layer partly stay in a large L3 between rounds.

    python benchmarks/kernels_cpu.py                 # full table, writes benchmarks/results/
    python benchmarks/kernels_cpu.py --quick         # M = 1, 16 on 4096x4096 only
    python benchmarks/kernels_cpu.py --quick --cold  # the same from DRAM
    python benchmarks/kernels_cpu.py --quick --scheme nvfp4   # FP8 / FP4 weights (fp8-weight, nvfp4, mxfp4)

Float schemes (issue 30's targets: at M = 1 on 4096x4096, FP8 >= 2x and FP4 >= 3x dense bf16):
``ours`` is ``quantspec_cpu::fgemm`` (csrc/cpu_fgemv.cpp) with unquantized activations; torch
has no FP4 / FP8 CPU op to put beside it.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from quantspec.kernels.cpu import CpuBackend, panels_supported, prepare_ext
from quantspec.kernels.cpu_ext import build_lock, compile_flags
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.rtn import rtn
from quantspec.models.paths import cache_root
from quantspec.core.scheme import SCHEME_PRESETS, QuantScheme
from quantspec.sizes import tensors_bytes

KERNELS = ("ours", "ours_fp32_x", "read", "ours_rows", "torch_int4", "dense_bf16", "dense_fp32", "reference")

READ_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
// Every byte of t read once, the threads taking contiguous shares as the kernels do; 16 KB
// prefetched ahead into L2. Returns a checksum so that the loop is kept.
int64_t stream_read(const torch::Tensor& t) {
  const uint64_t* p = reinterpret_cast<const uint64_t*>(t.data_ptr());
  const int64_t lines = t.numel() * t.element_size() / 64;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, lines, 512, [&](int64_t a, int64_t b) {
    uint64_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = a; i < b; ++i) {
      __builtin_prefetch(p + 8 * (i + 256), 0, 2);
      for (int k = 0; k < 8; ++k) s[k] += p[8 * i + k];
    }
    uint64_t sum = 0;
    for (int k = 0; k < 8; ++k) sum += s[k];
    total += sum;
  });
  return static_cast<int64_t>(total.load());
}
"""
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


@functools.cache
def stream_read() -> Callable[[torch.Tensor], int] | None:
    """The plain read loop of READ_SOURCE, built once (cached beside the cpu extension); None,
    with a message, where it cannot be built (no compiler): the table then has no read column."""
    from torch.utils import cpp_extension

    build = cache_root() / "ext" / "bench_stream_read"
    try:
        with build_lock(build):
            module = cpp_extension.load_inline(
                "quantspec_bench_stream_read", cpp_sources=READ_SOURCE, functions=["stream_read"],
                extra_cflags=compile_flags(), extra_ldflags=["-fopenmp"], build_directory=str(build))
    except Exception as exc:  # noqa: BLE001 - any build failure only drops the column
        print(f"no read floor: building its loop failed ({type(exc).__name__}: {exc})")
        return None
    return module.stream_read


def llc_bytes() -> int:
    """The last-level cache size from sysfs (64 MiB when it cannot be read)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=64 << 20)


def _clone(weights):
    if isinstance(weights, dict):
        return {name: t.clone() for name, t in weights.items()}
    return tuple(t.clone() for t in weights)


def rotating(fn: Callable, weights, wbytes: int, cold_bytes: int) -> tuple[Callable, int]:
    """(x -> fn(x, weights), wbytes); with ``cold_bytes``, enough copies of the weights to fill
    that many bytes, used in turn, so that each call reads weights no recent call has touched."""
    copies = [weights] + [_clone(weights) for _ in range(math.ceil(cold_bytes / wbytes) - 1)]
    turn = itertools.cycle(copies)
    return (lambda x: fn(x, next(turn))), wbytes


def build_float_kernels(n: int, k: int, scheme: QuantScheme, cold_bytes: int = 0) -> dict[str, tuple[Callable, int]]:
    """As ``build_kernels`` for a float weight-only scheme: ours (fgemm), dense, reference, read."""
    torch.manual_seed(0)
    result = rtn(torch.randn(n, k) * 0.02, scheme)
    cpu, ref = CpuBackend(), ReferenceBackend()
    ours = cpu.prepare(result, torch.bfloat16)
    refp = ref.prepare(result, torch.float32)
    w_bf16, w_fp32 = result.dequantize(torch.bfloat16), result.dequantize(torch.float32)
    ours_bytes = tensors_bytes([ours["fcodes"], ours["fscales"]])
    kernels = {
        "ours": rotating(lambda x, p: cpu.linear(x, p, scheme, n, k, None), ours, ours_bytes, cold_bytes),
        # the same op on x widened to fp32: its path before the AVX-512 BF16 one (and on CPUs without it)
        "ours_fp32_x": rotating(lambda x, p: cpu.linear(x.float(), p, scheme, n, k, None), ours, ours_bytes, cold_bytes),
        "dense_bf16": rotating(lambda x, w: x @ w[0].T, (w_bf16,), tensors_bytes([w_bf16]), cold_bytes),
        "dense_fp32": rotating(lambda x, w: (x.float() @ w[0].T).to(x.dtype), (w_fp32,),
                               tensors_bytes([w_fp32]), cold_bytes),
        "reference": (lambda x: ref.linear(x, refp, scheme, n, k, None),
                      tensors_bytes([refp["codes"], refp["scales"]])),
    }
    read = stream_read()
    if read is not None:
        kernels["read"] = rotating(lambda x, b: read(b[0]), (torch.ones(ours_bytes, dtype=torch.uint8),),
                                   ours_bytes, cold_bytes)
    return kernels


def build_kernels(n: int, k: int, group: int = 128,
                  cold_bytes: int = 0, scheme: QuantScheme | None = None) -> dict[str, tuple[Callable, int]]:
    """name -> (fn(x_bf16) -> y, weight bytes read per call), all for one random W4 layer;
    ``cold_bytes``: see ``rotating`` (the reference keeps one copy)."""
    if scheme is not None and scheme.is_float:
        return build_float_kernels(n, k, scheme, cold_bytes)
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
    ours_fn = ((lambda x, p: bound(x, p, None)) if bound is not None
               else (lambda x, p: cpu.linear(x, p, scheme, n, k, None)))
    ours_bytes = tensors_bytes(t for name, t in ours.items() if name in ("w", "scales", "zeros"))
    read = stream_read()
    kernels = {
        "ours": rotating(ours_fn, ours, ours_bytes, cold_bytes),
        "torch_int4": rotating(
            lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], group, w[1]),
            (packed, sz), tensors_bytes([packed, sz]), cold_bytes),
        "dense_bf16": rotating(lambda x, w: x @ w[0].T, (w_bf16,), tensors_bytes([w_bf16]), cold_bytes),
        "dense_fp32": rotating(lambda x, w: (x.float() @ w[0].T).to(x.dtype), (w_fp32,),
                               tensors_bytes([w_fp32]), cold_bytes),
        "reference": (lambda x: ref.linear(x, refp, scheme, n, k, None),
                      tensors_bytes([refp["codes"], refp["scales"]])),
    }
    if read is not None:  # its own buffer of the same size: the same cache state as ours
        kernels["read"] = rotating(lambda x, b: read(b[0]),
                                   (torch.ones(ours_bytes, dtype=torch.uint8),), ours_bytes,
                                   cold_bytes)
    if panels_supported():  # ours is the panel layout here: time the rows layout beside it
        rows = prepare_ext(result, "rows")
        bound_rows = cpu.bind(rows, scheme, n, k)
        kernels["ours_rows"] = rotating(lambda x, p: bound_rows(x, p, None), rows,
                                        tensors_bytes(rows[name] for name in ("w", "scales", "zeros")),
                                        cold_bytes)
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
                      include_reference: bool = True, cold: bool = False,
                      scheme: QuantScheme | None = None) -> list[dict]:
    """One row per (N, K, M, kernel): us, effective GB/s, speed-up vs dense bf16 and vs the faster
    of dense bf16 and dense fp32 on this machine (measured in the same rotation); ``cold``:
    each kernel cycles through copies of its weights twice the size of the last-level cache."""
    rows = []
    for n, k, ms in shapes_ms:
        kernels = build_kernels(n, k, cold_bytes=2 * llc_bytes() if cold else 0, scheme=scheme)
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
                    "speedup_vs_best_dense": round(min(us["dense_bf16"], us["dense_fp32"]) / us[name], 2),
                    "vs_read": round(us["read"] / us[name], 2) if "read" in us else None,
                })
            print(f"N={n} K={k} M={m}: " + ", ".join(f"{a} {us[a]:.0f}us" for a in kernels),
                  flush=True)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    """The table of one run; the speed-ups are derived from that run's own rows (so a table
    re-rendered from an older JSON gains the same columns, from the same measurements)."""
    names = [k for k in KERNELS if any(r["kernel"] == k for r in rows)]
    lines = [header, "",
             "| N x K | M | " + " | ".join(f"{k} us (GB/s)" for k in names)
             + " | ours vs bf16 | ours vs best dense | ours vs read |",
             "|---|---|" + "---|" * (len(names) + 3)]
    keyed = {(r["N"], r["K"], r["M"], r["kernel"]): r for r in rows}
    for n, k, m in dict.fromkeys((r["N"], r["K"], r["M"]) for r in rows):
        us = {c: keyed[(n, k, m, c)]["us"] for c in names}
        cells = [f"{us[c]:.0f} ({keyed[(n, k, m, c)]['GB/s']})" for c in names]
        best_dense = min(us[c] for c in ("dense_bf16", "dense_fp32") if c in us)
        read = f"{us['read'] / us['ours']:.2f}" if "read" in us else "-"
        lines.append(f"| {n}x{k} | {m} | " + " | ".join(cells)
                     + f" | {us['dense_bf16'] / us['ours']:.2f}x | {best_dense / us['ours']:.2f}x | {read} |")
    return "\n".join(lines) + "\n"


def header_of(meta: dict) -> str:
    return (f"# CPU kernels: {meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, "
            f"{meta['scheme']}, bf16 activations, median of {meta['rounds']}, caches "
            f"{meta['caches']} ({meta['date']})\n\n"
            f"Command: `{meta.get('command', 'python benchmarks/kernels_cpu.py (flags not recorded)')}`; "
            "raw data: the JSON of the same name. \"best dense\" is the faster of dense bf16 and "
            "dense fp32 for that shape, timed in the same rotation.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M = 1, 16 on 4096x4096 only")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cold", action="store_true",
                        help="weights from DRAM: each kernel cycles through copies of its "
                        "weights twice the size of the last-level cache")
    parser.add_argument("--scheme", default="w4g128", choices=["w4g128", *SCHEME_PRESETS],
                        help="the weight scheme of the layer (float presets: weight-only ones run here)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: re-render the Markdown table of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        text = markdown(data["rows"], header_of(data["meta"]))
        args.from_json.with_suffix(".md").write_text(text)
        print(text)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        plan = [(4096, 4096, [1, 16])]
    else:
        plan = [(4096, 4096, [1, 2, 4, 8, 16, 32, 128]), (14336, 4096, [1, 2, 4]),
                (4096, 14336, [1, 2, 4])]
    scheme = None if args.scheme == "w4g128" else SCHEME_PRESETS[args.scheme]
    rows = run_cpu_benchmark(plan, args.rounds, args.reference, args.cold, scheme)
    meta = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "scheme": "w4g128 sym (RTN)" if scheme is None else f"{args.scheme} (RTN)", "activations": "bf16", "rounds": args.rounds,
            "statistic": "median us, warm-up excluded", "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python benchmarks/kernels_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "caches": f"cold (weights cycled through {2 * llc_bytes() >> 20} MiB of copies)"
            if args.cold else "as left by the previous round"}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "cpu-kernels" + ("" if scheme is None else f"-{args.scheme}") + (f"-{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    header = header_of(meta)
    text = markdown(rows, header)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
