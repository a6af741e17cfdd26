"""The engine's own Prometheus metrics (``/metrics``), sampled while a level runs.

Only plain ``name{labels} value`` lines are read; series of one name are summed over labels.
What is kept: KV-cache usage, running / waiting requests and preemptions, and vLLM's
speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted per position).
"""

from __future__ import annotations

import re
import threading

from .client import Endpoint, get_text

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaN]+)")
_POSITION = re.compile(r'position="(\d+)"')

GAUGES = {  # ours -> vLLM's names (newest first)
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}
COUNTERS = {
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "spec_drafts": ("vllm:spec_decode_num_drafts_total",),
    "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
    "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of each metric over its label sets; per-position acceptance kept as ``name[pos]``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name == ACCEPTED_PER_POS:
            pos = _POSITION.search(labels)
            if pos:
                key = f"{name}[{pos.group(1)}]"
                out[key] = out.get(key, 0.0) + v
        out[name] = out.get(name, 0.0) + v
    return out


def _pick(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in values:
            return values[n]
    return None


def counters(values: dict[str, float]) -> dict[str, float | None]:
    out = {k: _pick(values, names) for k, names in COUNTERS.items()}
    pos = sorted((int(k[len(ACCEPTED_PER_POS) + 1:-1]), v) for k, v in values.items()
                 if k.startswith(ACCEPTED_PER_POS + "["))
    out["spec_accepted_per_position"] = [v for _, v in pos] or None
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` for each counter both have (lists element-wise)."""
    out: dict = {}
    for k, a in after.items():
        b = before.get(k)
        if a is None or b is None:
            out[k] = None
            continue
        out[k] = [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b
    return out


def spec_summary(delta: dict) -> dict | None:
    """Acceptance rate and mean accepted length from counter deltas (None without drafts)."""
    drafts, proposed, accepted = (delta.get(k) for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))
    if not drafts:
        return None
    out = {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
           "acceptance_rate": accepted / proposed if proposed else None,
           "mean_accepted_length": 1.0 + accepted / drafts}
    per = delta.get("spec_accepted_per_position")
    if per:
        out["acceptance_per_position"] = [x / drafts for x in per]
    return out


class MetricsSampler:
    """Scrape ``/metrics`` every ``interval`` s on a daemon thread between ``start`` and ``stop``.

    ``summary()`` gives the peak and mean of each gauge, the counter deltas over the run, and
    ``available`` false (with the reason) when the endpoint could not be read."""

    def __init__(self, endpoint: Endpoint, interval: float = 1.0):
        self.endpoint, self.interval = endpoint, interval
        self.samples: list[dict[str, float]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict | None = None

    def scrape(self) -> dict[str, float] | None:
        try:
            status, text = get_text(self.endpoint, "/metrics", timeout=5)
        except Exception as exc:  # noqa: BLE001 - metrics are optional
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        if status != 200:
            self.error = f"HTTP {status} from /metrics"
            return None
        return parse_prometheus(text)

    def start(self) -> MetricsSampler:
        self._first = self.scrape()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            s = self.scrape()
            if s is not None:
                self.samples.append(s)

    def stop(self) -> dict:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        last = self.scrape()
        if last is not None:
            self.samples.append(last)
        return self.summary(last)

    def summary(self, last: dict | None) -> dict:
        if self._first is None or last is None:
            return {"available": False, "reason": self.error or "no samples"}
        out: dict = {"available": True, "samples": len(self.samples)}
        for k, names in GAUGES.items():
            vals = [v for v in (_pick(s, names) for s in self.samples) if v is not None]
            out[f"{k}_max"] = max(vals) if vals else None
            out[f"{k}_mean"] = sum(vals) / len(vals) if vals else None
        delta = counter_delta(counters(self._first), counters(last))
        out["counters"] = delta
        spec = spec_summary(delta)
        if spec:
            out["speculative"] = spec
        return out
