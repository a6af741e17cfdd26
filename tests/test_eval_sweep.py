"""Sweeps and the report: resumable points, recorded failures, report files that hold the numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantspec.eval.report_plot import pareto_front
from quantspec.eval.sweep import SweepConfig, SweepPoint, point_steps, run_sweep

REPO = Path(__file__).resolve().parents[1]

NUMBERS = {  # name -> (ppl, decode tokens/s, speed-up, size MB)
    "dense": (20.0, 100.0, 1.0, 540.0),
    "rtn-w4g128-gptq": (23.5, 130.0, 1.3, 95.0),
    "gptq-w4g128-gptq": (21.25, 128.0, 1.28, 95.5),
}


def fake_bench(name: str) -> dict:
    ppl, tps, sp, size = NUMBERS[name]
    kind = "dense" if name == "dense" else "quantized"
    model = {"kind": kind, "weights_mb": size, "disk_mb": size if kind == "quantized" else None,
             "decode": {"1": {"tokens_per_s": tps, "ttft_ms": 5.0, "tpot_ms_p50": 1.0, "tpot_ms_p95": 2.0}},
             "prefill": {"128": {"tokens_per_s": 10 * tps, "seconds": 0.1}}}
    speedup = None if kind == "dense" else {"decode": {"1": sp}, "prefill": {"128": sp}}
    return {"model": model, "speedup": speedup, "protocol": "fake", "machine": {"cpu": "test", "gpus": [], "versions": {"torch": "x"}}}


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
                "bench": fake_bench(point.name), "tasks": None, "quantize": None,
                "size_mb": None if point.is_dense else NUMBERS[point.name][3]}


def _cfg(**kw) -> SweepConfig:
    data = {"model": "tiny", "grid": {"methods": ["rtn", "gptq"], "bits": [4], "group_sizes": [128], "formats": ["gptq"]},
            "eval": {"ppl": ["wikitext2"], "seqlen": 512, "windows": 20}}
    data.update(kw)
    return SweepConfig.from_dict(data)


def test_sweep_report_holds_the_numbers(tmp_path):
    runner = FakeRunner()
    report = run_sweep(_cfg(), tmp_path, runner=runner)
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
    report = run_sweep(_cfg(), tmp_path, runner=first)
    assert first.calls == ["dense", "rtn-w4g128-gptq", "gptq-w4g128-gptq"]
    failed = [r for r in report["rows"] if r["status"] == "failed"]
    assert [r["name"] for r in failed] == ["rtn-w4g128-gptq"] and "quantize failed" in failed[0]["error"]
    err = json.loads((tmp_path / "points" / "rtn-w4g128-gptq" / "error.json").read_text())
    assert err["status"] == "failed" and "RuntimeError" in err["error"]
    assert "FAILED" in (tmp_path / "report.md").read_text()

    second = FakeRunner()
    report = run_sweep(_cfg(), tmp_path, runner=second)
    assert second.calls == ["rtn-w4g128-gptq"]  # only the failed point runs again
    assert all(r["status"] == "ok" for r in report["rows"])
    assert not (tmp_path / "points" / "rtn-w4g128-gptq" / "error.json").exists()

    third = FakeRunner()
    run_sweep(_cfg(), tmp_path, runner=third)
    assert third.calls == []


def test_impossible_point_is_recorded_without_running(tmp_path):
    runner = FakeRunner()
    cfg = _cfg(dense=False, grid={"methods": ["rtn"], "bits": [4], "group_sizes": [128], "formats": ["gptq"]},
               points=[{"method": "smoothquant", "bits": 4, "group_size": 128, "format": "gptq"}])
    report = run_sweep(cfg, tmp_path, runner=runner)
    assert runner.calls == ["rtn-w4g128-gptq"]
    bad = [r for r in report["rows"] if r["status"] == "failed"]
    assert len(bad) == 1 and "QuantspecError" in bad[0]["error"]


def test_sweep_yaml_is_strict_and_default_parses(tmp_path):
    from quantspec.errors import QuantspecError

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ngrid: {method: [rtn]}\n")
    with pytest.raises(QuantspecError, match="unknown field"):
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
                assert args.method == point.method and args.bits == point.bits
                assert args.w8a8 == (point.method == "smoothquant")
            if step.name == "eval":
                assert args.ppl == ["wikitext2"] and args.windows == 20


def test_pareto_front():
    pts = [(1.0, 10.0), (2.0, 12.0), (3.0, 11.0), (2.5, 9.0)]  # x higher better, y lower better
    # (2.5, 9) beats (1, 10) and (2, 12); (3, 11) is the fastest: the front, sorted by x
    assert pareto_front(pts, x_higher=True, y_higher=False) == [3, 2]
    assert pareto_front(pts, x_higher=False, y_higher=False) == [0, 3]
