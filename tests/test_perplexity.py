"""Perplexity protocol against hand computations (tiny random model, uniform model)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_tiny_model, make_tiny_tokenizer
from transformers import AutoModelForCausalLM

from quantspec.data import TextSource
from quantspec.errors import QuantspecError
from quantspec.eval.perplexity import perplexity, window_starts

TEXT = " ".join(f"Sentence number {i} talks about quantized weights and draft models." for i in range(16))


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("ppl"), "llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, make_tiny_tokenizer()


def hand_nll(model, ids: list[int], seqlen: int, stride: int, windows: int | None):
    """Sum of -log p(target) and count, scored token by token with a plain loop."""
    total, count, j = 0.0, 0, 0
    while j * stride + seqlen <= len(ids) and (windows is None or j < windows):
        window = torch.tensor([ids[j * stride : j * stride + seqlen]])
        logp = torch.log_softmax(model(input_ids=window).logits[0].double(), dim=-1)
        first = 1 if (j == 0 or stride == seqlen) else seqlen - stride
        for t in range(first, seqlen):
            total -= float(logp[t - 1, window[0, t]])
            count += 1
        j += 1
    return total, count


@pytest.mark.parametrize("seqlen, stride, windows, batch", [(32, None, 5, 1), (32, None, None, 3), (24, 8, 7, 2)])
@torch.no_grad()
def test_matches_hand_computation(tiny, seqlen, stride, windows, batch):
    model, tok = tiny
    source = TextSource(TEXT, "tiny-text", "test")
    ids = tok(TEXT)["input_ids"]
    out = perplexity(model, tok, source, seqlen=seqlen, windows=windows, stride=stride, progress=False,
                     batch_size=batch)
    total, count = hand_nll(model, ids, seqlen, stride or seqlen, windows)
    assert out["tokens"] == count and out["data"] == "tiny-text"
    assert out["nll"] == pytest.approx(total / count, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
    expected_windows = len(window_starts(len(ids), seqlen, stride or seqlen, windows))
    assert out["windows"] == expected_windows and out["stride"] == (stride or seqlen)


def test_window_counts():
    assert window_starts(100, 32, 32, None) == [0, 32, 64]  # tail of 4 tokens dropped
    assert window_starts(100, 32, 32, 2) == [0, 32]
    assert window_starts(100, 32, 16, None) == [0, 16, 32, 48, 64]
    assert window_starts(10, 32, 32, None) == []


class Uniform(torch.nn.Module):
    """Returns zero logits: a uniform distribution over ``vocab`` tokens."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab) + self.dummy
        return type("Out", (), {"logits": logits})()


def test_uniform_model_has_ppl_vocab_size():
    tok = make_tiny_tokenizer()
    out = perplexity(Uniform(500), tok, TextSource(TEXT, "u", "test"), seqlen=16, windows=None, progress=False)
    assert out["ppl"] == pytest.approx(500.0, rel=1e-6)  # fp32 log-softmax
    assert out["tokens"] == out["windows"] * 15


def test_token_cache_reused_and_keyed_by_text(tiny, tmp_path, monkeypatch):
    from quantspec.data import tokens

    monkeypatch.setattr(tokens, "CACHE_MIN_CHARS", 0)
    model, tok = tiny
    a = perplexity(model, tok, TextSource(TEXT, "same-label", "x"), seqlen=32, windows=2, progress=False)
    files = list((tmp_path / "cache" / "tokens").iterdir())
    assert len(files) == 1
    b = perplexity(model, tok, TextSource(TEXT, "same-label", "x"), seqlen=32, windows=2, progress=False)
    assert a["ppl"] == b["ppl"] and len(list((tmp_path / "cache" / "tokens").iterdir())) == 1
    perplexity(model, tok, TextSource(TEXT[::-1], "same-label", "x"), seqlen=32, windows=2, progress=False)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2


def test_bad_arguments(tiny):
    model, tok = tiny
    src = TextSource(TEXT, "t", "x")
    with pytest.raises(QuantspecError, match="fewer than one window"):
        perplexity(model, tok, TextSource("too short", "s", "x"), seqlen=64, progress=False)
    with pytest.raises(QuantspecError, match="stride"):
        perplexity(model, tok, src, seqlen=16, stride=32, progress=False)
    with pytest.raises(QuantspecError, match="seqlen"):
        perplexity(model, tok, src, seqlen=1, progress=False)


def test_pydoc_by_name(tiny):
    model, tok = tiny
    out = perplexity(model, tok, "pydoc", seqlen=32, windows=2, progress=False)
    assert out["data"] == "pydoc (built-in fallback corpus)" and out["tokens"] == 62
    assert 1.0 < out["ppl"] < 1e4
