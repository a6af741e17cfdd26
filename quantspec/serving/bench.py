"""``serve_bench``: start each target's server, take accuracy through it, run the load levels,
stop it; one JSON written after every step, so an interrupted or failed run keeps what it
measured (marked ``partial``).

With ``repeats`` > 1 every target is served that many times, each on a freshly started server,
the targets in a new seeded random order each round (interleaved, so that a slow spell of a
shared machine does not land on one target); a target's ``levels`` are then the medians over
its rounds (``stats.median_rows``) and ``rounds`` keeps each round's rows. Accuracy is measured
in a target's first round only."""

from __future__ import annotations

import http.client
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import QuantspecError
from .client import Endpoint, get_json, get_text, stream_completion
from .load import Level, run_level
from .metrics import MetricsSampler
from .server import EngineServer, EngineSpec
from .slo import SLO
from .stats import median_rows, summarize
from .variants import Target
from .workload import Request, split_levels

Say = Callable[[str], None]


@dataclass
class BenchConfig:
    levels: list[Level]
    num_prompts: int = 64
    duration: float | None = None
    warmup: int = 2
    seed: int = 0
    burstiness: float = 1.0
    slo: SLO | None = None
    ignore_eos: bool = True
    ppl_data: str | None = None
    ppl_seqlen: int = 512
    ppl_windows: int = 20
    tasks: list[str] = field(default_factory=list)
    task_limit: float | None = None
    include_path: str | None = None
    metrics_interval: float = 1.0
    keep_records: bool = True
    repeats: int = 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["levels"] = [str(lv) for lv in self.levels]
        d["slo"] = None if self.slo is None else str(self.slo)
        return d


def served_name(label: str) -> str:
    """The model name a started server answers to: the label without spaces or slashes."""
    return re.sub(r"[^A-Za-z0-9._:+-]+", "-", label).strip("-") or "model"


class ServerDied(RuntimeError):
    pass


def check_url(ep: Endpoint) -> None:
    """QuantspecError when ``ep`` does not answer or does not serve ``ep.model`` (a server with one
    model fills an empty name in)."""
    try:
        status, _ = get_text(ep, "/health", timeout=10)
        models = get_json(ep, "/v1/models", timeout=10)
    except (OSError, ValueError) as exc:
        raise QuantspecError(f"{ep.base} is not reachable ({type(exc).__name__}: {exc}).",
                             "check the URL and that the server is up (curl URL/v1/models)") from exc
    names = [m.get("id") for m in models.get("data", [])]
    if ep.model not in names:
        if len(names) == 1 and ep.model in (None, "", ep.base):
            ep.model = names[0]
        else:
            raise QuantspecError(f"{ep.base} does not serve a model named {ep.model!r} (it serves {names}).",
                                 "pass --served-model-name NAME")


