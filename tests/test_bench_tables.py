"""Benchmark tables: speed-ups are derived from the same run's rows, against the faster dense."""

from __future__ import annotations

import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _row(m, kernel, us):
    return {"N": 8, "K": 8, "M": m, "kernel": kernel, "us": us, "GB/s": 1.0}


def test_cpu_kernel_table_compares_with_the_faster_dense():
    mod = runpy.run_path(str(BENCH / "kernels_cpu.py"))
    rows = [_row(1, "ours", 100.0), _row(1, "dense_bf16", 1000.0), _row(1, "dense_fp32", 400.0),
            _row(2, "ours", 100.0), _row(2, "dense_bf16", 300.0), _row(2, "dense_fp32", 900.0)]
    lines = [ln for ln in mod["markdown"](rows, "# t").splitlines() if ln.startswith("| 8x8")]
    # M=1: fp32 is the faster dense (400 us), so ours is 4x it while 10x bf16; M=2: bf16 is.
    assert lines[0].endswith("| 10.00x | 4.00x | - |"), lines[0]
    assert lines[1].endswith("| 3.00x | 3.00x | - |"), lines[1]


def test_quant_cost_schedule_rotates_and_medians_skip_failures():
    mod = runpy.run_path(str(BENCH / "quant_cost.py"))
    order = mod["schedule"](["a", "b", "c"], 3)
    assert [lab for _, lab in order] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    run = lambda s, rss, code, user, sys_, faults: {"seconds": s, "peak_rss_mb": rss, "exit": code,  # noqa: E731
                                                  "user_s": user, "sys_s": sys_, "minor_faults": faults}
    runs = [run(10.0, 100.0, 0, 8.0, 1.0, 1000), run(99.0, 900.0, 1, 90.0, 9.0, 9000), run(14.0, 120.0, 0, 9.0, 2.0, 3000)]
    s = mod["summarize"](runs)
    assert s == {"ok": True, "median_s": 12.0, "median_user_s": 8.5, "median_sys_s": 1.5, "median_minor_faults": 2000,
                 "median_peak_rss_mb": 110.0, "max_peak_rss_mb": 120.0, "runs": 2}
    assert mod["summarize"](runs[1:2]) == {"ok": False}


def test_quant_cost_measures_the_quantize_process_peak(tmp_path, monkeypatch):
    """The peak is the child's own (a 200 MB allocation shows), not the parent's pages."""
    import sys

    mod = runpy.run_path(str(BENCH / "quant_cost.py"))
    fake = tmp_path / "quantspec"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(
        "import sys\nif sys.argv[1:] == ['big']:\n    b = bytearray(200 * 2**20)\n    b[::4096] = b'x' * len(b[::4096])\n    sum(range(2 * 10**7))\n")
    env = {"PYTHONPATH": str(tmp_path)}
    monkeypatch.chdir(tmp_path)  # `python -c` puts the working folder first on sys.path
    small = mod["run_measured"](sys.executable, ["small"], env)
    big = mod["run_measured"](sys.executable, ["big"], env)
    assert small["exit"] == 0 and big["exit"] == 0
    assert small["peak_rss_mb"] < 100, small  # a bare interpreter, not this pytest process
    assert big["peak_rss_mb"] - small["peak_rss_mb"] > 150, (small, big)
    # the child's own page faults: touching 200 MB of fresh pages is at least 150 MB of 4 KiB faults
    assert big["minor_faults"] - small["minor_faults"] > 150 * 2**20 // 4096, (small, big)
    # CPU seconds are the child's: a bare interpreter can round to 0.00 s, the big child's
    # loop of 20M additions cannot (about 0.25 s here)
    assert small["user_s"] >= 0 and small["sys_s"] >= 0
    assert big["user_s"] >= 0.05, (small, big)


def test_specdec_acceptance_puts_trees_beside_each_drafts_chain(tmp_path):
    """Every draft gets its chain row and one row per --tree (drafts that grow trees), each
    lossless (greedy == target) and offering the tree's nodes; a bad --tree is refused."""
    import json

    import pytest
    from helpers import make_tiny_model

    mod = runpy.run_path(str(BENCH / "specdec_acceptance.py"))
    with pytest.raises(SystemExit, match="KIND:NODES:TOPK"):
        mod["tree_spec"]("dynamic:8", 3)
    folder = make_tiny_model(tmp_path, "llama")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "prose", "prompt": "the the the cat the the"}) + "\n")
    mod["main"]([str(folder), "--draft", str(folder), "--draft", "ngram", "--tree", "static:6:2", "--k", "3", "--prompts", str(prompts),
                 "--no-chat", "--max-new-tokens", "12", "--name", "acc", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "acc.json").read_text())["drafts"]
    chain, tree = str(folder), f"{folder} tree static:6:2"  # the target drafting for itself
    assert list(rows) == [chain, tree, "ngram"]  # an n-gram draft grows no trees: its chain only
    assert all(r["greedy_matches_target"] == 1 for r in rows.values())
    assert rows[chain]["mean_proposed"] <= 3 < rows[tree]["mean_proposed"] <= 6
    assert f"| {tree} |" in (tmp_path / "acc.md").read_text()


