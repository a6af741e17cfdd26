"""Kernel micro-benchmark: quantized linear vs the dense fp16/bf16 matmul vs the reference.

    python benchmarks/kernel_speed.py --device cuda [--smoke] [--dtype fp16|bf16] [--no-autotune]
                                 [--prewarm 16] [--deadline S] [--schemes ...] [--m ...]
    python benchmarks/kernel_speed.py --device cpu [args for kernels_cpu.py]   (delegates)
    python benchmarks/kernel_speed.py --dry-run     (the whole structure on CPU, tiny shapes; with
                                                TRITON_INTERPRET=1 our kernels run interpreted)

For each scheme, M (tokens) and N x K (a Llama-3-8B/70B projection): median microseconds
(triton.testing.do_bench after warm-up, L2 flushed: includes the Python launch cost) and, on
GPUs, inside a CUDA graph cycling through weight copies larger than L2 (no launch cost, as
serving engines run decode), TFLOP/s, effective GB/s (weights +
scales + zeros + activations + output, each moved once), % of the GPU's peak bandwidth, the
speed-up over the dense matmul, the ratio to a read-only kernel that streams the same bytes
(the floor), the config the autotuner chose, and (``--peers``) the peer backends that run the
case. Writes benchmarks/results/kernels-<gpu>.{json,md}.

Structure: ``cases`` (the shape list), ``time_us`` (timing), ``measure`` (one row),
``markdown``/``print_table`` (the table) and one ``run_<device>`` per device.
"""

from __future__ import annotations

import argparse
import functools
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

from quantspec.core.scheme import QuantResult, QuantScheme  # noqa: E402

M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NK_LIST = ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672))
SMOKE_M, SMOKE_NK = (1, 16, 128), ((4096, 4096), (14336, 4096))
DRY_M, DRY_NK = (1, 17), ((48, 256),)
SCHEMES = {  # name -> (scheme, act-order strategy of the Triton backend)
    "w4g128": (QuantScheme(4, 128, True), "permute"),
    "w4g128-asym": (QuantScheme(4, 128, False), "permute"),
    "w4g128-actorder-permute": (QuantScheme(4, 128, True, act_order=True), "permute"),
    "w4g128-actorder-gidx": (QuantScheme(4, 128, True, act_order=True), "gidx"),
    "w4g32": (QuantScheme(4, 32, True), "permute"),
    "w8a16": (QuantScheme(8, -1, True), "permute"),
    "w8a8": (QuantScheme(8, -1, True, activations="int8-token-dynamic"), "permute"),
}
SMOKE_SCHEMES = ("w4g128", "w4g128-actorder-gidx", "w8a8")
ROTATE_BYTES = 256 << 20  # graph timing cycles through weight copies of at least this much (> L2)
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "MI300X": 5.3e12}


def cases(smoke: bool, dry: bool = False) -> list[tuple[str, int, int, int]]:
    """(scheme name, M, N, K) in run order: scheme, then shape, then M."""
    ms, nks = (DRY_M, DRY_NK) if dry else (SMOKE_M, SMOKE_NK) if smoke else (M_LIST, NK_LIST)
    names = SMOKE_SCHEMES if smoke or dry else tuple(SCHEMES)
    return [(s, m, n, k) for s in names for n, k in nks for m in ms]


def time_us(fn, device: str, reps: int = 50) -> float:
    """Median microseconds of ``fn()``: do_bench on GPUs (L2 flushed before each call),
    perf_counter otherwise."""
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


