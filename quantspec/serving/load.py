"""Drive one load level against an endpoint: Poisson arrivals at a rate, or a fixed number of
requests in flight. Requests run on daemon threads (an interrupted run never waits on a hung
server); the level ends when every issued request has finished or ``duration`` has passed and
the in-flight ones are done."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import QuantspecError
from .client import Endpoint, RequestRecord, stream_completion
from .workload import Request


@dataclass(frozen=True)
class Level:
    """``kind`` "rate" (requests/s, Poisson arrivals; inf = all at once) or "concurrency"."""

    kind: str
    value: float

    def __str__(self) -> str:
        if self.kind == "rate":
            return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}/s"
        return f"concurrency={int(self.value)}"


def parse_levels(rates: str | None, concurrency: str | None) -> list[Level]:
    """``--rate 1,2,inf`` or ``--concurrency 1,4,16`` (not both) -> levels; default concurrency 1,4,16."""
    if rates and concurrency:
        raise QuantspecError("--rate and --concurrency were both given.", "sweep one of them per run")
    kind, text = ("rate", rates) if rates else ("concurrency", concurrency or "1,4,16")
    levels = []
    for term in text.split(","):
        try:
            v = float(term)
        except ValueError:
            raise QuantspecError(f"--{kind} value {term.strip()!r} is not a number.",
                                 f"give numbers separated by commas, e.g. --{kind} 1,4,16") from None
        if not v > 0 or (kind == "concurrency" and (math.isinf(v) or v != int(v))):
            raise QuantspecError(f"--{kind} value {term.strip()!r} must be a positive "
                                 f"{'number (or inf)' if kind == 'rate' else 'whole number'}.",
                                 f"e.g. --{kind} {'1,2,4' if kind == 'rate' else '1,4,16'}")
        levels.append(Level(kind, v))
    return levels


def arrival_times(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Start offsets (s) of ``n`` requests at ``rate`` per second, the process of vLLM's ``bench
    serve``: gaps drawn from a gamma distribution of shape ``burstiness`` (1: exponential, a
    Poisson process; below 1 burstier, above 1 more even) and mean ``1/rate``, summed from the
    first request on, then scaled so that the last request starts at exactly ``n / rate``. The
    draws are numpy's legacy generator seeded with ``seed``, so the offsets equal vLLM's for the
    same seed, rate and burstiness. ``rate`` inf -> all zero."""
    import numpy as np

    if math.isinf(rate):
        return [0.0] * n
    if burstiness <= 0:
        raise QuantspecError(f"burstiness {burstiness} must be positive.", "use 1 for Poisson arrivals")
    gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    t = np.cumsum(gaps)
    return (t * (n / rate) / t[-1]).tolist() if n else []


def run_level(endpoint: Endpoint, requests: Sequence[Request], level: Level, *, seed: int = 0,
              duration: float | None = None, ignore_eos: bool = True, burstiness: float = 1.0,
              send: Callable[..., RequestRecord] = stream_completion,
              progress: Callable[[int, int], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Run ``requests`` at ``level``; returns (records of the requests issued, wall seconds from
    the first send to the last completion). ``duration`` stops issuing new requests after that
    many seconds."""
    records: list[RequestRecord | None] = [None] * len(requests)
    lock = threading.Lock()
    done = [0]
    t0 = time.perf_counter()

    def one(i: int) -> None:
        r = requests[i]
        try:
            rec = send(endpoint, r.prompt, r.max_tokens, index=i, prompt_tokens=r.prompt_tokens,
                       ignore_eos=ignore_eos)
        except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
            rec = RequestRecord(index=i, prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens,
                                error=f"{type(exc).__name__}: {exc}")
        rec.start -= t0
        with lock:
            records[i] = rec
            done[0] += 1
            if progress:
                progress(done[0], len(requests))

    threads: list[threading.Thread] = []
    expired = (lambda: duration is not None and time.perf_counter() - t0 >= duration)
    if level.kind == "concurrency":
        slots = threading.Semaphore(int(level.value))

        def gated(i: int) -> None:
            try:
                one(i)
            finally:
                slots.release()

        for i in range(len(requests)):
            slots.acquire()
            if expired():
                slots.release()
                break
            th = threading.Thread(target=gated, args=(i,), daemon=True)
            th.start()
            threads.append(th)
    else:
        for i, at in enumerate(arrival_times(len(requests), level.value, seed, burstiness)):
            if duration is not None and at >= duration:
                break
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(i,), daemon=True)
            th.start()
            threads.append(th)
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    return [r for r in records if r is not None], wall
