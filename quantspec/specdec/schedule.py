"""Interleaved repeats of timed modes, and their medians (``bench-specdec``'s timing plan).

Order: for each repeat r, for each prompt p, every mode once, the modes rotated by
``(r * P + p) mod M`` (P prompts, M modes): the modes share whatever load a shared machine has at
that moment, and no mode always runs first (after a prompt change, on colder caches). A mode's
speed in a repeat is its tokens over its seconds summed over all prompts of that repeat; the
result is the median over repeats, and a speed-up is the median of the per-repeat ratios to the
base mode (each ratio pairs runs made side by side).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Timing:
    """One timed run: ``mode`` on prompt ``prompt`` in repeat ``repeat``."""

    repeat: int
    prompt: int
    mode: str
    tokens: int
    seconds: float


def schedule(repeats: int, prompts: int, modes: list[str]) -> list[tuple[int, int, str]]:
    """(repeat, prompt, mode) in run order; see the module docstring."""
    order = []
    for r in range(repeats):
        for p in range(prompts):
            shift = (r * prompts + p) % len(modes)
            order += [(r, p, m) for m in modes[shift:] + modes[:shift]]
    return order


def run_interleaved(
    modes: dict[str, Callable[[int], Any]],
    prompts: int,
    repeats: int,
    timer: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int, dict[str, float]], None] | None = None,
) -> tuple[list[Timing], dict[tuple[str, int], Any]]:
    """Run ``modes[m](p)`` in ``schedule`` order, timing each call with ``timer``.

    Each call returns an object with ``new_tokens``. Returns every Timing and the last output
    of each (mode, prompt). progress(repeat, prompt, {mode: seconds}) after each prompt.
    """
    timings, outputs = [], {}
    names = list(modes)
    seconds: dict[str, float] = {}
    for r, p, m in schedule(repeats, prompts, names):
        start = timer()
        out = modes[m](p)
        dt = timer() - start
        timings.append(Timing(r, p, m, int(out.new_tokens), dt))
        outputs[(m, p)] = out
        seconds[m] = dt
        if len(seconds) == len(names):
            if progress:
                progress(r, p, seconds)
            seconds = {}
    return timings, outputs


def mode_medians(timings: list[Timing], base: str = "target") -> dict[str, dict]:
    """Per mode: tokens and seconds of each repeat (summed over prompts), tokens/s per repeat
    and their median, and the median over repeats of tokens/s relative to ``base`` in the same
    repeat (None without a base mode)."""
    sums: dict[str, dict[int, list[float]]] = {}
    for t in timings:
        tok_s = sums.setdefault(t.mode, {}).setdefault(t.repeat, [0, 0.0])
        tok_s[0] += t.tokens
        tok_s[1] += t.seconds
    rate = {m: {r: (tok / s if s > 0 else 0.0) for r, (tok, s) in reps.items()}
            for m, reps in sums.items()}
    out = {}
    for m, reps in sums.items():
        repeats = sorted(reps)
        ratios = [rate[m][r] / rate[base][r] for r in repeats
                  if base in rate and rate[base].get(r)]
        out[m] = {
            "tokens_repeats": [int(reps[r][0]) for r in repeats],
            "seconds_repeats": [round(reps[r][1], 4) for r in repeats],
            "tokens_per_s_repeats": [round(rate[m][r], 3) for r in repeats],
            "tokens_per_s": round(statistics.median(rate[m][r] for r in repeats), 3),
            "speedup_repeats": [round(x, 3) for x in ratios],
            "speedup": round(statistics.median(ratios), 3) if ratios else None,
        }
    return out
