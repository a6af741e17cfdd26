"""Kernel micro-benchmark: quantized linear vs the dense fp16/bf16 matmul vs the reference.

    python benchmarks/kernels.py --device cuda [--smoke] [--dtype fp16|bf16] [--no-autotune]
    python benchmarks/kernels.py --device cpu [args for kernels_cpu.py]   (delegates)
    python benchmarks/kernels.py --dry-run     (the whole structure on CPU, tiny shapes; with
                                                TRITON_INTERPRET=1 our kernels run interpreted)

For each scheme, M (tokens) and N x K (a Llama-3-8B/70B projection): median microseconds
(triton.testing.do_bench after warm-up, L2 flushed), TFLOP/s, effective GB/s (weights +
scales + zeros + activations + output, each moved once), % of the GPU's peak bandwidth and the
speed-up over the dense matmul. Writes benchmarks/results/kernels-<gpu>.{json,md}.

Structure: ``cases`` (the shape list), ``time_us`` (timing), ``measure`` (one row),
``markdown``/``print_table`` (the table) and one ``run_<device>`` per device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from quantspec.quant.scheme import QuantResult, QuantScheme  # noqa: E402

M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NK_LIST = ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672))
SMOKE_M, SMOKE_NK = (1, 16, 128), ((4096, 4096), (14336, 4096))
DRY_M, DRY_NK = (1, 17), ((48, 256),)
SCHEMES = {  # name -> (scheme, act-order strategy of the Triton backend)
    "w4g128": (QuantScheme(4, 128, True), "permute"),
    "w4g128-asym": (QuantScheme(4, 128, False), "permute"),
    "w4g128-actorder-permute": (QuantScheme(4, 128, True, act_order=True), "permute"),
    "w4g128-actorder-gidx": (QuantScheme(4, 128, True, act_order=True), "gidx"),
    "w8a16": (QuantScheme(8, -1, True), "permute"),
    "w8a8": (QuantScheme(8, -1, True, activations="int8-token-dynamic"), "permute"),
}
SMOKE_SCHEMES = ("w4g128", "w4g128-actorder-gidx", "w8a8")
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "MI300X": 5.3e12}


def cases(smoke: bool, dry: bool = False) -> list[tuple[str, int, int, int]]:
    """(scheme name, M, N, K) in run order: scheme, then shape, then M."""
    ms, nks = (DRY_M, DRY_NK) if dry else (SMOKE_M, SMOKE_NK) if smoke else (M_LIST, NK_LIST)
    names = SMOKE_SCHEMES if smoke or dry else tuple(SCHEMES)
    return [(s, m, n, k) for s in names for n, k in nks for m in ms]


def time_us(fn, device: str, reps: int = 50) -> float:
    """Median microseconds of ``fn()``: do_bench on GPUs, perf_counter otherwise."""
    if device == "cuda":
        from triton.testing import do_bench

        return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def peak_bandwidth(gpu_name: str) -> float | None:
    """Bytes/s of the GPU's HBM from its name ("NVIDIA H100 80GB HBM3" -> H100), or None."""
    for key, bw in PEAK_BYTES_PER_S.items():
        if key.lower() in gpu_name.lower():
            return bw
    return None


