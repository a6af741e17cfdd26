"""bench-specdec's timing plan: the interleaved schedule, medians over repeats (fake clocks, no
timing assertions), and ``quantspec generate --json`` timing setup apart from generation."""

from __future__ import annotations

import json
import time
import types
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import make_tiny_model
from quantspec.cli.main import main
from quantspec.specdec import NGram
from quantspec.specdec.bench import run_bench
from quantspec.specdec.schedule import mode_medians, run_interleaved, schedule


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0, initializer_range=0.1)


def test_schedule_interleaves_repeats_prompts_and_rotates_modes():
    order = schedule(2, 2, ["a", "b", "c"])
    assert order == [
        (0, 0, "a"), (0, 0, "b"), (0, 0, "c"),
        (0, 1, "b"), (0, 1, "c"), (0, 1, "a"),
        (1, 0, "c"), (1, 0, "a"), (1, 0, "b"),
        (1, 1, "a"), (1, 1, "b"), (1, 1, "c"),
    ]
    big = schedule(3, 8, ["target", "ours", "target_fast", "hf_assisted"])
    blocks = [big[i:i + 4] for i in range(0, len(big), 4)]
    assert all(sorted(m for _, _, m in b) == sorted(["target", "ours", "target_fast", "hf_assisted"])
               for b in blocks)
    assert all(len({(r, p) for r, p, _ in b}) == 1 for b in blocks)
    firsts = Counter(b[0][2] for b in blocks)  # 24 blocks: every mode runs first 6 times
    assert firsts == {"target": 6, "ours": 6, "target_fast": 6, "hf_assisted": 6}


def test_medians_over_repeats_from_a_fake_clock():
    """2 prompts x 3 repeats, 4 tokens a run. Seconds a run, by repeat: target 1, 4, 2 (tok/s of
    the repeats 4, 1, 2: median 2, mean 2.33, pooled 24/14); ours 0.5, 0.5, 2 (tok/s 8, 8, 2:
    median 8). Per-repeat ratios 2, 8, 1: median 2 (the ratio of medians would be 4)."""
    clock = [0.0]
    seconds = {"target": [1.0, 4.0, 2.0], "ours": [0.5, 0.5, 2.0]}
    calls = Counter()
    ran = []

    def mode(name):
        def run(p):
            repeat = calls[name] // 2
            calls[name] += 1
            ran.append((repeat, p, name))
            clock[0] += seconds[name][repeat]
            return types.SimpleNamespace(new_tokens=4)
        return run

    timings, outputs = run_interleaved({"target": mode("target"), "ours": mode("ours")},
                                       prompts=2, repeats=3, timer=lambda: clock[0])
    assert ran == schedule(3, 2, ["target", "ours"])
    assert set(outputs) == {(m, p) for m in ("target", "ours") for p in (0, 1)}
    med = mode_medians(timings, base="target")
    assert med["target"]["tokens_per_s_repeats"] == [4.0, 1.0, 2.0]
    assert med["target"]["tokens_per_s"] == 2.0 and med["target"]["speedup"] == 1.0
    assert med["ours"]["tokens_per_s_repeats"] == [8.0, 8.0, 2.0]
    assert med["ours"]["tokens_per_s"] == 8.0
    assert med["ours"]["speedup_repeats"] == [2.0, 8.0, 1.0] and med["ours"]["speedup"] == 2.0
    assert med["ours"]["tokens_repeats"] == [8, 8, 8]
    assert med["ours"]["seconds_repeats"] == [1.0, 1.0, 4.0]


def test_run_bench_reports_the_schedules_medians(tiny_dir):
    """Every timed run lasts exactly one tick of the fake timer, so tokens/s of a mode is its
    tokens over the number of prompts, whatever the machine does."""
    target = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = [{"id": "a", "prompt": "def forward(self, x):\n    return self.linear(x) + 1\n"},
               {"id": "b", "prompt": "The quick brown fox"}]
    ticks = iter(range(10_000))
    result = run_bench(target, tok, NGram(), prompts, max_new_tokens=6, k=3, chat=False, hf=True,
                       repeats=3, timer=lambda: float(next(ticks)))
    assert result["repeats"] == 3 and set(result["modes"]) == {"target", "ours", "target_fast",
                                                               "hf_assisted"}
    for name, m in result["modes"].items():
        assert m["greedy_matches_target"], name
        assert m["seconds_repeats"] == [2.0, 2.0, 2.0]
        assert m["tokens_per_s"] == pytest.approx(m["tokens"] / 2)
        assert m["speedup"] == pytest.approx(m["tokens"] / result["modes"]["target"]["tokens"])
    for p in result["prompts"]:
        assert {m: len(s) for m, s in p["seconds"].items()} == {m: 3 for m in result["modes"]}


@pytest.mark.parametrize("draft", [None, "ngram", "self:w4g64"])
def test_generate_json_times_setup_apart_from_generation(tiny_dir, tmp_path, monkeypatch, draft):
    """Building the proposer is made to take 100 s on generate's clock (no real sleep): the
    speed must stay that of generation, in every mode."""
    import quantspec.cli.generate as generate_cli
    import quantspec.specdec as specdec

    offset = [0.0]
    monkeypatch.setattr(generate_cli, "time",
                        types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    real = specdec.make_proposer

    def slow_factory(*args, **kwargs):
        offset[0] += 100.0
        return real(*args, **kwargs)

    monkeypatch.setattr(specdec, "make_proposer", slow_factory)
    out = tmp_path / "g.json"
    argv = ["generate", str(tiny_dir), "--prompt", "the quick brown fox the quick brown",
            "--max-new-tokens", "8", "--json", str(out)]
    assert main(argv + (["--draft", draft, "--k", "3"] if draft else [])) == 0
    g = json.loads(out.read_text())
    assert g["new_tokens"] > 0
    assert g["tokens_per_s"] > g["new_tokens"] / 100.0  # the 100 s of setup are not in it
    assert g["generate_seconds"] < 100.0
    n, gs = g["new_tokens"], g["generate_seconds"]  # rounded to 3 decimals, tokens/s to 2
    assert n / (gs + 6e-4) - 6e-3 <= g["tokens_per_s"] <= n / max(gs - 6e-4, 1e-9) + 6e-3
    assert (g["setup_seconds"] >= 100.0) == (draft is not None)
    assert g["mode"] == ("speculative" if draft else "target") and g["load_seconds"] >= 0
