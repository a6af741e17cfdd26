"""Per-level statistics of timed requests: percentiles, throughput, goodput.

Percentiles interpolate linearly between order statistics (numpy's default ``linear``
method, which vLLM's ``bench serve`` uses), so both tools report the same figure for the same
samples."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from .slo import SLO, meets

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict:
    """mean, p50/p90/p99 and max of ``values`` in milliseconds (None when empty)."""
    out: dict = {"n": len(values)}
    out["mean_ms"] = 1e3 * sum(values) / len(values) if values else None
    for q in PERCENTILES:
        v = percentile(values, q)
        out[f"p{q}_ms"] = None if v is None else 1e3 * v
    out["max_ms"] = 1e3 * max(values) if values else None
    return out


def summarize(records: Sequence, duration: float, slo: SLO | None = None) -> dict:
    """Figures of one load level from its ``RequestRecord`` s and its wall time in seconds."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    summary = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "ttft": distribution([r.ttft for r in done]),
        "tpot": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl": distribution([x for r in done for x in r.itl]),
        "e2e": distribution([r.latency for r in done]),
    }
    if slo is not None:
        good = sum(1 for r in records if meets(r, slo))
        summary["slo"] = str(slo)
        summary["good_requests"] = good
        summary["good_fraction"] = good / len(records) if records else None
        summary["goodput"] = good / duration if duration > 0 else None
    errors = sorted({r.error for r in records if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


COUNTS = ("requests", "completed", "failed", "input_tokens", "output_tokens", "good_requests")


def median_rows(rows: Sequence[dict]) -> dict:
    """One level's figures over repeated rounds: counts summed (``COUNTS``), every other number
    the median over the rounds that have it (nested dicts likewise), anything else from the
    first round; ``rounds``: how many."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def merge(items: list, top: bool) -> dict:
        out: dict = {}
        for key in items[0]:
            vals = [it.get(key) for it in items]
            nums = [v for v in vals if number(v)]
            if isinstance(vals[0], dict):
                out[key] = merge([v for v in vals if isinstance(v, dict)], False)
            elif nums and all(v is None or number(v) for v in vals):  # a figure some rounds lack: theirs
                out[key] = sum(nums) if top and key in COUNTS else statistics.median(nums)
            else:
                out[key] = vals[0]
        return out

    return merge(list(rows), True) | {"rounds": len(rows)}
