"""The lm-eval adapter against direct computations on a tiny random model (local tasks, offline)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from helpers import make_tiny_model  # noqa: E402

from quantspec.eval.lmeval_adapter import MODEL_NAME, register, run_lm_eval  # noqa: E402

TASKS = Path(__file__).parent / "data" / "lmeval_tasks"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lmeval"), "llama", seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """The task YAMLs with their data_files made absolute (datasets resolves them from the cwd)."""
    out = tmp_path_factory.mktemp("tasks")
    for y in TASKS.glob("*.yaml"):
        text = re.sub(r"test: (\S+\.jsonl)", lambda m: f"test: {TASKS / m.group(1)}", y.read_text())
        (out / y.name).write_text(text)
    return out


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _rows(name):
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line.strip()]


@torch.no_grad()
def _logprob(model, ids: list[int], start: int) -> float:
    """Sum of log p(ids[t] | ids[:t]) for t >= start."""
    logits = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return float(sum(logits[t - 1, ids[t]] for t in range(start, len(ids))))


@pytest.fixture(scope="module")
def direct(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def both(tiny, tasks_dir):
    """One lm-eval run of both local tasks through the adapter (batch 4: padding is exercised)."""
    import os

    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    try:
        return run_lm_eval(str(tiny), ["quantspec_tiny_mc", "quantspec_tiny_rolling"], include_path=tasks_dir,
                           batch_size=4, device="cpu", log_samples=True)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_multiple_choice_matches_direct_logprobs(both, direct):
    model, tok = direct
    res = both
    rows = _rows("tiny_mc.jsonl")
    correct = 0
    samples = sorted(res["samples"]["quantspec_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(rows) == 10
    for row, sample in zip(rows, samples):
        ctx = f"Question: {row['question']}\nAnswer:"
        n_ctx = len(tok(ctx, add_special_tokens=False).input_ids)
        lps = []
        for choice in row["choices"]:
            whole = tok(ctx + " " + choice, add_special_tokens=False).input_ids
            lps.append(_logprob(model, whole, n_ctx))
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == pytest.approx(lps, abs=1e-3)
        correct += int(max(range(3), key=lambda i: lps[i]) == row["answer"])
    assert res["tasks"]["quantspec_tiny_mc"]["acc"] == pytest.approx(correct / len(rows))


def test_rolling_loglikelihood_matches_our_nll(both, direct):
    model, tok = direct
    res = both
    texts = [r["text"] for r in _rows("tiny_rolling.jsonl")]
    total_ll, words, nbytes = 0.0, 0, 0
    for text in texts:
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids  # HFLM's prefix token
        total_ll += _logprob(model, ids, 1)
        words += len(re.split(r"\s+", text))
        nbytes += len(text.encode("utf-8"))
    metrics = res["tasks"]["quantspec_tiny_rolling"]
    assert metrics["word_perplexity"] == pytest.approx(math.exp(-total_ll / words), rel=1e-4)
    assert metrics["bits_per_byte"] == pytest.approx(-total_ll / nbytes / math.log(2), rel=1e-4)
    assert res["n_samples"]["quantspec_tiny_rolling"]["effective"] == 4


def test_register_is_idempotent():
    cls = register()
    assert register() is cls
    from lm_eval.api.registry import get_model

    assert get_model(MODEL_NAME) is cls


def test_cli_shim_runs_lm_eval(tiny, tasks_dir, tmp_path, capsys):
    """``python -m quantspec.eval.lmeval_adapter --model quantspec ...`` = lm_eval's CLI + our model.

    Run in-process (a subprocess would pay lm-eval's import again); main() is what -m calls.
    """
    from quantspec.eval.lmeval_adapter import main

    out = tmp_path / "res"
    argv = ["--model", "quantspec", "--model_args", f"path={tiny}", "--tasks", "quantspec_tiny_mc",
            "--include_path", str(tasks_dir), "--device", "cpu", "--limit", "3", "--output_path", str(out)]
    assert main(argv) == 0
    assert "quantspec_tiny_mc" in capsys.readouterr().out
    results = list(out.rglob("results_*.json"))
    assert results and "quantspec_tiny_mc" in json.loads(results[0].read_text())["results"]


def test_unknown_task_is_a_clear_error_before_loading(tasks_dir):
    from quantspec.errors import QuantspecError

    with pytest.raises(QuantspecError, match="quantspec_tiny_mcx") as err:
        run_lm_eval("/nonexistent/model", ["quantspec_tiny_mcx"], include_path=tasks_dir)
    assert "quantspec_tiny_mc" in str(err.value)  # the close match is suggested
