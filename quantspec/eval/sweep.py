"""Sweeps: quantize a model over a grid of recipes, evaluate every point, write one report.

A sweep YAML maps 1:1 onto ``SweepConfig`` (unknown keys and mistyped values are errors)::

    model: smollm2-135m
    grid: {methods: [rtn, gptq], bits: [4], group_sizes: [128], formats: [gptq]}
    points: [{method: smoothquant, bits: 8, group_size: -1, format: compressed-tensors}]
    eval: {ppl: [wikitext2], seqlen: 512, windows: 20, tasks: [], speed: true}
    speed: {prompt_lengths: [128], batch_sizes: [1], new_tokens: 16, repeats: 3, rounds: 3}

The whole sweep is checked when it is loaded, before any point runs: every setting, and every
point's quantize command as ``quantspec quantize`` would parse and resolve it (``sweep_check``).
Every point (the dense baseline is one too) runs as subprocesses of the ``quantspec`` CLI
(``sweep_steps``): ``quantize ... --json`` and ``eval ... --json`` (and the lm-eval shim for tasks), each step's
JSON cached in ``OUT/points/NAME/``. Accuracy is measured on the scheme each checkpoint declares
(``eval`` and the lm-eval model default to the ``exact`` kernel backend; their JSON names it).
Resumable: a point whose ``result.json`` exists is not run again, and within a point a step whose
JSON exists is skipped. A failing point is recorded in ``error.json`` (and retried on the next
run); the sweep goes on. Speed is timed last, for every point that succeeded (finished before or
not), in interleaved rounds (``sweep_speed``: equal kernels then measure equal).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import QuantspecError, one_line
from ..strict import check_types, reject_unknown
from .sweep_check import (
    check_data_name,
    check_point,
    check_settings,
    command_words,
    from_dict_typed,
    point_words,
    quantize_parser,
)
from .sweep_speed import Timed, Timer, subprocess_timer, time_interleaved
from .sweep_steps import point_steps, point_target

Progress = Callable[[str], None]


@dataclass(frozen=True)
class GridConfig:
    methods: tuple[str, ...] = ("rtn",)
    bits: tuple[int, ...] = (4,)
    group_sizes: tuple[int, ...] = (128,)
    formats: tuple[str, ...] = ("gptq",)


@dataclass(frozen=True)
class EvalConfig:
    ppl: tuple[str, ...] = ("wikitext2",)
    seqlen: int = 512
    windows: int = 20
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    include_path: str | None = None
    speed: bool = True

    def __post_init__(self) -> None:
        if self.seqlen < 2:
            raise QuantspecError(f"sweep eval.seqlen must be at least 2, got {self.seqlen}.", "set e.g. eval: {seqlen: 512}.")
        if self.windows < 0:
            raise QuantspecError(f"sweep eval.windows must be 0 (all) or more, got {self.windows}.",
                                 "set e.g. eval: {windows: 20}.")
        if self.limit is not None and self.limit < 1:
            raise QuantspecError(f"sweep eval.limit must be at least 1 or null (every example), got {self.limit}.",
                                 "set e.g. eval: {limit: 100}, or null.")
        for name in self.ppl:
            check_data_name(name, "eval.ppl")
        if self.include_path is not None and not Path(self.include_path).expanduser().is_dir():
            raise QuantspecError(f"sweep eval.include_path {self.include_path} is not a folder.",
                                 "give the folder of your lm-eval task YAMLs, or null.")


@dataclass(frozen=True)
class SpeedSettings:
    prompt_lengths: tuple[int, ...] = (128,)
    batch_sizes: tuple[int, ...] = (1,)
    new_tokens: int = 16
    repeats: int = 3  # timed runs per bench process (median)
    rounds: int = 3  # interleaved rounds over all points (median over rounds; see sweep_speed)

    def __post_init__(self) -> None:  # what the bench (eval.speed.SpeedConfig) would refuse, refused here first
        if self.repeats < 1 or self.rounds < 1:
            raise QuantspecError(f"speed needs repeats >= 1 and rounds >= 1, got {self.repeats} and {self.rounds}.",
                                 "set e.g. speed: {repeats: 3, rounds: 3}.")
        for key in ("prompt_lengths", "batch_sizes"):
            values = getattr(self, key)
            if not values or min(values) < 1:
                raise QuantspecError(f"sweep speed.{key} needs at least one value, each at least 1, got {list(values)}.",
                                     f"set e.g. speed: {{{key}: [{128 if key == 'prompt_lengths' else 1}]}}.")
        if self.new_tokens < 2:
            raise QuantspecError(f"sweep speed.new_tokens must be at least 2 (the first token and one more), "
                                 f"got {self.new_tokens}.", "set e.g. speed: {new_tokens: 16}.")


@dataclass(frozen=True)
class ServeSettings:
    """The serving stage: every point that succeeded served in an engine (``quantspec
    serve-bench``), after the other stages; absent from the YAML = no serving stage."""

    engine_python: str | None = None  # python of the engine's venv (default: this one)
    engine_args: tuple[str, ...] = ()
    engine_env: tuple[str, ...] = ()  # KEY=VALUE
    concurrency: str | None = "1,4,16"
    rate: str | None = None
    slo: str | None = None
    dataset: str = "c4-bundled-heldout"
    num_prompts: int = 32
    output_len: int | None = None
    ppl: str | None = "wikitext2"  # perplexity through the server (None: not measured)

    def __post_init__(self) -> None:
        from ..serving.load import parse_levels
        from ..serving.slo import parse_slo

        parse_levels(self.rate, None if self.rate else self.concurrency)
        parse_slo(self.slo)
        if self.num_prompts < 1:
            raise QuantspecError(f"serve.num_prompts must be at least 1, got {self.num_prompts}.", "e.g. 32")

    def argv(self, targets: list[str], out: Path, seqlen: int, windows: int) -> list[str]:
        a = [sys.executable, "-m", "quantspec", "serve-bench", *targets, "--baseline", "none",
             "--dataset", self.dataset, "--num-prompts", str(self.num_prompts), "--out", str(out), "--no-progress"]
        a += ["--rate", self.rate] if self.rate else ["--concurrency", str(self.concurrency)]
        a += ["--engine-python", self.engine_python] if self.engine_python else []
        a += ["--engine-args", " ".join(self.engine_args)] if self.engine_args else []
        a += [x for kv in self.engine_env for x in ("--engine-env", kv)]
        a += ["--slo", self.slo] if self.slo else []
        a += ["--output-len", str(self.output_len)] if self.output_len else []
        a += ["--ppl", self.ppl, "--ppl-seqlen", str(seqlen), "--ppl-windows", str(windows)] if self.ppl else []
        return a


@dataclass(frozen=True)
class SweepPoint:
    """One point: method None is the dense baseline."""

    method: str | None = None
    bits: int = 16
    group_size: int = -1
    format: str | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def is_dense(self) -> bool:
        return self.method is None

    @property
    def name(self) -> str:
        if self.is_dense:
            return "dense"
        g = "pc" if self.group_size == -1 else str(self.group_size)
        return f"{self.method.replace('+', '-')}-w{self.bits}g{g}-{self.format}"

    def validate(self) -> None:
        """Raise QuantspecError when the recipe it stands for is impossible."""
        from ..quant.recipe import Recipe
        from ..core.scheme import QuantScheme

        if self.is_dense:
            return
        acts = "int8-token-dynamic" if self.method == "smoothquant" else None
        Recipe(name=self.name, method=self.method, format=self.format,
               scheme=QuantScheme(bits=self.bits, group_size=self.group_size, activations=acts))


@dataclass(frozen=True)
class SweepConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str | None = None
    dense: bool = True
    grid: GridConfig = field(default_factory=GridConfig)
    points: tuple[SweepPoint, ...] = ()
    quantize_args: tuple[str, ...] = ()
    eval: EvalConfig = field(default_factory=EvalConfig)
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    serve: ServeSettings | None = None
    timeout_s: int = 3600

    def __post_init__(self) -> None:
        """Every sweep-wide setting and every point checked now, before any point runs."""
        check_settings(self)
        parser = quantize_parser()
        for point in self.all_points():
            check_point(point, self, parser)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SweepConfig":
        """The config of a sweep YAML's mapping: unknown keys and mistyped values are QuantspecErrors
        (a string where a list belongs is not read letter by letter, "no" is not true)."""
        data = dict(data)
        reject_unknown(cls, data, "sweep")
        data["quantize_args"] = command_words(data.get("quantize_args"), "quantize_args")
        for key, sub in (("grid", GridConfig), ("eval", EvalConfig), ("speed", SpeedSettings)):
            data[key] = from_dict_typed(sub, data.get(key), key)
        if data.get("serve") is not None:
            data["serve"] = from_dict_typed(ServeSettings, data["serve"], "serve")
        points = data.get("points")
        if points is not None and not isinstance(points, list):
            raise QuantspecError(f"sweep points must be a list of mappings, got {one_line(repr(points), 80)}.",
                                 "write points: [{method: rtn, bits: 8, group_size: -1, format: gptq}].")
        data["points"] = tuple(from_dict_typed(SweepPoint, point_words(p, i), f"points[{i}]")
                               for i, p in enumerate(points or ()))
        check_types(cls, data, "sweep")  # the sections are built: the plain values are left
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "SweepConfig":
        import yaml

        p = Path(path)
        if not p.is_file():
            raise QuantspecError(f"sweep file {p} does not exist.", "check the path (see recipes/sweep-default.yaml).")
        data = yaml.safe_load(p.read_text())
        if not isinstance(data, dict):
            raise QuantspecError(f"sweep file {p} must be a YAML mapping.", "see recipes/sweep-default.yaml.")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def all_points(self) -> list[SweepPoint]:
        """The dense baseline first, then the grid, then the explicit points (duplicates dropped)."""
        pts = [SweepPoint()] if self.dense else []
        g = self.grid
        for m, b, gs, f in itertools.product(g.methods, g.bits, g.group_sizes, g.formats):
            pts.append(SweepPoint(method=m, bits=b, group_size=gs, format=f))
        pts += list(self.points)
        seen: dict[str, SweepPoint] = {}
        for p in pts:
            if p.name in seen and p != seen[p.name]:  # same name, other extra_args: one would be lost
                raise QuantspecError(f"sweep point {p.name} is given twice, with extra_args {list(seen[p.name].extra_args)} "
                                     f"and {list(p.extra_args)}.", "give each point (method, bits, group size, format) once.")
            seen.setdefault(p.name, p)
        return list(seen.values())


def default_sweep_path() -> Path:
    """recipes/sweep-default.yaml, shipped in the package (quantspec/recipes)."""
    from ..quant.pipeline import RECIPES_DIR

    cand = RECIPES_DIR / "sweep-default.yaml"
    if cand.is_file():
        return cand
    raise QuantspecError("recipes/sweep-default.yaml was not found.", "pass a sweep YAML: quantspec sweep SWEEP.yaml.")


# ---------------------------------------------------------------- running one point


def _lmeval_file(folder: Path) -> dict[str, Any]:
    """lm-eval's latest results JSON under ``folder`` ({} when none)."""
    files = sorted(folder.rglob("results_*.json"))
    return json.loads(files[-1].read_text()) if files else {}


