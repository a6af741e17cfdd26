"""serve-bench: statistics, SLOs, the load generator and the server lifecycle, against a real
HTTP server with known token timings (tests/fake_engine.py), in a thread or as the engine
process that ``EngineServer`` starts and stops."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fake_engine import Behaviour, start_in_thread
from quantspec.errors import QuantspecError
from quantspec.serving.bench import BenchConfig, serve_bench
from quantspec.serving.client import Endpoint, RequestRecord, stream_completion
from quantspec.serving.load import Level, arrival_times, parse_levels, run_level
from quantspec.serving.metrics import counter_delta, counters, parse_prometheus, spec_summary
from quantspec.serving.server import EngineServer, EngineSpec, EngineStartError, port_in_use
from quantspec.serving.slo import SLO, meets, parse_slo
from quantspec.serving.stats import median_rows, percentile, summarize
from quantspec.serving.variants import Target, build_targets, parse_spec
from quantspec.serving.workload import Request, build_workload, write_prompts

HERE = Path(__file__).resolve().parent
MARGIN = 0.25  # s: scheduling slack on a loaded 2-core machine, added to known delays only


@pytest.fixture
def fake():
    srv, url = start_in_thread(Behaviour(model="m", ttft_ms=20, slow_ttft_ms=300, tpot_ms=10))
    yield Endpoint(url, "m")
    srv.shutdown()


@pytest.fixture
def engine_python(tmp_path) -> str:
    """An "engine python" whose ``-m vllm...`` runs the fake engine and whose ``-c`` answers a version."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then printf 0.0-fake; exit 0; fi\n"
                      f"exec {sys.executable} {HERE / 'fake_engine.py'} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- statistics and SLOs


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy_linear(n):
    rng = random.Random(n)
    xs = [rng.expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)
    assert percentile([], 50) is None


def _rec(i, ttft, latency, tokens, ok=True):
    itl = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if ok else []
    return RequestRecord(index=i, prompt_tokens=10, max_tokens=tokens, ok=ok, ttft=ttft, latency=latency,
                         output_tokens=tokens if ok else 0, itl=itl, error=None if ok else "boom")


def test_summary_percentiles_and_goodput_are_exact():
    recs = [_rec(0, 0.1, 1.1, 11), _rec(1, 0.2, 2.2, 11), _rec(2, 0.6, 1.6, 11), _rec(3, 0.3, 0.3, 1, ok=False)]
    s = summarize(recs, duration=4.0, slo=parse_slo("ttft=500ms,tpot=150ms"))
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p90_ms"] == pytest.approx(520.0)  # 0.2 + 0.8 * (0.6 - 0.2)
    assert s["tpot"]["p50_ms"] == pytest.approx(100.0)  # (1.1-0.1)/10, (2.2-0.2)/10=200, (1.6-0.6)/10
    # good: request 0 only (1: tpot 200 ms > 150; 2: ttft 600 ms > 500; 3: failed)
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.25) and s["good_fraction"] == 0.25
    assert s["output_throughput"] == pytest.approx(33 / 4.0)
    assert s["errors"] == ["boom"]


def test_slo_parsing():
    assert parse_slo("ttft=500ms,tpot=50ms") == SLO(ttft=0.5, tpot=0.05)
    assert parse_slo("e2e=2s, itl=80") == SLO(e2e=2.0, itl=0.08)
    assert parse_slo("") is None
    for bad, word in [("ttft500ms", "does not parse"), ("foo=1ms", "unknown SLO metric"),
                      ("ttft=0ms", "positive"), ("ttft=1ms,ttft=2ms", "twice"), ("ttft=5h", "does not parse")]:
        with pytest.raises(QuantspecError, match=word):
            parse_slo(bad)
    assert meets(_rec(0, 0.4, 1.0, 5), SLO(ttft=0.5)) and not meets(_rec(0, 0.6, 1.0, 5), SLO(ttft=0.5))
    assert meets(_rec(0, 0.1, 1.0, 10), SLO(itl=0.11)) and not meets(_rec(0, 0.1, 1.0, 10), SLO(itl=0.09))


