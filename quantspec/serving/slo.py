"""Service-level objectives: ``ttft=500ms,tpot=50ms,e2e=2s`` parsed into limits in seconds.

A request is *good* when it finished without error and meets every stated limit; goodput is
good requests per second of the level's wall time (vLLM's ``--goodput`` convention)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import QuantspecError

METRICS = ("ttft", "tpot", "itl", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
_TERM = re.compile(r"^\s*([a-z0-9_]+)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")
_ALIASES = {"e2el": "e2e", "latency": "e2e"}


@dataclass(frozen=True)
class SLO:
    """Upper limits in seconds; None means not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def limits(self) -> dict[str, float]:
        return {m: getattr(self, m) for m in METRICS if getattr(self, m) is not None}

    def __str__(self) -> str:
        return ",".join(f"{m}={v * 1e3:g}ms" for m, v in self.limits().items()) or "none"


def parse_slo(text: str | None) -> SLO | None:
    """``"ttft=500ms,tpot=50ms"`` -> SLO; a bare number is milliseconds. None/empty -> None."""
    if not text:
        return None
    values: dict[str, float] = {}
    for term in text.split(","):
        m = _TERM.match(term.lower())
        if not m:
            raise QuantspecError(
                f"SLO term {term.strip()!r} does not parse.",
                "write METRIC=VALUE[ms|s] terms separated by commas, e.g. --slo ttft=500ms,tpot=50ms "
                f"(metrics: {', '.join(METRICS)})")
        name, value, unit = m.group(1), float(m.group(2)), m.group(3) or "ms"
        name = _ALIASES.get(name, name)
        if name not in METRICS:
            raise QuantspecError(f"unknown SLO metric {m.group(1)!r}.", f"use one of {', '.join(METRICS)}")
        if value <= 0:
            raise QuantspecError(f"SLO {name}={value:g}{unit} must be positive.", "give a limit above zero")
        if name in values:
            raise QuantspecError(f"SLO metric {name!r} is given twice.", "state each metric once")
        values[name] = value * _UNITS[unit]
    return SLO(**values)


def meets(record, slo: SLO) -> bool:
    """Whether one finished request (``client.RequestRecord``) meets every limit of ``slo``.
    ``itl`` is checked on the request's largest inter-token gap."""
    if not record.ok:
        return False
    got = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.latency,
           "itl": max(record.itl) if record.itl else 0.0}
    return all(got[m] is not None and got[m] <= lim for m, lim in slo.limits().items())
