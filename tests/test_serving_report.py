"""The serving report (table, PNG, interactive HTML in a real browser, accuracy/goodput Pareto)
and the sweep's serving stage, on serve-bench results made by the fake engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_eval_report_browser import DevTools, _errors, browser  # noqa: F401 - fixture
from test_eval_sweep import FakeRunner, FakeTimer, _cfg

from quantspec.serving.report import accuracy_goodput, curves, serving_html, write_serving_report

HERE = Path(__file__).resolve().parent


def _level(name, tput, ttft, tpot, goodput, partial=False):
    d = {"level": name, "kind": "concurrency", "value": 1, "requests": 4, "completed": 4, "failed": 0,
         "request_throughput": tput / 10, "output_throughput": tput, "goodput": goodput, "good_fraction": 1.0,
         "ttft": {"p50_ms": ttft, "p99_ms": ttft * 2}, "tpot": {"p50_ms": tpot, "p99_ms": tpot * 2},
         "e2e": {"p50_ms": 1000.0, "p99_ms": 1500.0}, "engine_metrics": {"kv_cache_usage_max": 0.1}}
    return d | ({"partial": True} if partial else {})


def _result():
    t = lambda label, ppl, lv: {"label": label, "status": "ok", "accuracy": {"ppl": {"ppl": ppl}}, "levels": lv}  # noqa: E731
    return {"kind": "serve-bench", "command": "quantspec serve-bench x", "engine": {"name": "vllm", "version": "0"},
            "config": {"slo": "ttft=500ms"}, "status": "ok", "targets": [
                t("dense", 20.0, [_level("concurrency=1", 30, 300, 30, 0.5), _level("concurrency=4", 80, 500, 40, 1.5)]),
                t("w8a8", 20.5, [_level("concurrency=1", 35, 280, 25, 0.6), _level("concurrency=4", 90, 450, 35, 1.8)]),
                t("w4", 22.0, [_level("concurrency=1", 40, 250, 20, 0.7),
                               _level("concurrency=4", 95, 420, 30, 1.6, partial=True)])]}


def test_curves_drop_partial_levels_and_pareto_is_right():
    cs = {c["label"]: c for c in curves(_result())}
    assert [p["level"] for p in cs["w4"]["points"]] == ["concurrency=1"]
    ag = {p["label"]: p for p in accuracy_goodput(_result())}
    assert ag["w8a8"]["goodput"] == 1.8 and ag["w4"]["goodput"] == 0.7  # the partial level's 1.6 is not used
    # dense (1.5, 20.0) is on the front (best ppl); w8a8 (1.8, 20.5) best goodput; w4 (0.7, 22.0) dominated
    assert {k: p["pareto"] for k, p in ag.items()} == {"dense": True, "w8a8": True, "w4": False}


def test_report_files(tmp_path):
    files = write_serving_report(_result(), tmp_path)
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = files["md"].read_text()
    assert "| w8a8 | concurrency=4 | 4/4 | 9.00 | 90.0 | 450 |" in md and "| w8a8 | 1.80 | 20.500 | yes |" in md
    empty = write_serving_report({"kind": "serve-bench", "targets": [{"label": "x", "status": "failed",
                                                                      "error": "no", "levels": []}]}, tmp_path / "e")
    assert "png" not in empty and "No level finished" in empty["html"].read_text()


def test_speculative_targets_show_the_engines_acceptance():
    """With a speculative target the table gains the engine's acceptance (accepted / drafted
    tokens) and tokens per target step; without one it keeps its columns."""
    from quantspec.serving.table import serve_markdown

    r = _result()
    assert "draft accept %" not in serve_markdown(r)
    spec = {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 24.0, "acceptance_rate": 0.8,
            "mean_accepted_length": 3.4}
    r["targets"].append({"label": "dense +ngram:3", "status": "ok", "role": "speculative", "accuracy": {},
                         "levels": [_level("concurrency=1", 33, 290, 22, 0.6) | {
                             "engine_metrics": {"kv_cache_usage_max": 0.1, "speculative": spec}}]})
    md = serve_markdown(r)
    assert "| KV max % | draft accept % | tokens per step | ppl |" in md
    assert "| 10.0 | 80.0 | 3.40 | - |" in md and "| 10.0 | - | - | 20.000 |" in md  # the target without: '-'


def test_html_is_interactive_in_a_browser(browser, tmp_path):  # noqa: F811
    page = tmp_path / "serve-report.html"
    page.write_text(serving_html(_result()))
    dt = DevTools(browser, tmp_path / "profile")
    try:
        target = next(t for t in dt.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        s = dt.call("Target.attachToTarget", targetId=target["targetId"], flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            dt.call(f"{domain}.enable", session=s)
        dt.events.clear()
        dt.call("Page.navigate", session=s, url=page.resolve().as_uri())
        dt.wait_event("Page.loadEventFired")

        def ev(js):
            return dt.call("Runtime.evaluate", session=s, expression=js, returnByValue=True)["result"].get("value")

        assert ev("document.querySelectorAll('svg.chart').length") == 3
        assert ev("document.querySelectorAll('svg.chart[data-metric=ttft] circle').length") == 5
        assert ev("Array.from(document.querySelectorAll('svg.chart circle title')).some("
                  "t => t.textContent.startsWith('w8a8 concurrency=4: 90.0 tok/s, TTFT p50 450.0 ms'))")
        visible = "Array.from(document.querySelectorAll('.series[data-series=\"1\"]')).filter(g => g.getBoundingClientRect().width > 0).length"
        assert ev(visible) == 3
        ev("document.querySelector('.legend button[data-series=\"1\"]').click()")
        assert ev(visible) == 0
        ev("document.querySelector('.legend button[data-series=\"1\"]').click()")
        assert ev(visible) == 3
        assert _errors(dt.events) == []
    finally:
        dt.close()


class CheckpointRunner(FakeRunner):
    """FakeRunner that also leaves a servable folder where each point's checkpoint goes."""

    def __call__(self, point, cfg, folder):
        (folder / "checkpoint").mkdir(parents=True, exist_ok=True)
        (folder / "checkpoint" / "config.json").write_text("{}")
        return super().__call__(point, cfg, folder)


def test_sweep_serving_stage(tmp_path):
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then printf 0.0-fake; exit 0; fi\n"
                      f"exec {sys.executable} {HERE / 'fake_engine.py'} \"$@\"\n")
    script.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))  # read, never loaded
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 3}) + "\n" for i in range(3)))
    cfg = _cfg(model=str(model), eval={"ppl": ["wikitext2"], "seqlen": 512, "windows": 20, "speed": False},
               serve={"engine_python": str(script), "concurrency": "1,2", "slo": "ttft=1s", "dataset": str(prompts),
                      "num_prompts": 3, "ppl": None})
    report = run_sweep_with(cfg, tmp_path / "out")
    serving = report["serving"]
    assert serving["status"] == "ok" and len(serving["targets"]) == 3
    assert [t["model"] for t in serving["targets"]][0] == str(model)
    assert all(len(t["levels"]) == 2 for t in serving["targets"])
    assert (tmp_path / "out" / "serve-report.html").is_file()
    assert "## Serving" in (tmp_path / "out" / "report.md").read_text()
    with pytest.raises(Exception, match="does not parse"):
        _cfg(serve={"slo": "ttft<1"})


def run_sweep_with(cfg, out):
    from quantspec.eval.sweep import run_sweep

    return run_sweep(cfg, out, runner=CheckpointRunner(), timer=FakeTimer())