def _went_away(alive: Callable[[], bool], wait: float = 3.0) -> bool:
    """Whether the server stops running within ``wait`` s: a server that crashed under a level
    fails its requests a moment before its process has finished exiting."""
    deadline = time.monotonic() + wait
    while alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _measure(ep: Endpoint, tokenizer, tokenizer_path: str | None, warm: list[Request],
             per_level: list[list[Request]], cfg: BenchConfig, entry: dict, alive: Callable[[], bool],
             save: Callable[[], None], say: Say, accuracy: bool = True) -> None:
    from .accuracy import server_lm_eval, server_perplexity

    for r in warm:
        rec = stream_completion(ep, r.prompt, min(r.max_tokens, 16), ignore_eos=cfg.ignore_eos)
        if not rec.ok:
            raise ServerDied(f"warm-up request failed: {rec.error}")
    if cfg.ppl_data and accuracy:
        say(f"{entry['label']}: perplexity on {cfg.ppl_data} through the server")
        entry["accuracy"]["ppl"] = server_perplexity(ep, tokenizer, cfg.ppl_data, cfg.ppl_seqlen, cfg.ppl_windows)
        say(f"{entry['label']}: ppl {entry['accuracy']['ppl']['ppl']:.3f}")
        save()
    if cfg.tasks and accuracy:
        say(f"{entry['label']}: lm-eval {','.join(cfg.tasks)} through the server")
        entry["accuracy"]["lm_eval"] = server_lm_eval(ep, tokenizer_path, cfg.tasks, limit=cfg.task_limit,
                                                      seed=cfg.seed, include_path=cfg.include_path)
        save()
    for level, requests in zip(cfg.levels, per_level):
        if not alive():
            raise ServerDied("the server is no longer running")
        say(f"{entry['label']}: {level} ({len(requests)} requests)")
        sampler = MetricsSampler(ep, cfg.metrics_interval).start()
        records, wall = run_level(ep, requests, level, seed=cfg.seed, duration=cfg.duration,
                                  ignore_eos=cfg.ignore_eos, burstiness=cfg.burstiness)
        engine = sampler.stop()
        row = {"level": str(level), "kind": level.kind, "value": level.value,
               **summarize(records, wall, cfg.slo), "engine_metrics": engine}
        died = row["failed"] > 0 and _went_away(alive)
        if died:
            row["partial"] = True  # the server went away during this level: its figures are not a measurement
        if cfg.keep_records:
            row["records"] = [r.to_dict() for r in records]
        entry["levels"].append(row)
        save()
        t = row["ttft"]["p50_ms"]
        say(f"{entry['label']}: {level}: {row['completed']}/{row['requests']} ok, "
            f"{row['output_throughput']:.1f} tok/s, TTFT p50 {t if t is None else round(t, 1)} ms, "
            f"TPOT p50 {row['tpot']['p50_ms'] and round(row['tpot']['p50_ms'], 1)} ms"
            + (f", goodput {row['goodput']:.2f} req/s" if cfg.slo else ""))
        if died:
            raise ServerDied("the server died during the level")


