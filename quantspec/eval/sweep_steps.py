"""The CLI commands one sweep point runs (``point_steps``): quantize, perplexity, lm-eval tasks."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sweep import SweepConfig, SweepPoint


@dataclass
class Step:
    name: str
    argv: list[str]
    json_path: Path


def point_target(point: SweepPoint, cfg: SweepConfig, folder: Path) -> str:
    """What a point evaluates: its checkpoint folder, or the dense model spec."""
    return cfg.model if point.is_dense else str(folder / "checkpoint")


def point_steps(point: SweepPoint, cfg: SweepConfig, folder: Path) -> list[Step]:
    """The CLI invocations of one point, in order (speed is timed later, in ``sweep_speed``)."""
    q = [sys.executable, "-m", "quantspec"]
    common = ["--dtype", cfg.dtype] + (["--device", cfg.device] if cfg.device else [])
    target = point_target(point, cfg, folder)
    steps = []
    if not point.is_dense:
        w8a8 = point.method == "smoothquant"  # --w8a8 fixes bits and group size (8, per channel: validate checks)
        argv = q + ["quantize", cfg.model, "--method", point.method, "--format", point.format,
                    "--out", target, "--json", str(folder / "quantize.json"), "--no-compare", "--no-progress"]
        argv += ["--w8a8"] if w8a8 else ["--bits", str(point.bits), "--group-size", str(point.group_size)]
        argv += ["--overwrite"]  # a half-written checkpoint of an earlier failed attempt
        steps.append(Step("quantize", argv + list(cfg.quantize_args) + list(point.extra_args), folder / "quantize.json"))
    ev = cfg.eval
    if ev.ppl:
        argv = q + ["eval", target, *[a for d in ev.ppl for a in ("--ppl", d)], "--seqlen", str(ev.seqlen),
                    "--windows", str(ev.windows), "--no-progress", "--json", str(folder / "eval.json"), *common]
        steps.append(Step("eval", argv, folder / "eval.json"))
    if ev.tasks:
        argv = [sys.executable, "-m", "quantspec.eval.lmeval_adapter", "--model", "quantspec",
                "--model_args", f"path={target},dtype={cfg.dtype},backend=exact", "--tasks", *ev.tasks,
                "--output_path", str(folder / "lmeval"), "--device", cfg.device or "cpu"]
        argv += (["--limit", str(ev.limit)] if ev.limit else []) + (["--include_path", ev.include_path] if ev.include_path else [])
        steps.append(Step("tasks", argv, folder / "lmeval"))
    return steps
