"""The sweep's speed pass: every point timed in interleaved rounds, medians over the rounds.

Timing each point right after its own quantize and eval lets the machine drift between points,
so equal kernels measured unequal (RTN and GPTQ W4 g128 run the same packed shapes, yet their
decode speeds differed by 10-40%). So once every point has its checkpoint, round r times every
point once, in the order rotated by r (each point takes each position once every n rounds); a
point's speed is the median over the rounds of its per-round result, and its speed-up is that
median over the dense model's, timed in the same rounds.

What one timing is (``subprocess_timer``): a fresh ``quantspec bench TARGET --no-baseline-run``
process (one model in memory at a time, whatever its size), i.e. bench's decode path:
transformers eager, a greedy loop over ``DynamicCache``, one ``model()`` call per token, with the
fastest kernel backend (``auto``) in the sweep's dtype; ``repeats`` timed runs after a warm-up,
median. Each record's ``bench["timing"]["decode_path"]`` names it.

Resume: round r's results are kept in ``OUT/speed/round-r/NAME.json``. A round that holds every
point is reused; a partial round is timed again from its start; when the timed points or the
speed settings change, every round is timed again (results are comparable only within a round).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

Progress = Callable[[str], None]

INTERLEAVED = ("{rounds} interleaved rounds, each timing every point once (order rotated per round) "
               "in a fresh `quantspec bench --no-baseline-run` process; per point the median over the "
               "rounds; speed-up = that median over the dense model's, timed in the same rounds")


@dataclass(frozen=True)
class Timed:
    """One model the speed pass times: a sweep point, or the dense baseline."""

    name: str
    target: str  # the checkpoint folder or the dense model spec


Timer = Callable[[Timed, Path], dict[str, Any]]  # (what, json path) -> `quantspec bench` JSON


def round_order(names: list[str], r: int) -> list[str]:
    """Round r's timing order: ``names`` rotated left by r."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def median_of(runs: list[Any]) -> Any:
    """The runs' common structure with every number replaced by the median over the runs
    (dicts key by key, as in the first run; strings and other leaves from the first run)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs if isinstance(r, dict) and k in r]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(runs)
    return first


def bench_argv(target: str, cfg, json_path: Path) -> list[str]:
    """The ``quantspec bench`` command line that times one model once (no baseline)."""
    sp = cfg.speed
    argv = [sys.executable, "-m", "quantspec", "bench", target, "--json", str(json_path), "--no-progress",
            "--no-baseline-run", "--prompt-lengths", *map(str, sp.prompt_lengths),
            "--batch-sizes", *map(str, sp.batch_sizes), "--new-tokens", str(sp.new_tokens),
            "--repeats", str(sp.repeats), "--dtype", cfg.dtype]
    return argv + (["--device", cfg.device] if cfg.device else [])


def subprocess_timer(cfg) -> Timer:
    """Time one model in its own ``quantspec bench`` process (log beside the JSON)."""

    def run(what: Timed, json_path: Path) -> dict[str, Any]:
        argv = bench_argv(what.target, cfg, json_path)
        log = json_path.with_suffix(".log")
        with open(log, "w") as fh:
            fh.write(" ".join(argv) + "\n")
            fh.flush()
            proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
        if proc.returncode != 0 or not json_path.is_file():
            raise RuntimeError(f"bench of {what.name} failed (exit {proc.returncode}); log {log}")
        return json.loads(json_path.read_text())

    return run


def _fingerprint(cfg, timed: list[Timed]) -> dict[str, Any]:
    """What the rounds on disk must have timed to be reused (as it reads back from JSON)."""
    data = {"points": [asdict(t) for t in timed], "speed": asdict(cfg.speed), "dtype": cfg.dtype,
            "device": cfg.device}
    return json.loads(json.dumps(data))


def _round_results(folder: Path, order: list[str], timed: dict[str, Timed], timer: Timer,
                   say: Progress) -> dict[str, dict[str, Any]]:
    """One round: every model timed once in ``order`` (reused when the round is complete)."""
    files = {n: folder / f"{n}.json" for n in order}
    if folder.is_dir() and all(f.is_file() for f in files.values()):
        say(f"speed {folder.name}: done before, reused")
        return {n: json.loads(f.read_text()) for n, f in files.items()}
    shutil.rmtree(folder, ignore_errors=True)  # a partial round is timed again from its start
    folder.mkdir(parents=True)
    out = {}
    for name in order:
        say(f"speed {folder.name}: {name} ...")
        try:
            out[name] = timer(timed[name], files[name])
        except Exception as exc:  # a failing bench is recorded; the other points go on
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        files[name].write_text(json.dumps(out[name], indent=2) + "\n")
    return out


def decode_path(model: dict[str, Any], device: str) -> str:
    return (f"transformers eager (greedy loop over DynamicCache, one model() call per token); "
            f"kernels {model.get('backend')}; dtype {model.get('dtype')}; device {device}")


def merge_runs(runs: list[dict[str, Any]], dense: dict[str, Any] | None, rounds: int) -> dict[str, Any]:
    """One model's bench record from its per-round bench JSONs (errors left out): medians, the
    speed-ups against the dense model's medians, and how it was timed."""
    from .speed import RUN_PROTOCOL, speedups

    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": "; ".join(r["error"] for r in runs)}
    model = median_of([r["model"] for r in ok])
    merged_dense = None if dense is None or model.get("kind") == "dense" else dense.get("model")
    first_batch = next(iter(model["decode"]))
    return {
        "protocol": f"{RUN_PROTOCOL}; {INTERLEAVED.format(rounds=rounds)}",
        "machine": ok[0].get("machine"), "config": ok[0].get("config"), "device": ok[0].get("device"),
        "model": model, "dense": merged_dense,
        "speedup": speedups(model, merged_dense) if merged_dense else None,
        "timing": {"rounds": len(ok), "decode_path": decode_path(model, ok[0].get("device")),
                   "decode_tokens_per_s_per_round": [r["model"]["decode"][first_batch]["tokens_per_s"] for r in ok]},
    }


def time_interleaved(cfg, out: Path, timed: list[Timed], timer: Timer, rounds: int,
                     progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """Time every model of ``timed`` in ``rounds`` interleaved rounds; {name: bench record}.

    ``timed`` must hold the dense baseline under the name "dense" (speed-ups are against it)."""
    say = progress or (lambda _m: None)
    folder = out / "speed"
    stamp = folder / "timed.json"
    want = _fingerprint(cfg, timed)
    if stamp.is_file() and json.loads(stamp.read_text()) != want:
        say("speed: the points or settings changed since the last pass; timing every round again")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(want, indent=2) + "\n")
    by_name = {t.name: t for t in timed}
    names = [t.name for t in timed]
    per_round = [_round_results(folder / f"round-{r}", round_order(names, r), by_name, timer, say)
                 for r in range(rounds)]
    runs = {n: [res[n] for res in per_round] for n in names}
    dense = merge_runs(runs["dense"], None, rounds)
    dense = None if "error" in dense else dense
    return {n: merge_runs(runs[n], dense, rounds) for n in names}