def _lmeval_results(folder: Path) -> dict[str, Any]:
    res = _lmeval_file(folder).get("results", {})
    return {t: {k.split(",")[0]: v for k, v in m.items() if "stderr" not in k and k != "alias"} for t, m in res.items()}


def collect_point(point: SweepPoint, folder: Path) -> dict[str, Any]:
    """Read the steps' JSON files into one result dict."""
    from ..checkpoint.save import folder_size_bytes

    def read(name):
        p = folder / name
        return json.loads(p.read_text()) if p.is_file() else None

    out: dict[str, Any] = {"quantize": read("quantize.json"), "eval": read("eval.json"), "bench": None,
                           "tasks": _lmeval_results(folder / "lmeval") if (folder / "lmeval").exists() else None}
    if out["tasks"] is not None:  # the kernels that computed the task accuracies (QuantspecLM.get_model_info)
        out["tasks_kernels"] = _lmeval_file(folder / "lmeval").get("config", {}).get("quantspec_kernels")
    ckpt = folder / "checkpoint"
    if ckpt.is_dir():
        out["size_mb"] = round(folder_size_bytes(ckpt) / 2**20, 3)
    else:  # the dense point: its weights as a 16-bit checkpoint, as `quantspec eval` measured them
        out["size_mb"] = (out["eval"] or {}).get("size_mb")
    return out