def test_levels_and_arrivals():
    assert parse_levels(None, None) == [Level("concurrency", 1), Level("concurrency", 4), Level("concurrency", 16)]
    assert parse_levels("0.5,inf", None) == [Level("rate", 0.5), Level("rate", math.inf)]
    for rates, conc in [("1", "2"), ("x", None), (None, "1.5"), (None, "0"), ("-1", None), (None, "inf")]:
        with pytest.raises(QuantspecError):
            parse_levels(rates, conc)
    a = arrival_times(4000, 8.0, seed=1)
    assert a == arrival_times(4000, 8.0, seed=1) and a != arrival_times(4000, 8.0, seed=2)
    gaps = np.diff(a)
    assert a[-1] == pytest.approx(4000 / 8.0) and a[0] > 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / 8) < 0.01 and abs(gaps.std() - 1 / 8) < 0.01  # exponential: mean = sd
    even = np.diff(arrival_times(4000, 8.0, seed=1, burstiness=100.0))
    assert abs(even.mean() - 1 / 8) < 0.01 and even.std() < 0.02  # burstiness >> 1: nearly even gaps
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    # vLLM bench serve's draws: np.random.seed(seed), then gamma(burstiness, 1/(rate*burstiness)) per request
    np.random.seed(7)
    ref = np.cumsum([np.random.gamma(shape=0.5, scale=1 / (2.0 * 0.5)) for _ in range(5)])
    assert arrival_times(5, 2.0, seed=7, burstiness=0.5) == pytest.approx((ref * (5 / 2.0) / ref[-1]).tolist(), rel=1e-12)


def test_prometheus_parsing_and_spec_counters():
    text = ('# HELP vllm:kv_cache_usage_perc x\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:spec_decode_num_drafts_total{engine="0"} 10\nvllm:spec_decode_num_draft_tokens_total 40\n'
            'vllm:spec_decode_num_accepted_tokens_total 20\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 6\n'
            'vllm:num_preemptions_total{a="1"} 1\nvllm:num_preemptions_total{a="2"} 2\n')
    v = parse_prometheus(text)
    assert v["vllm:kv_cache_usage_perc"] == 0.5 and v["vllm:num_preemptions_total"] == 3
    before = counters(parse_prometheus(text.replace(" 10\n", " 0\n").replace(" 40\n", " 0\n")
                                       .replace(" 20\n", " 0\n").replace(" 9\n", " 0\n").replace(" 6\n", " 0\n")))
    spec = spec_summary(counter_delta(before, counters(v)))
    assert spec["acceptance_rate"] == 0.5 and spec["mean_accepted_length"] == 3.0
    assert spec["acceptance_per_position"] == [0.9, 0.6]
    assert spec_summary(counter_delta(counters({}), counters({}))) is None


# ---------------------------------------------------------------- workloads and variants


def test_workload_files(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a b", "max_tokens": 5}\n{"prompt": "c", "max_tokens": 7}\n')
    reqs = build_workload(str(p), None, num_prompts=5)
    assert len(reqs) == 5 and sorted({r.max_tokens for r in reqs}) == [5, 7]
    assert {r.max_tokens for r in build_workload(str(p), None, num_prompts=3, output_len=9)} == {9}
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                              {"conversations": []}]))
    assert build_workload(str(sg), None, num_prompts=2, output_len=4) == [Request("hi", 4, None)] * 2
    out = tmp_path / "replay.jsonl"
    write_prompts(reqs, out)
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == [r.prompt for r in reqs]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    for path, kw, word in [(bad, {}, "no output length"), (tmp_path / "nope.jsonl", {}, "does not exist"),
                           (p, {"output_len": 1}, "too short"), (p, {"num_prompts": 0}, "at least 1")]:
        with pytest.raises(QuantspecError, match=word):
            build_workload(str(path), None, **{"num_prompts": 2, **kw})
    with pytest.raises(QuantspecError, match="tokenizer"):
        build_workload("wikitext2", None, num_prompts=2)