def serve_bench(targets: list[Target], spec: EngineSpec | None, requests: list[Request], cfg: BenchConfig, *,
                out_dir: Path, json_path: Path, tokenizer=None, tokenizer_path: str | None = None,
                header: dict | None = None, say: Say = lambda m: None) -> dict:
    """Measure every target; returns (and keeps writing to ``json_path``) the result.

    ``requests`` is the pool: each level takes its own ``cfg.num_prompts`` of it and the warm-up
    the next ``cfg.warmup`` (``split_levels``); the JSON says whether any prompt repeats."""
    out_dir.mkdir(parents=True, exist_ok=True)
    warm, per_level, distinct = split_levels(requests, len(cfg.levels), cfg.num_prompts, cfg.warmup)
    result = {"kind": "serve-bench", **(header or {}), "config": cfg.to_dict(), "targets": [],
              "status": "running", "prompts_distinct": distinct}
    if not distinct:
        say("prompts repeat across levels (the workload has fewer than levels x --num-prompts + --warmup): "
            "the engine's prefix cache can answer repeated prefills; pass a larger workload or "
            "--engine-args --no-enable-prefix-caching")

    def save() -> None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(json_path.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(json_path)

    entries: dict[int, dict] = {}
    try:
        for rnd in range(cfg.repeats):
            order = list(range(len(targets)))
            if cfg.repeats > 1:
                random.Random(cfg.seed + rnd).shuffle(order)
            for i in order:
                if i not in entries:
                    t = targets[i]
                    entries[i] = {"label": t.label, "model": t.model, "role": t.role, "speculative": t.speculative,
                                  "status": "running", "accuracy": {}, "levels": []}
                    result["targets"].append(entries[i])
                e = entries[i]
                _serve_round(targets[i], e, rnd, spec, cfg, out_dir, warm, per_level, tokenizer,
                             tokenizer_path, save, say, i + 1)
                if rnd == cfg.repeats - 1:  # its last round: its figures are final
                    if cfg.repeats > 1:
                        e["levels"] = _median_levels(e["rounds"])
                    if e["status"] == "running":
                        e["status"] = "ok"
                save()
        result["status"] = "ok" if all(e["status"] == "ok" for e in result["targets"]) else "partial"
    except KeyboardInterrupt:
        result["status"] = "interrupted"
        for e in result["targets"]:
            if e["status"] == "running":
                e["status"] = "partial"
                e["error"] = "interrupted"
        save()
        raise
    save()
    return result


def _median_levels(rounds: list[dict]) -> list[dict]:
    """Per level (in order), the medians over the rounds that measured it."""
    by: dict[str, list[dict]] = {}
    for rnd in rounds:
        for row in rnd["levels"]:
            if not row.get("partial"):
                by.setdefault(row["level"], []).append(row)
    return [median_rows(rows) for rows in by.values()]


def _measured(entry: dict) -> bool:
    """Whether any round of the target finished a level."""
    return any(r["levels"] for r in entry.get("rounds") or [entry])


def _serve_round(t: Target, entry: dict, rnd: int, spec: EngineSpec | None, cfg: BenchConfig, out_dir: Path,
                 warm, per_level, tokenizer, tokenizer_path, save, say: Say, n: int) -> None:
    """One round of one target: its server started (or its URL checked), warm-up, accuracy in the
    first round, the levels; failures mark the entry, not the run. With repeats the round's rows
    go to ``entry["rounds"]``, else straight to ``entry["levels"]``."""
    into = entry
    if cfg.repeats > 1:
        into = {"label": entry["label"], "round": rnd, "accuracy": entry["accuracy"], "levels": []}
        entry.setdefault("rounds", []).append(into)
    try:
        if t.url:
            ep = Endpoint(t.url, t.label if t.label != t.url else "")
            check_url(ep)
            entry["label"] = into["label"] = ep.model if t.label == t.url else t.label
            into["server"] = {"url": t.url, "started": False}
            _measure(ep, tokenizer, tokenizer_path, warm, per_level, cfg, into, lambda: True, save, say, rnd == 0)
        else:
            assert spec is not None
            run_spec = EngineSpec(spec.engine, spec.python, [*spec.args, *t.engine_args], spec.env,
                                  spec.startup_timeout)
            log = out_dir / (f"server-{n:02d}.log" if cfg.repeats == 1 else f"server-{n:02d}-r{rnd}.log")
            say(f"{t.label}: starting {spec.engine} (log {log})" + (f", round {rnd + 1}/{cfg.repeats}"
                                                                     if cfg.repeats > 1 else ""))
            srv = EngineServer(run_spec, t.model, log=log, name=served_name(t.label))
            into["server"] = {"command": srv.command, "log": str(log), "started": True}
            with srv:
                into["server"]["pid"] = srv.proc.pid  # also its process group
                into["server"]["startup_s"] = round(srv.startup_s, 2)
                say(f"{t.label}: ready in {srv.startup_s:.0f} s on port {srv.port}")
                _measure(srv.endpoint, tokenizer, tokenizer_path, warm, per_level, cfg, into, srv.alive, save, say,
                         rnd == 0)
            into["server"]["exit_code"] = srv.proc.returncode if srv.proc else None
        if into is not entry and "server" not in entry:
            entry["server"] = into["server"]
    except ServerDied as exc:
        entry.update(status="partial" if _measured(entry) else "failed", error=str(exc))
        say(f"{t.label}: {exc}; kept {len(into['levels'])} finished levels")
    except QuantspecError as exc:
        entry.update(status="failed", error=str(exc))
        say(f"{t.label}: failed: {exc}")
    except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:  # an answer we cannot use
        entry.update(status="partial" if _measured(entry) or entry["accuracy"] else "failed",
                     error=f"{type(exc).__name__}: {exc}")
        say(f"{t.label}: failed: {entry['error']}")