def subprocess_runner(point: SweepPoint, cfg: SweepConfig, folder: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Run a point's steps as CLI subprocesses (skipping steps whose JSON exists); return its results."""
    say = progress or (lambda _m: None)
    for step in point_steps(point, cfg, folder):
        if step.json_path.exists():
            say(f"{point.name}: {step.name} done before, skipped")
            continue
        say(f"{point.name}: {step.name} ...")
        log = folder / f"{step.name}.log"
        start = time.perf_counter()
        with open(log, "w") as fh:
            fh.write(" ".join(step.argv) + "\n")
            fh.flush()
            proc = subprocess.run(step.argv, stdout=fh, stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
        if proc.returncode != 0 or not step.json_path.exists():
            tail = log.read_text()[-3000:]
            last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
            raise RuntimeError(f"step {step.name} failed (exit {proc.returncode}): {last.strip()[:300]}\nlog {log}:\n{tail}")
        say(f"{point.name}: {step.name} done in {time.perf_counter() - start:.0f}s")
    return collect_point(point, folder)


# ---------------------------------------------------------------- the sweep

Runner = Callable[[SweepPoint, SweepConfig, Path], dict[str, Any]]


def run_point(point: SweepPoint, cfg: SweepConfig, out: Path, runner: Runner) -> tuple[dict[str, Any], bool]:
    """Run (or reuse) one point. Returns (record, ran)."""
    folder = out / "points" / point.name
    folder.mkdir(parents=True, exist_ok=True)
    result_path, error_path = folder / "result.json", folder / "error.json"
    base = {"name": point.name, "point": asdict(point)}
    if result_path.is_file():
        return json.loads(result_path.read_text()), False
    try:
        point.validate()
        start = time.perf_counter()
        results = runner(point, cfg, folder)
        record = {**base, "status": "ok", "seconds": round(time.perf_counter() - start, 1), **results}
        result_path.write_text(json.dumps(record, indent=2) + "\n")
        error_path.unlink(missing_ok=True)
    except Exception as exc:  # a failing point is recorded, not fatal
        record = {**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
        error_path.write_text(json.dumps(record, indent=2) + "\n")
    return record, True


def run_sweep(cfg: SweepConfig, out: str | Path, runner: Runner | None = None,
              progress: Progress | None = None, timer: Timer | None = None) -> dict[str, Any]:
    """Run every point (resumably), time the ones that succeeded in interleaved rounds (when
    ``eval.speed``), and write report.json/.md/.png/.html into ``out``.

    ``runner`` runs one point's steps, ``timer`` times one model once (tests pass fakes)."""
    from .report import write_report

    say = progress or (lambda _m: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if runner is None:
        def runner(p, c, f):
            return subprocess_runner(p, c, f, say)
    points = cfg.all_points()
    records = []
    for i, point in enumerate(points, 1):
        say(f"[{i}/{len(points)}] {point.name}")
        record, ran = run_point(point, cfg, out, runner)
        say(f"[{i}/{len(points)}] {point.name}: {record['status']}" + ("" if ran else " (cached)")
            + (f" - {record['error'][:200]}" if record["status"] == "failed" else ""))
        records.append(record)
    if cfg.eval.speed:
        time_points(cfg, out, list(zip(points, records)), timer or subprocess_timer(cfg), say)
    serving = serve_points(cfg, out, list(zip(points, records)), say) if cfg.serve else None
    return write_report(cfg, records, out, serving=serving)


def serve_points(cfg: SweepConfig, out: Path, done: list[tuple[SweepPoint, dict[str, Any]]],
                 say: Progress) -> dict[str, Any] | None:
    """The serving stage: one ``quantspec serve-bench`` over the dense model and every point that
    succeeded, in OUT/serve/ (reused when a finished run exists); its result, or None (said)."""
    from ..models.source import dense_folder

    folder = out / "serve"
    result = folder / "serve-bench.json"
    if result.is_file():
        previous = json.loads(result.read_text())
        if previous.get("status") == "ok":
            say("serve: done before, reused")
            return previous
    targets = [str(dense_folder(cfg.model)) if p.is_dense else point_target(p, cfg, out / "points" / p.name)
               for p, rec in done if rec["status"] == "ok"]
    if not targets:
        return None
    argv = cfg.serve.argv(targets, folder, cfg.eval.seqlen, cfg.eval.windows)
    say(f"serve: {len(targets)} targets in {cfg.serve.engine_python or 'this python'}'s engine")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "serve.log", "w") as fh:
        fh.write(" ".join(argv) + "\n")
        fh.flush()
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
    if not result.is_file():
        say(f"serve: failed (exit {proc.returncode}), see {folder / 'serve.log'}")
        return None
    return json.loads(result.read_text())


def time_points(cfg: SweepConfig, out: Path, done: list[tuple[SweepPoint, dict[str, Any]]], timer: Timer,
                say: Progress) -> None:
    """Time the dense model and every point that succeeded, interleaved (``sweep_speed``); each
    such record gets its "bench" (medians over the rounds, speed-up against the dense model), or
    "speed_error" when every timing of it failed."""
    ok = [(p, rec) for p, rec in done if rec["status"] == "ok"]
    timed = [Timed("dense", cfg.model)] + [Timed(p.name, point_target(p, cfg, out / "points" / p.name))
                                           for p, _ in ok if not p.is_dense]
    benches = time_interleaved(cfg, out, timed, timer, cfg.speed.rounds, say)
    for p, rec in ok:
        bench = benches["dense" if p.is_dense else p.name]
        rec["bench"] = None if "error" in bench else bench
        if "error" in bench:
            rec["speed_error"] = bench["error"]