def test_each_level_gets_its_own_prompts():
    from quantspec.serving.workload import split_levels

    pool = [Request(f"p{i}", 4) for i in range(11)]
    warm, levels, distinct = split_levels(pool, 3, 3, 2)
    assert [[r.prompt for r in lv] for lv in levels] == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6", "p7", "p8"]]
    assert [r.prompt for r in warm] == ["p9", "p10"] and distinct
    warm, levels, distinct = split_levels(pool[:5], 2, 3, 1)
    assert [r.prompt for r in levels[1]] == ["p3", "p4", "p0"] and not distinct


def test_cli_draws_distinct_prompts_per_level(engine_python, smollm2_dir, tmp_path):
    """Prompts drawn from a text: every level (and the warm-up) gets windows no other level
    sends, so the engine's prefix cache cannot serve a later level's prefill."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(smollm2_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i}" for i in range(3000)))
    p = _cli([str(model), "--engine-python", engine_python, "--concurrency", "1,2", "--dataset", str(text),
              "--num-prompts", "3", "--input-len", "16", "--output-len", "2", "--out", str(tmp_path / "o"),
              "--no-progress", "--baseline", "none"])
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "o" / "serve-bench.json").read_text())
    assert r["prompts_distinct"] is True


def test_targets_and_spec_variants(tmp_path):
    t = build_targets(["ck"], baseline="dense", specs=["ngram:3", "draft=/x/y:2"], url=None)
    assert [x.role for x in t] == ["baseline", "checkpoint"] + ["speculative"] * 4
    cfg = json.loads(t[2].engine_args[1])
    assert t[2].engine_args[0] == "--speculative-config" and cfg["method"] == "ngram" and cfg["num_speculative_tokens"] == 3
    assert parse_spec("draft=/a/b")[1] == {"model": "/a/b", "num_speculative_tokens": 4}
    with pytest.raises(QuantspecError, match="speculative variant"):
        parse_spec("medusa")
    with pytest.raises(QuantspecError, match="names no eagle"):
        parse_spec("eagle=")
    (tmp_path / "head" / "vllm-eagle").mkdir(parents=True)  # a train-draft folder: its export is served
    assert parse_spec(f"eagle={tmp_path / 'head'}:3") == (
        "eagle:head:3", {"method": "eagle", "model": str(tmp_path / "head" / "vllm-eagle"), "num_speculative_tokens": 3})
    assert parse_spec("eagle=/v/e1")[1]["model"] == "/v/e1"  # a vLLM EAGLE folder as it is
    for bad in ("ngram:x", "ngram:0"):
        with pytest.raises(QuantspecError, match="whole number"):
            parse_spec(bad)
    assert parse_spec("ngram")[1]["num_speculative_tokens"] == 4
    with pytest.raises(QuantspecError, match="--url"):
        build_targets(["ck"], baseline=None, specs=[], url="http://x")
    assert build_targets([], baseline=None, specs=[], url="http://x")[0] == Target("http://x", None, url="http://x", role="url")


# ---------------------------------------------------------------- against a real HTTP server


def test_stream_timings_match_known_delays(fake):
    rec = stream_completion(fake, "a b c", 8)
    assert rec.ok and rec.output_tokens == 8 and rec.prompt_tokens == 3 and len(rec.itl) == 7
    assert 0.020 <= rec.ttft < 0.020 + MARGIN
    assert 0.010 <= rec.tpot < 0.010 + MARGIN / 7
    slow = stream_completion(fake, "slow one", 2)
    assert 0.300 <= slow.ttft < 0.300 + MARGIN
    bad = stream_completion(Endpoint(fake.base, "other"), "x", 2)
    assert not bad.ok and bad.error.startswith("HTTP 404")


def test_concurrency_level_goodput_and_in_flight_bound(fake):
    reqs = [Request("slow" if i % 2 else "fast", 6) for i in range(8)]
    recs, wall = run_level(fake, reqs, Level("concurrency", 2))
    assert len(recs) == 8 and all(r.ok and r.output_tokens == 6 for r in recs)
    events = sorted([(r.start, 1) for r in recs] + [(r.start + r.latency, -1) for r in recs])
    in_flight = max(np.cumsum([e for _, e in events]))
    assert in_flight == 2
    s = summarize(recs, wall, parse_slo("ttft=150ms"))
    assert s["good_requests"] == 4  # exactly the fast prompts: 20 ms vs 300 ms against 150 ms
    assert 300 <= s["ttft"]["p90_ms"] < 300 + 1e3 * MARGIN


def test_rate_level_follows_arrivals_and_duration(fake):
    reqs = [Request("x", 2)] * 6
    recs, _ = run_level(fake, reqs, Level("rate", 10.0), seed=3)
    for r, at in zip(sorted(recs, key=lambda r: r.index), arrival_times(6, 10.0, seed=3)):
        assert at - 0.01 <= r.start < at + MARGIN
    recs, _ = run_level(fake, [Request("x", 2)] * 50, Level("rate", 20.0), seed=0, duration=0.5)
    assert 0 < len(recs) < 50 and all(r.start < 0.5 + MARGIN for r in recs)


def test_perplexity_through_the_server(fake, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from quantspec.serving.accuracy import server_perplexity

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = server_perplexity(fake, AutoTokenizer.from_pretrained(smollm2_dir), str(text), seqlen=32, windows=3)
    assert out["windows"] == 3 and out["tokens"] == 3 * 31
    assert out["ppl"] == pytest.approx(2.0, rel=1e-12)


# ---------------------------------------------------------------- the engine process


def test_server_lifecycle_leaves_no_process(engine_python, tmp_path, monkeypatch):
    child = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_CHILD", str(child))
    srv = EngineServer(EngineSpec(python=engine_python, startup_timeout=60), "folder", log=tmp_path / "s.log",
                       name="m", poll=0.1)
    with srv:
        assert stream_completion(srv.endpoint, "a", 3).ok
        leader, kid = srv.proc.pid, int(child.read_text())
        assert _alive(leader) and _alive(kid)
        assert port_in_use(srv.port)
        with pytest.raises(QuantspecError, match="already in use"):
            EngineServer(EngineSpec(python=engine_python), "folder", log=tmp_path / "t.log", port=srv.port)
    time.sleep(0.2)
    assert not _alive(leader) and not _alive(kid)


def test_engine_that_fails_to_start(engine_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_START", "no GPU and no CPU backend for this model")
    srv = EngineServer(EngineSpec(python=engine_python, startup_timeout=60), "folder", log=tmp_path / "s.log", poll=0.1)
    with pytest.raises(EngineStartError, match="exited with code 1 before it was ready: ValueError: no GPU"):
        srv.start()
    monkeypatch.delenv("FAKE_FAIL_START")
    monkeypatch.setenv("FAKE_STARTUP_S", "30")
    slow = EngineServer(EngineSpec(python=engine_python, startup_timeout=1), "folder", log=tmp_path / "u.log", poll=0.1)
    with pytest.raises(EngineStartError, match="not ready after 1 s"):
        slow.start()
    assert not _alive(slow.proc.pid)


def test_server_dying_mid_run_keeps_partial_results(engine_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DIE_AFTER", "6")  # 2 warm-up + 4 of the first level, then it exits
    cfg = BenchConfig(levels=[Level("concurrency", 1), Level("concurrency", 2)], warmup=2, num_prompts=4)
    out = serve_bench([Target("m", "folder")], EngineSpec(python=engine_python, startup_timeout=60),
                      [Request("x", 3)] * 4, cfg, out_dir=tmp_path, json_path=tmp_path / "r.json")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == json.loads(json.dumps(out))
    t = saved["targets"][0]
    assert saved["status"] == "partial" and t["status"] == "partial" and "died during the level" in t["error"]
    first, second = t["levels"]
    assert first["completed"] == 4 and "partial" not in first
    assert second["partial"] and second["completed"] == 0 and second["failed"] == 4


def test_unusable_answers_fail_the_target_not_the_run(engine_python, smollm2_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("FAKE_REJECT_ECHO", "1")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cfg = BenchConfig(levels=[Level("concurrency", 1)], warmup=1, num_prompts=1, ppl_data=str(text), ppl_seqlen=32,
                      ppl_windows=1)
    out = serve_bench([Target("a", "folder"), Target("b", "folder")], EngineSpec(python=engine_python, startup_timeout=60),
                      [Request("x", 3)], cfg, out_dir=tmp_path, json_path=tmp_path / "r.json",
                      tokenizer=AutoTokenizer.from_pretrained(smollm2_dir))
    assert [t["status"] for t in out["targets"]] == ["failed", "failed"] and out["status"] == "partial"
    assert out["targets"][0]["error"].startswith("ValueError: HTTP 400") and "not supported" in out["targets"][0]["error"]


def test_median_rows_sum_counts_and_take_medians():
    rows = [{"level": "c=1", "requests": 4, "completed": 4, "output_throughput": v, "ttft": {"p50_ms": t, "n": 4},
             "engine_metrics": {"kv": k}} for v, t, k in ((10.0, 30.0, None), (14.0, 10.0, 0.1), (11.0, 20.0, 0.3))]
    m = median_rows(rows)
    assert m == {"level": "c=1", "requests": 12, "completed": 12, "output_throughput": 11.0,
                 "ttft": {"p50_ms": 20.0, "n": 4}, "engine_metrics": {"kv": 0.2}, "rounds": 3}


def test_repeats_interleave_targets_on_fresh_servers_and_give_medians(engine_python, tmp_path):
    """--repeats: every target served once per round on its own server, the order drawn anew per
    round (seeded), levels the medians of the rounds' figures and the sums of their counts."""
    cfg = BenchConfig(levels=[Level("concurrency", 1)], warmup=1, num_prompts=3, repeats=4, seed=1)
    targets = [Target(x, "folder") for x in "abc"]
    out = serve_bench(targets, EngineSpec(python=engine_python, startup_timeout=60), [Request("x", 3)] * 4, cfg,
                      out_dir=tmp_path, json_path=tmp_path / "r.json")
    assert out["status"] == "ok" and [t["label"] for t in out["targets"]] == ["b", "c", "a"]  # round 0's order
    starts = sorted((r["server"]["log"], r["label"]) for t in out["targets"] for r in t["rounds"])
    assert len({r["server"]["pid"] for t in out["targets"] for r in t["rounds"]}) == 12  # 12 servers
    orders = {}
    for t in out["targets"]:
        for r in t["rounds"]:
            orders.setdefault(r["round"], []).append((Path(r["server"]["log"]).stat().st_mtime_ns, t["label"]))
    assert len({tuple(x for _, x in sorted(v)) for v in orders.values()}) > 1, starts  # the order changes
    for t in out["targets"]:
        rows = [r["levels"][0] for r in t["rounds"]]
        lv = t["levels"][0]
        assert lv["rounds"] == 4 and lv["completed"] == 12 == sum(r["completed"] for r in rows)
        assert lv["ttft"]["p50_ms"] == float(np.median([r["ttft"]["p50_ms"] for r in rows]))
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(out))


