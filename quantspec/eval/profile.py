"""Profile one prefill and N decode steps with torch.profiler: where the time goes, and how close
each GEMM comes to the machine's roofline.

Outputs (``profile_to_folder``): trace.json (Chrome trace, open in chrome://tracing or Perfetto),
summary.json and summary.md with

* time by operator class (self time, so nothing is counted twice): dequant-GEMM (ops under a
  QuantLinear, ``quantspec::`` ops, ``_weight_int4pack_mm*``, ``_weight_int8pack_mm``, Triton
  kernels), GEMM (aten::mm/addmm/bmm/...), attention (SDPA and friends), norms+elementwise,
  sampling (the argmax after each step), other;
* per GEMM-like op and input shape: FLOPs, bytes moved (every tensor input once + the output),
  achieved GB/s and FLOP/s, arithmetic intensity, memory- or compute-bound against the roofline
  (ridge = peak FLOP/s / peak GB/s) and % of the binding peak;
* serving terms measured without the profiler: TTFT, TPOT and decode tokens/s.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..checkpoint.atomic import atomic_write_text
from ..errors import QuantspecError
from .machine import describe_machine

CLASSES = ("dequant-GEMM", "GEMM", "attention", "norms+elementwise", "sampling", "other")
SCOPE_QLINEAR = "quantspec::quant_linear"
SCOPE_SAMPLING = "quantspec::sampling"

_DEQUANT_NAMES = ("_weight_int4pack_mm", "_weight_int8pack_mm", "triton", "quantspec::", "marlin", "gemv_int")
_GEMM_NAMES = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
               "aten::_int_mm", "gemm", "cublas", "cutlass", "sm80_xmma", "sm90_xmma")
_ATTN_NAMES = ("scaled_dot_product", "flash", "attention", "fmha", "efficient_attention")
_SAMPLING_NAMES = ("argmax", "softmax", "topk", "multinomial", "sort", "cumsum")
_ELEMENTWISE_NAMES = ("norm", "mul", "add", "sub", "div", "pow", "rsqrt", "mean", "silu", "gelu", "exp",
                      "neg", "cat", "sigmoid", "tanh", "embedding", "copy_", "to", "_to_copy", "where",
                      "elementwise", "vectorized", "reduce", "index", "cos", "sin")
_LEAF_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm",
               "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm", "aten::_weight_int4pack_mm_for_cpu",
               "aten::_weight_int4pack_mm_with_scales_and_zeros")

_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "signed char": 1,
                "unsigned char": 1, "int": 4, "long int": 8, "bool": 1, "short int": 2,
                "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}

# Dense peak (GB/s, FLOP/s at 16-bit) of known GPUs, from the vendors' data sheets.
KNOWN_GPUS = {
    "H200": (4800.0, 989e12), "H100 SXM": (3350.0, 989e12), "H100 PCIe": (2000.0, 756e12),
    "H100": (3350.0, 989e12), "A100-SXM4-80GB": (2039.0, 312e12), "A100": (1555.0, 312e12),
    "L40S": (864.0, 362e12), "L4": (300.0, 121e12), "A10G": (600.0, 70e12), "A10": (600.0, 125e12),
    "RTX 4090": (1008.0, 165e12), "RTX 3090": (936.0, 71e12), "T4": (320.0, 65e12),
    "MI300X": (5300.0, 1307e12), "MI250X": (3277.0, 383e12), "V100": (900.0, 125e12),
}


@dataclass(frozen=True)
class ProfileConfig:
    prompt_length: int = 128
    decode_steps: int = 16
    batch_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_length", "decode_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise QuantspecError(f"{name}={getattr(self, name)} is not positive.",
                                     f"use --{name.replace('_', '-')} 1 or more.")


def classify(name: str, scopes: tuple[str, ...] = ()) -> str:
    """The operator class of an op named ``name`` whose enclosing ops/scopes are ``scopes``."""
    if SCOPE_SAMPLING in scopes or name == SCOPE_SAMPLING:
        return "sampling"
    if name.startswith("quantspec::") and name != SCOPE_QLINEAR:
        return "other"  # phase markers: their self time is Python/framework overhead
    if SCOPE_QLINEAR in scopes or any(k in name for k in _DEQUANT_NAMES):
        return "dequant-GEMM"
    low = name.lower()
    if any(k in low for k in _ATTN_NAMES) or any(any(k in s.lower() for k in _ATTN_NAMES) for s in scopes):
        return "attention"
    if any(name == k or k in low for k in _GEMM_NAMES):
        return "GEMM"
    if any(k in low for k in _SAMPLING_NAMES) and "softmax" not in low:
        return "sampling"
    if "softmax" in low:  # softmax inside the model is attention (eager implementations)
        return "attention"
    if any(k in low.removeprefix("aten::") for k in _ELEMENTWISE_NAMES):
        return "norms+elementwise"
    return "other"


def _numel(shape: list[int]) -> int:
    return math.prod(shape) if shape else 1


def gemm_cost(name: str, shapes: list[list[int]], dtypes: list[str]) -> tuple[float, float] | None:
    """(FLOPs, bytes moved) of a leaf GEMM-like op from its input shapes and dtypes.

    Bytes: every tensor input read once plus the output written once (an ideal kernel).
    """
    tensors = [(s, d) for s, d in zip(shapes, dtypes) if d in _DTYPE_BYTES and s]
    if name in ("aten::addmm", "aten::baddbmm"):
        tensors_mm = tensors[1:3]
    else:
        tensors_mm = tensors[:2]
    if len(tensors_mm) < 2:
        return None
    (xs, xd), (ws, _wd) = tensors_mm
    k = xs[-1]
    m = _numel(xs[:-1])
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm"):
        n = ws[-1]
    elif name == "aten::_weight_int8pack_mm":
        n = ws[0]
    elif "int4pack" in name:
        three_d = [s for s, _ in tensors[2:] if len(s) == 3]
        if not three_d:
            return None
        n = three_d[-1][1]  # scales_and_zeros [K/g, N, 2]
    else:
        return None
    out_bytes = m * n * _DTYPE_BYTES.get(xd, 4) if name != "aten::_int_mm" else m * n * 4
    in_bytes = sum(_numel(s) * _DTYPE_BYTES[d] for s, d in tensors)
    return 2.0 * m * k * n, float(in_bytes + out_bytes)


# ---------------------------------------------------------------- roofline


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_roofline(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     read_mb: int = 256, matmul_n: int | None = None) -> dict[str, Any]:
    """Peak read bandwidth (a large ``sum``) and matmul FLOP/s (n x n x n), measured here, once."""
    dev = torch.device(device)
    x = torch.ones(read_mb * 2**20 // 4, dtype=torch.float32, device=dev)
    bw = x.numel() * 4 / _median_seconds(lambda: x.sum(), dev) / 1e9
    del x
    n = matmul_n or (4096 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    flops = 2.0 * n**3 / _median_seconds(lambda: a @ b, dev)
    return {"bandwidth_gbs": round(bw, 2), "flops": flops, "source": f"measured ({n}^3 {dtype} matmul, {read_mb} MB sum)"}


def roofline(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The data-sheet peaks of a known GPU, else peaks measured on this machine."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        for key, (bw, flops) in KNOWN_GPUS.items():
            if key.lower() in name.lower():
                return {"bandwidth_gbs": bw, "flops": flops, "source": f"data sheet ({key})"}
    return measure_roofline(dev, dtype)


def bound(flops: float, nbytes: float, seconds: float, peak: dict[str, Any]) -> dict[str, Any]:
    """Achieved rates, arithmetic intensity, which roof binds, and % of that roof."""
    gbs = nbytes / seconds / 1e9
    fps = flops / seconds
    intensity = flops / nbytes
    ridge = peak["flops"] / (peak["bandwidth_gbs"] * 1e9)
    memory_bound = intensity < ridge
    pct = 100 * (gbs / peak["bandwidth_gbs"] if memory_bound else fps / peak["flops"])
    return {"gb_per_s": round(gbs, 3), "gflop_per_s": round(fps / 1e9, 3), "intensity": round(intensity, 3),
            "bound": "memory" if memory_bound else "compute", "pct_of_peak": round(pct, 2)}


# ---------------------------------------------------------------- profiling


@contextmanager
def quant_linear_scopes(model: torch.nn.Module) -> Iterator[int]:
    """Mark every QuantLinear forward as a ``quantspec::quant_linear`` profiler range (hooks)."""
    from torch.autograd.profiler import record_function

    from ..kernels.quant_linear import QuantLinear

    stack: list[Any] = []

    def pre(_mod, _inp):
        rf = record_function(SCOPE_QLINEAR)
        rf.__enter__()
        stack.append(rf)

    def post(_mod, _inp, _out):
        stack.pop().__exit__(None, None, None)

    handles = []
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        yield len(handles) // 2
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def _prefill_and_decode(model, ids: torch.Tensor, steps: int) -> None:
    from torch.autograd.profiler import record_function
    from transformers import DynamicCache

    from ..runtime.kv import cache_kwarg

    key = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    with record_function("quantspec::prefill"):
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache}).logits
    for i in range(steps):
        with record_function(SCOPE_SAMPLING):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        with record_function("quantspec::decode_step"):
            logits = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{key: cache}).logits


def _scopes(evt) -> tuple[str, ...]:
    out, p = [], evt.cpu_parent
    while p is not None:
        out.append(p.name)
        p = p.cpu_parent
    return tuple(out)


def summarize_events(events, on_gpu: bool, peak: dict[str, Any]) -> dict[str, Any]:
    """Time by class and per-GEMM roofline rows from profiler FunctionEvents."""
    by_class = {c: 0.0 for c in CLASSES}
    gemms: dict[tuple, dict[str, Any]] = {}
    for e in events:
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            continue  # kernels are attributed to the CPU op that launched them
        scopes = _scopes(e)
        self_us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        by_class[classify(e.name, scopes)] += self_us
        if e.name in _LEAF_GEMMS:
            cost = gemm_cost(e.name, e.input_shapes, e.input_dtypes)
            if cost is None:
                continue
            key = (e.name, json.dumps(e.input_shapes), classify(e.name, scopes))
            row = gemms.setdefault(key, {"op": e.name, "class": key[2], "shapes": e.input_shapes,
                                         "dtypes": e.input_dtypes, "calls": 0, "us": 0.0,
                                         "flops": cost[0], "bytes": cost[1]})
            row["calls"] += 1
            row["us"] += e.device_time_total if on_gpu else e.cpu_time_total
    total = sum(by_class.values()) or 1.0
    classes = {c: {"ms": round(v / 1000, 3), "pct": round(100 * v / total, 2)} for c, v in by_class.items()}
    rows = []
    for row in gemms.values():
        secs = row["us"] / 1e6 / row["calls"]
        if secs > 0:
            rows.append({**row, "us_per_call": round(row["us"] / row["calls"], 3), **bound(row["flops"], row["bytes"], secs, peak)})
    rows.sort(key=lambda r: -r["us"])
    return {"total_ms": round(total / 1000, 3), "by_class": classes, "gemms": rows}


def serving_terms(model, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """TTFT, TPOT and decode tokens/s from one warm, unprofiled run."""
    from ..runtime.kv import PlainDecoder
    from .speed import decode_run

    decoder = PlainDecoder(model)
    decode_run(decoder, ids, steps + 1)
    ttft, tpot = decode_run(decoder, ids, steps + 1)
    med = statistics.median(tpot)
    return {"ttft_ms": round(ttft * 1000, 3), "tpot_ms": round(med * 1000, 3),
            "decode_tokens_per_s": round(ids.shape[0] / med, 2)}


def profile_model(model, config: ProfileConfig = ProfileConfig(), device: str = "cpu",
                  trace_path: str | Path | None = None, peak: dict[str, Any] | None = None) -> dict[str, Any]:
    """Profile one prefill + ``decode_steps`` decode steps; optionally export the Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    from .speed import random_prompt

    dev = torch.device(device)
    ids = random_prompt(model.config.vocab_size, config.batch_size, config.prompt_length, config.seed, dev)
    dtype = next(model.parameters()).dtype
    peak = peak or roofline(dev, dtype)
    serving = serving_terms(model, ids, config.decode_steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with quant_linear_scopes(model) as n_quant:
        _prefill_and_decode(model, ids, 1)  # warm-up outside the profiler
        with profile(activities=activities, record_shapes=True) as prof:
            _prefill_and_decode(model, ids, config.decode_steps)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    summary = summarize_events(prof.events(), dev.type == "cuda", peak)
    return {"config": asdict(config), "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
            "quant_linears": n_quant, "roofline": peak, "serving": serving, **summary}


def summary_markdown(s: dict[str, Any], top: int = 15) -> str:
    peak = s["roofline"]
    sv = s["serving"]
    lines = [
        f"# Profile: {s.get('model', '')}",
        "",
        f"{s['config']['prompt_length']}-token prefill + {s['config']['decode_steps']} decode steps, "
        f"batch {s['config']['batch_size']}, {s['device']} {s['dtype']}, {s['quant_linears']} QuantLinear layers.",
        f"Serving (unprofiled): TTFT {sv['ttft_ms']:.2f} ms, TPOT {sv['tpot_ms']:.2f} ms, "
        f"{sv['decode_tokens_per_s']:.1f} tokens/s.",
        f"Roofline: {peak['bandwidth_gbs']:.1f} GB/s, {peak['flops'] / 1e9:.1f} GFLOP/s ({peak['source']}).",
        "",
        "| class | ms | % |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {v['ms']:.3f} | {v['pct']:.1f} |" for c, v in s["by_class"].items()]
    lines += ["", "| op | class | shapes | calls | us/call | GB/s | GFLOP/s | intensity | bound | % peak |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["gemms"][:top]:
        shapes = " ".join("x".join(map(str, sh)) for sh in r["shapes"] if sh)
        lines.append(f"| {r['op']} | {r['class']} | {shapes} | {r['calls']} | {r['us_per_call']:.1f} | "
                     f"{r['gb_per_s']:.2f} | {r['gflop_per_s']:.2f} | {r['intensity']:.2f} | {r['bound']} | "
                     f"{r['pct_of_peak']:.1f} |")
    return "\n".join(lines) + "\n"


def profile_to_folder(model_spec: str, out: str | Path, config: ProfileConfig = ProfileConfig(),
                      dtype: str = "auto", device: str | None = None, backend: str = "auto",
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load ``model_spec``, profile it, write trace.json, summary.json and summary.md into ``out``."""
    from ..models.load import load_model

    say = progress or (lambda _m: None)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "summary.json").is_file())):
        raise QuantspecError(f"--out {out} exists and is not an earlier profile's folder (no summary.json).",
                             "give a new folder, or that of an earlier profile to replace its files.")
    say(f"loading {model_spec}")
    model, _tok, desc = load_model(model_spec, dtype=dtype, device=device, backend=backend)
    out.mkdir(parents=True, exist_ok=True)
    say("measuring the roofline")
    peak = roofline(device, next(model.parameters()).dtype)
    say(f"profiling {config.prompt_length}-token prefill + {config.decode_steps} decode steps")
    summary = profile_model(model, config, device, out / "trace.json", peak)
    summary = {"model": model_spec, "load": desc, "machine": describe_machine(), **summary}
    atomic_write_text(out / "summary.md", summary_markdown(summary))
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