def time_graph_us(fns: list, replays: int = 10) -> float:
    """Median microseconds per call inside a CUDA graph (as serving engines run decode), with
    no launch overhead. The graph calls ``fns`` in turn (each on its own copy of the weights,
    together larger than L2), so weights come from HBM as in a model's forward."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (autotuning) outside the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    calls = len(fns) * max(1, 24 // len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


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


def measure(name, m, n, k, impls, device, peak, graph=False):
    """One row: time each implementation ({label: (fns, bytes)}; fns[0] for eager timing, all
    of them in turn for graph timing) and derive the rates."""
    row = {"scheme": name, "M": m, "N": n, "K": k}
    for label, (fns, nbytes) in impls.items():
        timings = [("", time_us(fns[0], device))]
        if graph and label != "reference":
            timings.append(("_graph", time_graph_us(fns)))
        for suffix, us in timings:
            row[f"{label}{suffix}_us"] = round(us, 2)
            row[f"{label}{suffix}_tflops"] = round(2 * m * n * k / us / 1e6, 3)
            row[f"{label}{suffix}_gbps"] = round(nbytes / us / 1e3, 1)
            if peak:
                row[f"{label}{suffix}_peak_pct"] = round(100 * nbytes / (us * 1e-6) / peak, 1)
    row["speedup_vs_dense"] = round(row["dense_us"] / row["quant_us"], 3)
    if graph:
        row["speedup_graph"] = round(row["dense_graph_us"] / row["quant_graph_us"], 3)
    for suffix in ("", "_graph"):  # ours against the read floor of the same bytes (1.0: at the floor)
        if f"read{suffix}_us" in row:
            row[f"vs_read{suffix}"] = round(row[f"quant{suffix}_us"] / row[f"read{suffix}_us"], 3)
    return row


PEERS = ("marlin", "gemlite", "tinygemm")  # the peer backends timed by --peers, where they run


def peer_reasons(scheme: QuantScheme, n: int, k: int, device: str, dtype) -> dict[str, str | None]:
    """Each peer backend and why it cannot run this case here (None: it can)."""
    from quantspec.kernels.backend import get_backend

    return {p: get_backend(p).cannot_run(scheme, n, k, torch.device(device), dtype) for p in PEERS}


@functools.cache  # one kernel object, so it compiles once, not once per case
def read_floor_fn():
    """A Triton kernel that only reads a buffer (16 KB per program, one int32 sum written per
    program): the time to stream the bytes a quantized layer moves, the floor of its kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(src, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + tl.program_id(0), tl.sum(tl.load(src + offs, mask=offs < n, other=0), axis=0))

    def read(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        _read_kernel[(triton.cdiv(buf.numel(), 4096),)](buf, out, buf.numel(), BLOCK=4096)
        return out

    return read


def layer_impls(name, m, n, k, device, dtype, triton_kw, with_reference, copies=1, peers=None):
    """{label: ([callable per weight copy], bytes moved)} for one case: our kernel, the dense
    matmul, the reference, and every peer backend ``peers`` (``peer_reasons``) says can run it.
    ``copies`` 0: as many as make ROTATE_BYTES (graph timing)."""
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
    elt = x.element_size()
    qbytes, dbytes = moved_bytes(scheme, m, n, k, elt), n * k * elt + m * k * elt + m * n * elt
    qcopies = copies or max(1, min(32, -(-ROTATE_BYTES // qbytes)))
    dcopies = copies or max(1, min(32, -(-ROTATE_BYTES // dbytes)))
    preps = [ours.prepare(r, dtype) for _ in range(qcopies)]
    ws = [w] + [w.clone() for _ in range(dcopies - 1)]
    impls = {
        "quant": ([lambda p=p: ours.linear(x, p, scheme, n, k, None) for p in preps], qbytes),
        "dense": ([lambda w_=w_: x @ w_.T for w_ in ws], dbytes),
    }
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # the read floor of the same bytes
        read = read_floor_fn()
        words = -(-qbytes // 4)
        bufs = [torch.zeros(words, dtype=torch.int32, device=device) for _ in range(qcopies)]
        out = torch.empty(-(-words // 4096), dtype=torch.int32, device=device)
        impls["read"] = ([lambda b=b: read(b, out) for b in bufs], qbytes)
    for peer, why in (peers or {}).items():
        if why is None:
            b = get_backend(peer)
            pp = [b.prepare(r, dtype) for _ in range(qcopies)]
            impls[peer] = ([lambda p=p, b=b: b.linear(x, p, scheme, n, k, None) for p in pp], qbytes)
    if with_reference:
        ref = ReferenceBackend()
        rp = ref.prepare(r, dtype)
        impls["reference"] = ([lambda: ref.linear(x, rp, scheme, n, k, None)], qbytes)
    return impls


COLUMNS = [("scheme", "scheme"), ("M", "M"), ("N", "N"), ("K", "K"), ("quant_us", "ours us"),
           ("dense_us", "dense us"), ("reference_us", "ref us"), ("quant_tflops", "TFLOP/s"),
           ("quant_gbps", "GB/s"), ("quant_peak_pct", "% peak BW"), ("speedup_vs_dense", "x dense"),
           ("quant_graph_us", "ours graph us"), ("dense_graph_us", "dense graph us"),
           ("quant_graph_peak_pct", "graph % peak BW"), ("speedup_graph", "graph x dense"),
           ("rel_err_vs_ref", "rel err"), ("read_us", "read floor us"), ("vs_read", "ours / read floor"),
           ("read_graph_us", "read floor graph us"),
           ("vs_read_graph", "ours / read floor (graph)"), ("config", "chosen config")]
PEER_COLUMNS = [col for p in PEERS for col in ((f"{p}_us", f"{p} us"), (f"{p}_graph_us", f"{p} graph us"),
                                               (f"vs_{p}", f"{p} / ours"), (f"{p}_rel_err_vs_ref", f"{p} rel err"))]


def markdown(rows: list[dict], title: str) -> str:
    """A Markdown table of the rows (missing values as '-'; a peer's columns where it ran)."""
    cols = COLUMNS + [c for c in PEER_COLUMNS if any(c[0] in r for r in rows)]
    lines = [f"## {title}", "", "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "-")) for c, _ in cols) + " |")
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


def _set_swap_large_m(on: bool) -> None:
    """--swap-large-m: the tiled path's SWAP_AB, which the launcher keeps off until timed
    (``wq_gemm.SWAP_AB_LARGE_M_BACKENDS``)."""
    from quantspec.kernels.triton import wq_gemm

    wq_gemm.SWAP_AB_LARGE_M_BACKENDS = frozenset({"cuda", "hip"}) if on else frozenset()


def _set_asm(on: bool) -> None:
    """--asm: the inline-asm pair operations the launcher keeps off until timed (the GEMV's
    ``wq_gemm.ASM_PAIR_OPS``, M <= 2; the tl.dot kernel's ``ASM_DOT_PAIR_OPS``, M > 2)."""
    from quantspec.kernels.triton import wq_gemm

    wq_gemm.ASM_PAIR_OPS = wq_gemm.ASM_DOT_PAIR_OPS = on


def _prewarm_worker(job) -> int:
    """Run each case's kernel once (autotuning: every config compiled into Triton's disk cache)."""
    todo, dtype, triton_kw, asm, swap = job
    _set_asm(asm)
    _set_swap_large_m(swap)
    for name, m, n, k in todo:
        impls = layer_impls(name, m, n, k, "cuda", dtype, triton_kw, False, copies=1)
        impls["quant"][0][0]()
    torch.cuda.synchronize()
    return len(todo)


def prewarm(todo: list, workers: int, dtype, triton_kw, asm: bool = False, swap: bool = False) -> None:
    """Compile in ``workers`` processes first, so that the timed run's autotuning loads every
    kernel from the disk cache instead of compiling one config after another. The workers'
    own tuning choices are thrown away (they ran side by side on one GPU)."""
    import multiprocessing

    jobs = [(todo[i::workers], dtype, triton_kw, asm, swap) for i in range(workers) if todo[i::workers]]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        pool.map(_prewarm_worker, jobs)


def run_benchmark(args, device: str, device_name: str, dry: bool) -> list[dict]:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    peak = peak_bandwidth(device_name)
    triton_kw = {"autotune": not args.no_autotune, "weight_layout": args.weight_layout}
    todo = [c for c in cases(args.smoke, dry) if not args.schemes or c[0] in args.schemes]
    todo = [c for c in todo if not args.m or c[1] in args.m]
    todo = [c for c in todo if not args.nk or f"{c[2]}x{c[3]}" in args.nk]
    graph = device == "cuda" and not args.no_graph
    started = time.monotonic()
    if device == "cuda" and args.asm:
        _set_asm(True)
    if device == "cuda" and args.swap_large_m:
        _set_swap_large_m(True)
    if device == "cuda" and args.prewarm > 1:
        prewarm(todo, args.prewarm, dtype, triton_kw, args.asm, args.swap_large_m)
        print(f"prewarm: {len(todo)} cases compiled in {time.monotonic() - started:.0f} s", flush=True)
    rows = []
    for name, m, n, k in todo:
        if args.deadline and time.monotonic() - started > args.deadline:
            print(f"deadline of {args.deadline} s reached: {len(todo) - len(rows)} cases not run", flush=True)
            break
        reasons = peer_reasons(SCHEMES[name][0], n, k, device, dtype) if args.peers else None
        impls = layer_impls(name, m, n, k, device, dtype, triton_kw, not args.no_reference,
                            copies=0 if graph else 1, peers=reasons)
        before = _chosen_configs()
        rows.append(measure(name, m, n, k, impls, device, peak, graph))
        chosen = {key: cfg for key, cfg in _chosen_configs().items() if key not in before}
        rows[-1]["config"] = "; ".join(f"{key.split()[0]}: {cfg}" for key, cfg in chosen.items()) or "-"
        if "reference" in impls:  # each timed kernel's output against the reference's
            y_ref = impls["reference"][0][0]().float()
            for label in ("quant", *PEERS):
                if label in impls:
                    y = impls[label][0][0]().float()
                    key = "rel_err_vs_ref" if label == "quant" else f"{label}_rel_err_vs_ref"
                    rows[-1][key] = float(f"{((y - y_ref).abs().max() / y_ref.abs().max()).item():.3g}")
        if args.peers:
            rows[-1]["peers_cannot_run"] = {p: w for p, w in reasons.items() if w}
            for p in PEERS:
                if f"{p}_us" in rows[-1]:
                    rows[-1][f"vs_{p}"] = round(rows[-1][f"{p}_us"] / rows[-1]["quant_us"], 3)
        print(json.dumps(rows[-1]), flush=True)
        del impls
        if device == "cuda":
            torch.cuda.empty_cache()
    tag = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or device
    meta = {"device_name": device_name, "dtype": args.dtype, "smoke": args.smoke, "dry_run": dry,
            "autotune": not args.no_autotune, "peak_tb_s": None if peak is None else peak / 1e12,
            "torch": torch.__version__, "triton": _triton_version(), "graph_timing": graph,
            "asm": args.asm, "swap_large_m": args.swap_large_m, "peers": args.peers,
            "cases_planned": len(todo), "seconds": round(time.monotonic() - started, 1)}
    out = Path(args.out) if args.out else ROOT / "results"
    print_table(rows)
    for p in write_results(rows, meta, out, ("dry-run-" if dry else "") + tag + args.tag):
        print(f"wrote {p}")
    return rows


def _chosen_configs() -> dict[str, str]:
    """The autotuners' choices so far (empty without Triton or under the interpreter)."""
    try:
        from quantspec.kernels.triton.configs import chosen_configs
    except ImportError:
        return {}
    return chosen_configs()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


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
    p.add_argument("--weight-layout", default="auto", choices=("auto", "gptq", "mma16x64", "mfma16x128"),
                   help="the Triton backend's qweight layout (docs/decisions/preshuffled-layout.md)")
    p.add_argument("--asm", action="store_true",
                   help="the Triton kernels' inline-asm pair operations (GEMV and tl.dot; off by default)")
    p.add_argument("--swap-large-m", action="store_true",
                   help="the tiled (M > 32) tl.dot path with SWAP_AB, the weight wgmma's register operand (off by default)")
    p.add_argument("--peers", action="store_true",
                   help=f"also time the peer backends that can run each case ({', '.join(PEERS)}), with their errors")
    p.add_argument("--out", help="results folder (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--m", type=int, nargs="*", help="only these M")
    p.add_argument("--nk", nargs="*", metavar="NxK", help="only these layer shapes, e.g. 4096x4096")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing")
    p.add_argument("--prewarm", type=int, default=0, metavar="N",
                   help="compile every case's kernels in N processes before timing")
    p.add_argument("--deadline", type=float, default=0, metavar="S",
                   help="stop starting new cases after S seconds and write what was measured")
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