def test_repeats_that_never_measure_are_failed_not_partial(engine_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DIE_AFTER", "1")  # every server dies in its warm-up
    cfg = BenchConfig(levels=[Level("concurrency", 1)], warmup=2, num_prompts=2, repeats=2)
    out = serve_bench([Target("m", "folder")], EngineSpec(python=engine_python, startup_timeout=60),
                      [Request("x", 3)] * 4, cfg, out_dir=tmp_path, json_path=tmp_path / "r.json")
    t = out["targets"][0]
    assert len(t["rounds"]) == 2 and not any(r["levels"] for r in t["rounds"])
    assert t["status"] == "failed" and out["status"] == "partial"


def _cli(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "quantspec", "serve-bench", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, **kw)


def test_cli_end_to_end_with_an_engine(engine_python, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 4}) + "\n" for i in range(4)))
    p = _cli([str(model), "--engine-python", engine_python, "--concurrency", "1,2", "--dataset", str(prompts),
              "--num-prompts", "4", "--slo", "ttft=200ms", "--out", str(tmp_path / "o"), "--no-progress"])
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "o" / "serve-bench.json").read_text())
    assert r["status"] == "ok" and r["engine"]["version"] == "0.0-fake"
    assert [lv["level"] for lv in r["targets"][0]["levels"]] == ["concurrency=1", "concurrency=2"]
    assert all(lv["good_requests"] == 4 and lv["engine_metrics"]["kv_cache_usage_max"] == 0.25
               for lv in r["targets"][0]["levels"])
    assert "| model | concurrency=2 | 4/4 |" in p.stdout


