"""Sweeps and the report: resumable points, recorded failures, report files that hold the numbers,
and the speed pass (interleaved rounds, medians) driven by a fake timing function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantspec.eval.report_plot import pareto_front
from quantspec.eval.sweep import SweepConfig, SweepPoint, collect_point, run_sweep
from quantspec.eval.sweep_steps import point_steps
from quantspec.eval.sweep_speed import Timed, bench_argv, median_of, round_order

REPO = Path(__file__).resolve().parents[1]

NUMBERS = {  # name -> (ppl, decode tokens/s, speed-up, size MB)
    "dense": (20.0, 100.0, 1.0, 540.0),
    "rtn-w4g128-gptq": (23.5, 130.0, 1.3, 95.0),
    "gptq-w4g128-gptq": (21.25, 128.0, 1.28, 95.5),
}


def fake_bench(name: str, tps: float) -> dict:
    """What `quantspec bench DIR --no-baseline-run --json` writes, with decode ``tps``."""
    size = NUMBERS[name][3]
    kind = "dense" if name == "dense" else "quantized"
    model = {"kind": kind, "backend": "torch dense" if kind == "dense" else "cpu", "dtype": "float32",
             "weights_mb": size, "disk_mb": size if kind == "quantized" else None,
             "decode": {"1": {"tokens_per_s": tps, "ttft_ms": 5.0, "tpot_ms_p50": 1.0, "tpot_ms_p95": 2.0}},
             "prefill": {"128": {"tokens_per_s": 10 * tps, "seconds": 0.1}}}
    return {"model": model, "dense": None, "speedup": None, "protocol": "fake", "device": "cpu",
            "machine": {"cpu": "test", "gpus": [], "versions": {"torch": "x"}}}


class FakeTimer:
    """Times nothing: returns scripted decode tokens/s per (name, round) and logs the calls."""

    def __init__(self, tps: dict[str, list[float]] | None = None, fail: set[tuple[str, int]] = frozenset()):
        self.tps = tps or {n: [v[1]] * 3 for n, v in NUMBERS.items()}
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def __call__(self, what: Timed, json_path: Path) -> dict:
        r = int(json_path.parent.name.removeprefix("round-"))
        self.calls.append((what.name, r))
        if (what.name, r) in self.fail:
            raise RuntimeError("bench crashed")
        return fake_bench(what.name, self.tps[what.name][r])


class FakeRunner:
    def __init__(self, fail: set[str] = frozenset()):
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, point: SweepPoint, cfg: SweepConfig, folder: Path) -> dict:
        self.calls.append(point.name)
        if point.name in self.fail:
            raise RuntimeError(f"step quantize failed for {point.name}")
        ppl = NUMBERS[point.name][0]
        return {"eval": {"ppl": {"wikitext2": ppl}, "seqlen": 512, "windows": 20, "tokens": 10240},
                "bench": None, "tasks": None, "quantize": None,
                "size_mb": None if point.is_dense else NUMBERS[point.name][3]}


def _cfg(**kw) -> SweepConfig:
    data = {"model": "tiny", "grid": {"methods": ["rtn", "gptq"], "bits": [4], "group_sizes": [128], "formats": ["gptq"]},
            "eval": {"ppl": ["wikitext2"], "seqlen": 512, "windows": 20}}
    data.update(kw)
    return SweepConfig.from_dict(data)


def test_sweep_report_holds_the_numbers(tmp_path):
    runner = FakeRunner()
    report = run_sweep(_cfg(), tmp_path, runner=runner, timer=FakeTimer())
    assert runner.calls == ["dense", "rtn-w4g128-gptq", "gptq-w4g128-gptq"]
    for name in ("report.json", "report.md", "report.png", "report.html", "sweep.json"):
        assert (tmp_path / name).is_file(), name
    data = json.loads((tmp_path / "report.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["gptq-w4g128-gptq"]["ppl"] == 21.25
    assert rows["gptq-w4g128-gptq"]["ppl_delta"] == pytest.approx(1.25)
    assert rows["rtn-w4g128-gptq"]["speedup"] == 1.3 and rows["dense"]["speedup"] == 1.0
    assert rows["dense"]["size_mb"] == 540.0 and rows["rtn-w4g128-gptq"]["size_mb"] == 95.0
    assert {"torch", "transformers", "quantspec"} <= set(data["versions"]) or data["versions"] == {"torch": "x"}
    assert "windows of 512 tokens" in data["protocol"]["perplexity"]
    md = (tmp_path / "report.md").read_text()
    assert "| gptq-w4g128-gptq | gptq | 4 | 128 | gptq | 95.5 | 21.250 | +1.250 |" in md
    assert "1.30x" in md
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(tmp_path / "report.png") as im:
        assert im.size[0] > 600 and im.size[1] > 300
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in html and "21.250" in html and "<table>" in html
    assert report["rows"] == data["rows"]


def test_resume_skips_finished_points_and_retries_failed(tmp_path):
    first = FakeRunner(fail={"rtn-w4g128-gptq"})
    report = run_sweep(_cfg(), tmp_path, runner=first, timer=FakeTimer())
    assert first.calls == ["dense", "rtn-w4g128-gptq", "gptq-w4g128-gptq"]
    failed = [r for r in report["rows"] if r["status"] == "failed"]
    assert [r["name"] for r in failed] == ["rtn-w4g128-gptq"] and "quantize failed" in failed[0]["error"]
    err = json.loads((tmp_path / "points" / "rtn-w4g128-gptq" / "error.json").read_text())
    assert err["status"] == "failed" and "RuntimeError" in err["error"]
    assert "FAILED" in (tmp_path / "report.md").read_text()

    second = FakeRunner()
    report = run_sweep(_cfg(), tmp_path, runner=second, timer=FakeTimer())
    assert second.calls == ["rtn-w4g128-gptq"]  # only the failed point runs again
    assert all(r["status"] == "ok" for r in report["rows"])
    assert not (tmp_path / "points" / "rtn-w4g128-gptq" / "error.json").exists()

    third, timer = FakeRunner(), FakeTimer()
    run_sweep(_cfg(), tmp_path, runner=third, timer=timer)
    assert third.calls == [] and timer.calls == []  # the complete speed rounds are reused too


def test_impossible_point_is_refused_before_anything_runs(tmp_path):
    from quantspec.errors import QuantspecError

    with pytest.raises(QuantspecError, match="smoothquant-w4g128-gptq"):
        _cfg(dense=False, grid={"methods": ["rtn"], "bits": [4], "group_sizes": [128], "formats": ["gptq"]},
             points=[{"method": "smoothquant", "bits": 4, "group_size": 128, "format": "gptq"}])


def test_sweep_yaml_is_strict_and_default_parses(tmp_path):
    from quantspec.errors import QuantspecError

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ngrid: {method: [rtn]}\n")
    with pytest.raises(QuantspecError, match="unknown field"):
        SweepConfig.from_yaml(bad)
    bad.write_text("model: x\nspeed: {rounds: 0}\n")
    with pytest.raises(QuantspecError, match="rounds >= 1"):
        SweepConfig.from_yaml(bad)
    cfg = SweepConfig.from_yaml(REPO / "recipes" / "sweep-default.yaml")
    names = [p.name for p in cfg.all_points()]
    assert names[0] == "dense" and len(names) == len(set(names)) >= 4
    for p in cfg.all_points():
        p.validate()


def test_point_steps_parse_with_the_real_cli(tmp_path):
    """Every generated command line is accepted by the quantspec parser (flags exist)."""
    from quantspec.cli.main import build_parser

    cfg = SweepConfig.from_yaml(REPO / "recipes" / "sweep-default.yaml")
    parser = build_parser()
    points = cfg.all_points() + [SweepPoint("smoothquant", 8, -1, "compressed-tensors")]
    for point in points:
        for step in point_steps(point, cfg, tmp_path / point.name):
            if step.argv[2] != "quantspec":
                continue  # the lm-eval shim has its own parser
            args = parser.parse_args(step.argv[3:])
            assert args.command == step.name
            if step.name == "quantize":
                assert args.method == point.method and args.bits == (None if args.w8a8 else point.bits)
                assert args.w8a8 == (point.method == "smoothquant")
            if step.name == "eval":
                assert args.ppl == ["wikitext2"] and args.windows == 20
                assert args.backend == "exact"
        bench = parser.parse_args(bench_argv(str(tmp_path / point.name), cfg, tmp_path / "b.json")[3:])
        assert bench.command == "bench" and bench.measure_baseline is False and bench.backend == "auto"
        assert bench.repeats == cfg.speed.repeats and bench.batch_sizes == list(cfg.speed.batch_sizes)


def test_pareto_front():
    pts = [(1.0, 10.0), (2.0, 12.0), (3.0, 11.0), (2.5, 9.0)]  # x higher better, y lower better
    # (2.5, 9) beats (1, 10) and (2, 12); (3, 11) is the fastest: the front, sorted by x
    assert pareto_front(pts, x_higher=True, y_higher=False) == [3, 2]
    assert pareto_front(pts, x_higher=False, y_higher=False) == [0, 3]


def test_round_order_rotates_and_median_of_takes_every_number():
    names = ["dense", "a", "b"]
    assert [round_order(names, r) for r in range(4)] == [
        ["dense", "a", "b"], ["a", "b", "dense"], ["b", "dense", "a"], ["dense", "a", "b"]]
    runs = [{"x": 1.0, "t": {"1": 5}, "s": "first"}, {"x": 9.0, "t": {"1": 7}, "s": "second"},
            {"x": 2.0, "t": {"1": 6}, "s": "third"}]
    assert median_of(runs) == {"x": 2.0, "t": {"1": 6}, "s": "first"}


SCRIPT = {"dense": [100.0, 10.0, 110.0], "rtn-w4g128-gptq": [130.0, 500.0, 120.0],
          "gptq-w4g128-gptq": [128.0, 131.0, 20.0]}


def test_speed_is_timed_in_interleaved_rounds_with_medians(tmp_path):
    timer = FakeTimer(SCRIPT)
    report = run_sweep(_cfg(), tmp_path, runner=FakeRunner(), timer=timer)
    # every point once per round, after all points finished their steps; the order rotates
    assert timer.calls == [("dense", 0), ("rtn-w4g128-gptq", 0), ("gptq-w4g128-gptq", 0),
                           ("rtn-w4g128-gptq", 1), ("gptq-w4g128-gptq", 1), ("dense", 1),
                           ("gptq-w4g128-gptq", 2), ("dense", 2), ("rtn-w4g128-gptq", 2)]
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["dense"]["tokens_per_s"] == 100.0 and rows["dense"]["speedup"] == 1.0
    assert rows["rtn-w4g128-gptq"]["tokens_per_s"] == 130.0  # median of 130, 500, 120
    assert rows["gptq-w4g128-gptq"]["tokens_per_s"] == 128.0  # median of 128, 131, 20
    assert rows["rtn-w4g128-gptq"]["speedup"] == 1.3 and rows["gptq-w4g128-gptq"]["speedup"] == 1.28
    bench = next(p for p in report["points"] if p["name"] == "gptq-w4g128-gptq")["bench"]
    assert bench["timing"]["decode_tokens_per_s_per_round"] == [128.0, 131.0, 20.0]
    assert bench["timing"]["decode_path"].startswith("transformers eager")
    assert "kernels cpu; dtype float32" in bench["timing"]["decode_path"]
    assert bench["model"]["prefill"]["128"]["tokens_per_s"] == 1280.0
    assert "3 interleaved rounds" in bench["protocol"]


def test_speed_resume_retimes_a_partial_round_and_everything_when_points_change(tmp_path):
    run_sweep(_cfg(), tmp_path, runner=FakeRunner(), timer=FakeTimer(SCRIPT))
    (tmp_path / "speed" / "round-1" / "gptq-w4g128-gptq.json").unlink()  # as if killed mid-round
    timer = FakeTimer(SCRIPT)
    report = run_sweep(_cfg(), tmp_path, runner=FakeRunner(), timer=timer)
    assert timer.calls == [("rtn-w4g128-gptq", 1), ("gptq-w4g128-gptq", 1), ("dense", 1)]
    assert {r["name"]: r["tokens_per_s"] for r in report["rows"]}["gptq-w4g128-gptq"] == 128.0

    more = _cfg(points=[{"method": "rtn", "bits": 8, "group_size": -1, "format": "gptq"}])
    runner, timer = FakeRunner(), FakeTimer({**SCRIPT, "rtn-w8gpc-gptq": [90.0, 95.0, 99.0]})
    NUMBERS["rtn-w8gpc-gptq"] = (20.1, 0.0, 0.0, 150.0)
    try:
        report = run_sweep(more, tmp_path, runner=runner, timer=timer)
    finally:
        del NUMBERS["rtn-w8gpc-gptq"]
    assert runner.calls == ["rtn-w8gpc-gptq"]  # finished points are not run again...
    assert len(timer.calls) == 12  # ...but every point is timed again, with the new one
    assert {r["name"]: r["tokens_per_s"] for r in report["rows"]}["rtn-w8gpc-gptq"] == 95.0


def test_a_failing_timing_is_left_out_of_the_median(tmp_path):
    timer = FakeTimer(SCRIPT, fail={("gptq-w4g128-gptq", 2)})
    report = run_sweep(_cfg(), tmp_path, runner=FakeRunner(), timer=timer)
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["gptq-w4g128-gptq"]["tokens_per_s"] == 129.5  # median of 128 and 131
    err = json.loads((tmp_path / "speed" / "round-2" / "gptq-w4g128-gptq.json").read_text())
    assert "bench crashed" in err["error"]

    always = FakeTimer(SCRIPT, fail={("rtn-w4g128-gptq", r) for r in range(3)})
    report = run_sweep(_cfg(), tmp_path / "again", runner=FakeRunner(), timer=always)
    rtn = next(p for p in report["points"] if p["name"] == "rtn-w4g128-gptq")
    assert rtn["bench"] is None and "bench crashed" in rtn["speed_error"]
    assert {r["name"]: r["tokens_per_s"] for r in report["rows"]}["rtn-w4g128-gptq"] is None


def test_collect_point_keeps_the_kernels_of_every_accuracy(tmp_path):
    """The eval step's and lm-eval's kernels reach the point's record (report.json "points")."""
    kernels = {"backend": "reference", "activations": "as declared"}
    (tmp_path / "eval.json").write_text(json.dumps({"ppl": {"wikitext2": 30.0}, "size_mb": 256.0, "kernels": kernels}))
    (tmp_path / "lmeval" / "m").mkdir(parents=True)
    (tmp_path / "lmeval" / "m" / "results_1.json").write_text(json.dumps(
        {"results": {"arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": 0.1}},
         "config": {"quantspec_kernels": kernels}}))
    rec = collect_point(SweepPoint(), tmp_path)
    assert rec["eval"]["kernels"] == kernels and rec["tasks_kernels"] == kernels
    assert rec["tasks"] == {"arc_easy": {"acc": 0.5}} and rec["size_mb"] == 256.0 and rec["bench"] is None