def test_gptq_options_resume_keeps_rows_of_the_same_run_only(tmp_path):
    """--resume keeps an earlier run's rows only when every key of the comparison and the machine
    match, and the days it ran on add up."""
    import json

    import pytest

    mod = runpy.run_path(str(BENCH / "gptq_options.py"))
    meta = {k: f"v-{k}" for k in mod["SAME_RUN"]} | {"when": "2026-12-06"}
    path = tmp_path / "r.json"
    assert mod["resume"](path, dict(meta)) == []  # nothing to resume: a fresh run
    rows = [{"config": "nvfp4", "value": False, "seed": 0, "val_ppl": 31.0}]
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    new = dict(meta, when="2026-12-07")
    assert mod["resume"](path, new) == rows
    assert new["when"] == "2026-12-06, 2026-12-07" and new["resumed"] == 1
    with pytest.raises(SystemExit, match="machine differ"):
        mod["resume"](path, dict(meta, machine="another CPU"))


def test_gptq_options_rows_record_the_precisions_the_layers_ran_in():
    mod = runpy.run_path(str(BENCH / "gptq_options.py"))
    report = {"a": {"hessian_dtype": "bfloat16", "forward_dtype": "float32"},
              "b": {"hessian_dtype": "float32", "forward_dtype": "float32", "gptq_pass": "single"},
              "c": {"skipped": "not a Linear"}, "summary": 3}
    assert mod["precisions_used"](report) == {"hessian_dtype": ["bfloat16", "float32"], "forward_dtype": ["float32"]}
    rows = [{"seed": 0, "used": {"hessian_dtype": ["bfloat16"], "forward_dtype": ["float32"]}},
            {"seed": 1, "used": {"hessian_dtype": ["bfloat16"], "forward_dtype": ["float32"]}},
            {"seed": 2, "used": {"hessian_dtype": ["float32"], "forward_dtype": ["float32"]}}, {"seed": 3}]
    assert mod["precision_lines"](rows) == ["", "hessian_dtype as the layers ran it: bfloat16 (draws 0, 1); float32 (draw 2).",
                                            "forward_dtype as the layers ran it: float32 (draws 0, 1, 2)."]
    assert mod["precision_lines"]([{"seed": 0}]) == []


def test_quant_peers_reuses_rows_of_the_same_machine_only(tmp_path):
    """--reuse joins an earlier run's rows of the tools not run now only when its protocol and its
    machine line are this run's (GPTQ's auto precisions follow the CPU)."""
    import argparse
    import json

    import pytest

    mod = runpy.run_path(str(BENCH / "quant_peers.py"))
    args = argparse.Namespace(model="m", samples=64, seqlen=512, windows=40, seeds="0", threads=2, method="gptq")
    here = mod["machine_line"](mod["describe_machine"]())
    meta = {"model": "m", "calibration": "c4 64 x 512", "eval": "wikitext2 seqlen 512 x 40 windows", "seeds": [0],
            "threads": 2, "machine": here}
    rows = [{"method": "gptq", "config": "nvfp4", "tool": "llmc", "ppl": 45.7}]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    assert mod["reused"](path, args, {("nvfp4", "ours"): []}) == [{**rows[0], "from": "old.json"}]
    path.write_text(json.dumps({"meta": {**meta, "machine": "x86_64, 2 CPUs"}, "rows": rows}))
    with pytest.raises(SystemExit, match="another protocol"):
        mod["reused"](path, args, {("nvfp4", "ours"): []})


def test_specdec_timing_rows_merge_every_prompt_and_leave_the_target_alone_plain():
    """Speed-ups against ``target`` in the same repeat; draft statistics summed over the prompts
    (draft ms per step from the merged seconds and calls), none for the target's own modes."""
    import sys

    import torch

    from quantspec.specdec.bench import Run
    from quantspec.specdec.schedule import Timing
    from quantspec.specdec.stats import SpecStats

    sys.path.insert(0, str(BENCH))
    try:
        mod = runpy.run_path(str(BENCH / "specdec_timing.py"))
    finally:
        sys.path.remove(str(BENCH))
    ids = torch.tensor([[1, 2, 3]])
    modes = ["target", "target_fast", "d k=4"]
    seconds = {"target": 4.0, "target_fast": 2.0, "d k=4": 1.0}
    timings = [Timing(r, p, m, 10, seconds[m] * (1 + r)) for r in range(2) for p in range(2) for m in modes]
    stats = [SpecStats(target_calls=4, draft_calls=4, draft_s=0.4, target_s=0.2),
             SpecStats(target_calls=6, draft_calls=6, draft_s=0.2, target_s=0.4)]
    outputs = {("target", p): Run(ids, 10) for p in range(2)}
    outputs |= {("target_fast", p): Run(ids, 10, SpecStats()) for p in range(2)}
    outputs |= {("d k=4", p): Run(ids if p == 0 else torch.tensor([[1, 2, 4]]), 10, stats[p]) for p in range(2)}
    rows = mod["mode_rows"](modes, timings, outputs, 2)
    assert rows["d k=4"]["speedup"] == 4.0 and rows["target_fast"]["speedup"] == 2.0
    assert rows["d k=4"]["greedy_matches_target"] == 1
    assert rows["d k=4"]["draft_calls"] == 10 and rows["d k=4"]["draft_ms_per_step"] == 60.0
    assert rows["d k=4"]["target_ms_per_call"] == 60.0
    assert "draft_calls" not in rows["target_fast"] and "draft_calls" not in rows["target"]
    lines = mod["table_lines"](rows, 2)
    assert lines[-1].startswith("| d k=4 | ") and lines[-1].endswith("| 60.0 | 60.0 | 1/2 |"), lines[-1]
