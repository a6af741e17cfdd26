"""Speed bench: prefill and decode throughput, latency and memory, always against the dense model.

Protocol (stated in every result under "protocol"):

* Prompts are random token ids (seeded), so every model sees the same input.
* Prefill: one forward pass over a batch-1 prompt of each length, logits of the last position only.
* Decode: a manual greedy loop over the HF KV cache (``DynamicCache``), one ``model()`` call per
  token, each step timed alone (device synchronised), so per-token latency is exact. The loop
  (``decode_run``) takes any ``runtime.protocol.Decoder``: ``runtime.kv.PlainDecoder`` for
  transformers' forward (eager or compiled), the ``StaticDecoder`` for ``--static``.
  TTFT = prefill of the decode prompt + the first argmax; TPOT = time of each later step.
* ``warmup`` runs are thrown away, then ``repeats`` runs are timed; medians are reported
  (TPOT p50/p95 pool the steps of every timed run).
* Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the process RSS, sampled
  every few milliseconds from before the load to the end of the runs (it includes the Python
  and torch runtime: compare ``rss_delta_mb``).
* The quantized model is measured first, then the dense baseline, in the same process.
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint.load import is_quantized_folder

from ..errors import QuantspecError
from ..models.load import load_model
from ..models.source import check_context
from ..runtime.kv import PlainDecoder, cache_kwarg
from ..runtime.protocol import Decoder
from .machine import describe_machine

Progress = Callable[[str], None]

RUN_PROTOCOL = (  # one model's measurement
    "random seeded prompts; prefill = one batch-1 forward per prompt length (last-position logits); "
    "decode = manual greedy loop over DynamicCache, each step timed alone with the device synchronised; "
    "TTFT = prefill + first argmax, TPOT = each later step; warm-up runs excluded, medians of the timed "
    "runs (TPOT p50/p95 over all timed steps); peak memory = CUDA max allocated or sampled process RSS"
)
PROTOCOL = f"{RUN_PROTOCOL}; quantized model measured first, then its dense baseline, in the same process"


@dataclass(frozen=True)
class SpeedConfig:
    """What the bench measures. Lengths are prompt tokens; batch sizes apply to decode."""

    prompt_lengths: tuple[int, ...] = (128, 512)
    batch_sizes: tuple[int, ...] = (1, 8)
    decode_prompt_length: int = 64
    new_tokens: int = 32
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    compile: str | None = None  # also time decode under torch.compile with this backend (e.g. "inductor")
    static: bool = False  # also time decode through quantspec's StaticDecoder (runtime/decoder.py)

    def __post_init__(self) -> None:
        if not self.prompt_lengths or min(self.prompt_lengths) < 1:
            raise QuantspecError("prompt lengths must be positive.", "use e.g. --prompt-lengths 128 512.")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise QuantspecError("batch sizes must be positive.", "use e.g. --batch-sizes 1 8.")
        if self.decode_prompt_length < 1:
            raise QuantspecError(f"decode_prompt_length={self.decode_prompt_length} is not positive.",
                                 "use e.g. --decode-prompt-length 64.")
        if self.new_tokens < 2:
            raise QuantspecError("new_tokens must be at least 2 (TTFT + one TPOT).", "use e.g. 32.")
        if self.repeats < 1 or self.warmup < 0:
            raise QuantspecError("repeats must be >= 1 and warmup >= 0.", "use --repeats 3.")
        if self.compile is not None:
            import torch._dynamo

            if self.compile not in torch._dynamo.list_backends(exclude_tags=()):
                raise QuantspecError(f"unknown torch.compile backend {self.compile!r}.",
                                     "use inductor (the default of --compile) or aot_eager.")
            if self.warmup < 1:
                raise QuantspecError("--compile needs a warm-up run (it absorbs the compilation).", "use --warmup 1.")


# ---------------------------------------------------------------- loading


def dense_source(path: str | Path) -> str | None:
    """The dense model a quantized folder was made from (quant_report.json, then recipe.yaml)."""
    p = Path(path)
    candidates: list[Any] = []
    if (p / "quant_report.json").is_file():
        try:
            report = json.loads((p / "quant_report.json").read_text())
            candidates += [report.get("source"), report.get("model"), report.get("base_model")]
        except (json.JSONDecodeError, AttributeError):
            pass
    if (p / "recipe.yaml").is_file():
        import yaml

        data = yaml.safe_load((p / "recipe.yaml").read_text()) or {}
        if isinstance(data, dict):
            candidates += [data.get("source"), data.get("model")]
    for c in candidates:
        if isinstance(c, dict):
            c = c.get("model") or c.get("spec") or c.get("path") or c.get("name")
        if isinstance(c, str) and c:
            return c
    return None


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (tied tensors counted once)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for _, b in model.named_buffers()]
    for t in tensors:
        if t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def disk_bytes(path: str | Path) -> int | None:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if not p.is_dir():
        return None
    files = list(p.glob("*.safetensors")) or list(p.glob("*.bin"))
    return sum(f.stat().st_size for f in files) or None


# ---------------------------------------------------------------- measuring


class PeakMemory:
    """Peak memory during a ``with`` block: CUDA allocator peak, or sampled process RSS."""

    def __init__(self, device: str, interval_s: float = 0.005):
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self.before_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _rss_mb(self) -> float:
        import psutil

        return psutil.Process().memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, self._rss_mb())

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before_mb = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            self.before_mb = self.peak_mb = self._rss_mb()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, self._rss_mb())

    def result(self) -> dict[str, Any]:
        kind = "cuda_max_allocated" if self.device.type == "cuda" else "process_rss"
        return {"kind": kind, "peak_mb": round(self.peak_mb, 1), "before_mb": round(self.before_mb, 1),
                "delta_mb": round(self.peak_mb - self.before_mb, 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompt(vocab_size: int, batch: int, length: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length * 131 + batch)
    low = min(10, vocab_size - 1)  # keep clear of special tokens at the low ids
    return torch.randint(low, vocab_size, (batch, length), generator=gen).to(device)


def _step(model, ids: torch.Tensor, cache, key: str) -> torch.Tensor:
    """One forward over ``ids`` with the cache (passed as ``key``); the greedy next token [B, 1]."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
    return out.logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def prefill_seconds(model, ids: torch.Tensor) -> float:
    from ..runtime.kv_quant import new_cache

    device = ids.device
    key = cache_kwarg(model)
    _sync(device)
    start = time.perf_counter()
    _step(model, ids, new_cache(model), key)
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def decode_run(decoder: Decoder, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
    """Greedy decode ``new_tokens`` tokens through ``decoder`` (its cache reset first, untimed):
    returns (TTFT seconds, per-step seconds). Transformers' own loop is a ``PlainDecoder``."""
    device = ids.device
    decoder.reset()
    _sync(device)
    start = time.perf_counter()
    nxt = decoder.step(ids, keep=1)[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    ttft = time.perf_counter() - start
    steps = []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        nxt = decoder.step(nxt, keep=1)[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        steps.append(time.perf_counter() - t)
    return ttft, steps


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _timed(fn: Callable[[], Any], cfg: SpeedConfig) -> list[Any]:
    for _ in range(cfg.warmup):
        fn()
    return [fn() for _ in range(cfg.repeats)]


def measure_speed(model, config: SpeedConfig, device: str = "cpu", progress: Progress | None = None) -> dict[str, Any]:
    """Prefill tokens/s per prompt length, decode tokens/s per batch size, TTFT and TPOT."""
    say = progress or (lambda _msg: None)
    dev = torch.device(device)
    vocab = model.config.vocab_size
    prefill = {}
    for length in config.prompt_lengths:
        say(f"prefill {length} tokens")
        ids = random_prompt(vocab, 1, length, config.seed, dev)
        secs = statistics.median(_timed(lambda: prefill_seconds(model, ids), config))
        prefill[str(length)] = {"seconds": round(secs, 6), "tokens_per_s": round(length / secs, 2)}
    result = {"prefill": prefill, "decode": _decode_table(PlainDecoder(model), config, dev, vocab, say)}
    if config.static:
        from ..runtime.decoder import StaticDecoder

        try:
            decoder = StaticDecoder(model)
        except QuantspecError as exc:
            result["decode_static"] = {"error": str(exc)}
        else:
            result["decode_static"] = _decode_table(decoder, config, dev, vocab, lambda m: say(f"static {m}"))
    if config.compile:
        from ..kernels.custom_ops import register_ops

        register_ops()  # each quantized linear is one custom op in the graph (no graph break)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=config.compile, dynamic=True)
        start = time.perf_counter()
        result["decode_compiled"] = _decode_table(PlainDecoder(compiled), config, dev, vocab,
                                                  lambda m: say(f"compiled {m}"))
        result["compile"] = {"backend": config.compile, "wall_s": round(time.perf_counter() - start, 2)}
        torch._dynamo.reset()
    return result


def _decode_table(decoder: Decoder, config: SpeedConfig, dev, vocab: int, say: Progress) -> dict[str, Any]:
    """Decode tokens/s, TTFT and TPOT per batch size through ``decoder`` (warm-up runs first,
    then medians of ``decode_run``)."""
    decode = {}
    for batch in config.batch_sizes:
        say(f"decode batch {batch}, {config.new_tokens} tokens")
        ids = random_prompt(vocab, batch, config.decode_prompt_length, config.seed, dev)
        runs = _timed(lambda: decode_run(decoder, ids, config.new_tokens), config)
        steps = [s for _, run_steps in runs for s in run_steps]
        tps = statistics.median(batch * len(r) / sum(r) for _, r in runs)
        decode[str(batch)] = {
            "tokens_per_s": round(tps, 2),
            "ttft_ms": round(1000 * statistics.median(t for t, _ in runs), 3),
            "tpot_ms_p50": round(1000 * _percentile(steps, 0.5), 3),
            "tpot_ms_p95": round(1000 * _percentile(steps, 0.95), 3),
        }
    return decode


def measure_model(spec: str, config: SpeedConfig, dtype="auto", device="cpu", backend="auto",
                  progress: Progress | None = None) -> dict[str, Any]:
    """Load one model and measure it; the model is freed before returning."""
    say = progress or (lambda _msg: None)
    with PeakMemory(device) as mem:
        start = time.perf_counter()
        model, _tok, desc = load_model(spec, dtype=dtype, device=device, backend=backend)
        load_s = time.perf_counter() - start
        say(f"loaded {desc['kind']} {spec} in {load_s:.1f}s")
        check_context(model.config, max(max(config.prompt_lengths), config.decode_prompt_length + config.new_tokens),
                      "the longest prompt (--prompt-lengths), or --decode-prompt-length with --new-tokens,",
                      "keep every prompt, and the decode prompt with its new tokens, within {context}.")
        wbytes = weight_bytes(model)  # as loaded (--static fuses some layers' layouts later)
        result = measure_speed(model, config, device, lambda m: say(f"{desc['kind']}: {m}"))
    del model
    gc.collect()
    return {"model": spec, **desc, "load_s": round(load_s, 3), "weights_mb": round(wbytes / 2**20, 3),
            "disk_mb": None if disk_bytes(spec) is None else round(disk_bytes(spec) / 2**20, 3),
            "memory": mem.result(), **result}


def speedups(model: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    """Ratios quantized / dense (throughput) and dense / quantized (latency)."""
    out: dict[str, Any] = {"decode": {}, "prefill": {}}
    for b, d in model["decode"].items():
        if b in dense["decode"]:
            out["decode"][b] = round(d["tokens_per_s"] / dense["decode"][b]["tokens_per_s"], 3)
    for n, p in model["prefill"].items():
        if n in dense["prefill"]:
            out["prefill"][n] = round(p["tokens_per_s"] / dense["prefill"][n]["tokens_per_s"], 3)
    for key in ("decode_static", "decode_compiled"):  # the same mode on both sides
        if _has_table(model, key) and _has_table(dense, key):
            out[key] = {b: round(d["tokens_per_s"] / dense[key][b]["tokens_per_s"], 3)
                        for b, d in model[key].items() if b in dense[key]}
    if _has_table(model, "decode_static"):  # ours through the static decoder vs dense as usual
        out["decode_static_vs_dense_eager"] = {
            b: round(d["tokens_per_s"] / dense["decode"][b]["tokens_per_s"], 3)
            for b, d in model["decode_static"].items() if b in dense["decode"]}
    out["weights"] = round(dense["weights_mb"] / model["weights_mb"], 3) if model["weights_mb"] else None
    return out


def _has_table(result: dict[str, Any], key: str) -> bool:
    return key in result and "error" not in result[key]


def speed_report(model: str, baseline: str | None = None, config: SpeedConfig | None = None,
                 dtype: str = "auto", device: str | None = None, backend: str = "auto",
                 measure_baseline: bool = True, progress: Progress | None = None) -> dict[str, Any]:
    """Measure ``model`` and (for a quantized folder) its dense baseline in the same run.

    The baseline is ``baseline`` or the source named in the folder's quant_report.json /
    recipe.yaml. Returns {"protocol", "machine", "config", "model", "dense", "speedup"};
    "dense" is None when ``model`` is itself dense or ``measure_baseline`` is False.
    """
    config = config or SpeedConfig()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if measure_baseline and baseline is None and is_quantized_folder(model):
        baseline = dense_source(model)
        if baseline is None:
            raise QuantspecError(
                f"{model} does not name the dense model it came from.", "pass --baseline DENSE_MODEL."
            )
    result = measure_model(model, config, dtype, device, backend, progress)
    dense = None
    if measure_baseline and baseline is not None and result["kind"] == "quantized":
        dense = measure_model(baseline, config, dtype, device, "auto", progress)
    return {
        "protocol": PROTOCOL,
        "machine": describe_machine(),
        "config": asdict(config),
        "device": device,
        "model": result,
        "dense": dense,
        "speedup": speedups(result, dense) if dense else None,
    }


def speed_markdown(report: dict[str, Any]) -> str:
    """A small table: one row per measured model."""
    rows = [("model", report["model"])] + ([("dense", report["dense"])] if report["dense"] else [])
    first = rows[0][1]
    pl = list(first["prefill"])
    bs = list(first["decode"])
    head = ["", "backend", "weights MB", "peak MB"] + [f"prefill {n} tok/s" for n in pl]
    compiled = "decode_compiled" in first
    static = "decode_static" in first
    head += [f"decode b{b} tok/s" for b in bs] + ["TTFT ms", "TPOT p50 ms", "TPOT p95 ms"]
    if compiled:
        head += [f"compiled decode b{b} tok/s" for b in bs]
    if static:
        head += [f"static decode b{b} tok/s" for b in bs] + ["static TPOT p50 ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in rows:
        d1 = r["decode"][bs[0]]
        cells = [label, str(r["backend"]), f"{r['weights_mb']:.1f}", f"{r['memory']['peak_mb']:.0f}"]
        cells += [f"{r['prefill'][n]['tokens_per_s']:.1f}" for n in pl]
        cells += [f"{r['decode'][b]['tokens_per_s']:.1f}" for b in bs]
        cells += [f"{d1['ttft_ms']:.1f}", f"{d1['tpot_ms_p50']:.2f}", f"{d1['tpot_ms_p95']:.2f}"]
        if compiled:
            cells += [f"{r['decode_compiled'][b]['tokens_per_s']:.1f}" for b in bs]
        if static and _has_table(r, "decode_static"):
            cells += [f"{r['decode_static'][b]['tokens_per_s']:.1f}" for b in bs]
            cells += [f"{r['decode_static'][bs[0]]['tpot_ms_p50']:.2f}"]
        elif static:
            cells += ["n/a"] * (len(bs) + 1)
        lines.append("| " + " | ".join(cells) + " |")
    if report.get("speedup"):
        sp = report["speedup"]["decode"]
        lines.append("")
        lines.append("decode speed-up vs dense: " + ", ".join(f"batch {b}: {v:.2f}x" for b, v in sp.items()))
        for key, what in (("decode_static", "static decoder, both sides"),
                          ("decode_static_vs_dense_eager", "static decoder vs dense through transformers"),
                          ("decode_compiled", "compiled, both sides")):
            if key in report["speedup"]:
                vals = report["speedup"][key]
                lines.append(f"decode speed-up ({what}): "
                             + ", ".join(f"batch {b}: {v:.2f}x" for b, v in vals.items()))
    return "\n".join(lines)