def test_cli_bad_input_is_one_line_before_any_server(engine_python, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cases = [
        (["--url", "http://127.0.0.1:9"], "is not reachable"),
        ([str(model), "--engine-python", engine_python, "--slo", "ttft<5"], "does not parse"),
        ([str(model), "--engine-python", str(tmp_path / "nope")], "does not exist"),
        ([str(model), "--engine-python", sys.executable], "cannot import vllm"),
        ([str(model), "--engine-python", engine_python, "--concurrency", "1", "--rate", "2"], "both given"),
        ([str(model), "--engine-python", engine_python, "--dataset", str(tmp_path / "x.jsonl")], "does not exist"),
        ([str(model), "--engine-python", engine_python, "--tasks", "no_such_task_x"], "has no task"),
    ]
    from quantspec.cli.main import main

    for args, word in cases:  # in this process: the CLI's own entry point, without a new interpreter per case
        code = main(["serve-bench", *args, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and word in lines[0] and "Fix:" in lines[0], (args, err)
    p = _cli(["--url", "http://127.0.0.1:9", "--out", str(tmp_path / "o2")])  # and once as users run it
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "o2" / "serve-bench.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_ctrl_c_stops_the_engine_and_marks_the_json(engine_python, tmp_path, sig):
    """Interrupted during a level, the CLI stops the engine, marks the JSON and exits 130."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "max_tokens": 200}) + "\n")
    child = tmp_path / "child.pid"
    # The CLI must start with SIGINT's default action, as from a terminal. A test run started in
    # the background by a non-interactive shell (`pytest &`) ignores SIGINT, and an ignored SIGINT
    # is inherited, so the CLI would ignore it too; a caught signal is reset to its default in a
    # child at exec, so it is caught here while the CLI starts.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "quantspec", "serve-bench", str(model), "--engine-python",
                              engine_python, "--dataset", str(prompts), "--num-prompts", "50", "--concurrency", "1",
                              "--out", str(tmp_path / "o")],
                             env={**os.environ, "FAKE_CHILD": str(child), "FAKE_TPOT_MS": "20"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if before is None else before)
    deadline = time.time() + 120
    while time.time() < deadline and not (child.is_file() and "listening" in _read_log(tmp_path / "o")):
        time.sleep(0.1)
    time.sleep(1.5)  # warm-up done, the first level under way
    kid = int(child.read_text())
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        status = _read(Path(f"/proc/{p.pid}/status"))
        p.kill()
        p.communicate()
        pytest.fail("the CLI did not exit within 120 s of the signal; its signal state: "
                    + "; ".join(ln for ln in status.splitlines() if ln.startswith(("Sig", "Shd"))))
    assert p.returncode == 130, err
    time.sleep(0.3)
    assert not _alive(kid)
    r = json.loads((tmp_path / "o" / "serve-bench.json").read_text())
    assert r["status"] == "interrupted" and r["targets"][0]["status"] == "partial"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_log(folder: Path) -> str:
    return "".join(_read(p) for p in folder.glob("*.log"))