def random_result(scheme: QuantScheme, n: int, k: int, device: str) -> QuantResult:
    """Random codes and scales of the right shapes (timing does not depend on the values)."""
    g = scheme.num_groups(k)
    q = torch.randint(0, scheme.maxq + 1, (n, k), dtype=torch.uint8, device=device)
    s = (torch.rand(n, g, device=device) * 0.01 + 1e-3).to(torch.float16)
    z = None if scheme.symmetric else torch.randint(0, scheme.maxq + 1, (n, g), dtype=torch.uint8, device=device)
    gi = None
    if scheme.act_order:
        order = torch.randperm(k, device=device)
        gi = torch.empty(k, dtype=torch.int32, device=device)
        gi[order] = (torch.arange(k, device=device) // scheme.group_len(k)).to(torch.int32)
    return QuantResult(q, s, z, gi, scheme)


def moved_bytes(scheme: QuantScheme, m: int, n: int, k: int, act_bytes: int) -> int:
    """Bytes a perfect kernel moves: packed weights, scales (fp16), zeros, x and y."""
    g = scheme.num_groups(k)
    w = n * k * scheme.bits // 8 + g * n * 2 + (0 if scheme.symmetric else g * n)
    return w + m * k * act_bytes + m * n * act_bytes


def measure(name, m, n, k, impls, device, dtype, peak):
    """One row: time each implementation ({label: (fn, bytes)}) and derive the rates."""
    row = {"scheme": name, "M": m, "N": n, "K": k}
    for label, (fn, nbytes) in impls.items():
        us = time_us(fn, device)
        row[f"{label}_us"] = round(us, 2)
        row[f"{label}_tflops"] = round(2 * m * n * k / us / 1e6, 3)
        row[f"{label}_gbps"] = round(nbytes / us / 1e3, 1)
        if peak:
            row[f"{label}_peak_pct"] = round(100 * nbytes / (us * 1e-6) / peak, 1)
    row["speedup_vs_dense"] = round(row["dense_us"] / row["quant_us"], 3)
    return row


def layer_impls(name, m, n, k, device, dtype, triton_kw, with_reference):
    """{label: (callable, bytes moved)} for one case: our kernel, dense matmul, the reference."""
    from quantspec.kernels.reference import ReferenceBackend
    from quantspec.kernels.backend import get_backend

    scheme, strategy = SCHEMES[name]
    r = random_result(scheme, n, k, device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from quantspec.kernels.triton_backend import TritonBackend

        ours = TritonBackend(act_order=strategy, **triton_kw)
    else:  # dry run without the interpreter: the reference stands in
        ours = get_backend("reference")
    p = ours.prepare(r, dtype)
    elt = x.element_size()
    impls = {
        "quant": (lambda: ours.linear(x, p, scheme, n, k, None), moved_bytes(scheme, m, n, k, elt)),
        "dense": (lambda: x @ w.T, n * k * elt + m * k * elt + m * n * elt),
    }
    if with_reference:
        ref = ReferenceBackend()
        rp = ref.prepare(r, dtype)
        impls["reference"] = (lambda: ref.linear(x, rp, scheme, n, k, None), moved_bytes(scheme, m, n, k, elt))
    return impls


COLUMNS = [("scheme", "scheme"), ("M", "M"), ("N", "N"), ("K", "K"), ("quant_us", "ours us"),
           ("dense_us", "dense us"), ("reference_us", "ref us"), ("quant_tflops", "TFLOP/s"),
           ("quant_gbps", "GB/s"), ("quant_peak_pct", "% peak BW"), ("speedup_vs_dense", "x dense")]


def markdown(rows: list[dict], title: str) -> str:
    """A Markdown table of the rows (missing values as '-')."""
    lines = [f"## {title}", "", "| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "-")) for c, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict]) -> None:
    widths = [max(len(h), *(len(str(r.get(c, "-"))) for r in rows)) for c, h in COLUMNS]
    print("  ".join(h.rjust(w) for (_, h), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "-")).rjust(w) for (c, _), w in zip(COLUMNS, widths)))


def write_results(rows: list[dict], meta: dict, out_dir: Path, tag: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"kernels-{tag}.json", out_dir / f"kernels-{tag}.md"
    jpath.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    title = f"Kernels on {meta['device_name']} ({meta['dtype']}, peak {meta['peak_tb_s']} TB/s)"
    mpath.write_text(markdown(rows, title))
    return jpath, mpath


def run_benchmark(args, device: str, device_name: str, dry: bool) -> list[dict]:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    peak = peak_bandwidth(device_name)
    triton_kw = {"autotune": not args.no_autotune}
    rows = []
    for name, m, n, k in cases(args.smoke, dry):
        if args.schemes and name not in args.schemes:
            continue
        impls = layer_impls(name, m, n, k, device, dtype, triton_kw, not args.no_reference)
        rows.append(measure(name, m, n, k, impls, device, dtype, peak))
        print(json.dumps(rows[-1]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    tag = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or device
    meta = {"device_name": device_name, "dtype": args.dtype, "smoke": args.smoke, "dry_run": dry,
            "autotune": not args.no_autotune, "peak_tb_s": None if peak is None else peak / 1e12,
            "torch": torch.__version__}
    out = Path(args.out) if args.out else ROOT / "results"
    print_table(rows)
    for p in write_results(rows, meta, out, ("dry-run-" if dry else "") + tag):
        print(f"wrote {p}")
    return rows


def run_cuda(args) -> list[dict]:
    """Triton backend on the current CUDA/ROCm GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA/ROCm GPU is visible")
    return run_benchmark(args, "cuda", torch.cuda.get_device_name(), dry=False)


def run_cpu(rest: list[str]) -> None:
    """Delegate to benchmarks/kernels_cpu.py with the remaining arguments."""
    path = ROOT / "kernels_cpu.py"
    if not path.is_file():
        raise SystemExit(f"--device cpu delegates to {path}, which does not exist")
    sys.argv = [str(path), *rest]
    runpy.run_path(str(path), run_name="__main__")


def run_dry(args) -> list[dict]:
    """The whole pipeline on CPU with the reference backend standing in, tiny shapes."""
    return run_benchmark(args, "cpu", "cpu", dry=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="a few shapes and schemes, for a quick first run")
    p.add_argument("--dry-run", action="store_true", help="run the structure on CPU, tiny shapes")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--schemes", nargs="*", choices=tuple(SCHEMES), help="only these schemes")
    p.add_argument("--no-autotune", action="store_true", help="first config per target, no tuning")
    p.add_argument("--no-reference", action="store_true", help="skip timing the reference backend")
    p.add_argument("--out", help="results folder (default benchmarks/results)")
    return p.parse_known_args(argv)


def _without_device(argv: list[str]) -> list[str]:
    """argv minus ``--device X`` / ``--device=X``: what kernels_cpu.py receives."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--device":
            skip = True
        elif not a.startswith("--device="):
            out.append(a)
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parse_args(argv)
    if args.dry_run:
        run_dry(args)
    elif args.device == "cpu":
        run_cpu(_without_device(argv))
    else:
        if rest:
            raise SystemExit(f"unknown arguments: {rest}")
        run_cuda(args)


if __name__ == "__main__":
    main()
