"""Draft heads over part of the vocabulary (specdec.draft_vocab, ``--draft-vocab``): the token
ranking, the head's logits against the full head's, the tokens of the text it continues, and
speculative decoding with such a draft staying lossless (tiny local models, no downloads)."""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers import make_tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantspec.cli.bench_specdec import add_specdec_args
from quantspec.errors import QuantspecError
from quantspec.specdec import draft_vocab, make_proposer, speculative_generate
from quantspec.specdec.draft_vocab import PrunedHead, frequent_tokens, head_rows


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls on a shared CPU


@pytest.fixture(autouse=True)
def _small_corpus(monkeypatch):
    """Rank tokens on the bundled C4 documents only (the standard library is 3M tokens: slow to
    tokenize once with each new tiny tokenizer)."""
    monkeypatch.setattr(draft_vocab, "FREQUENCY_SOURCES", ("c4-bundled",))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0, initializer_range=0.1)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(target_dir):
    return AutoTokenizer.from_pretrained(target_dir)


def test_frequent_tokens_ranks_streams_equally():
    prose, code = torch.tensor([5, 5, 5, 2]), torch.tensor([7])
    # frequencies: 7 -> 1.0 (its stream), 5 -> 0.75, 2 -> 0.25
    assert frequent_tokens([prose, code], 2, 10).tolist() == [5, 7]
    assert frequent_tokens([prose, code], 3, 10).tolist() == [2, 5, 7]
    assert frequent_tokens([prose, code], 2, 10, always=[9]).tolist() == [7, 9]
    assert frequent_tokens([torch.tensor([3, 1])], 1, 10).tolist() == [1]  # a tie: the lower id
    assert frequent_tokens([prose], 4, 10).tolist() == [0, 1, 2, 5]  # unseen tokens fill by id
    assert frequent_tokens([prose], 50, 10).tolist() == list(range(10))


def test_pruned_head_scores_its_tokens_and_added_ones():
    torch.manual_seed(0)
    full = nn.Linear(16, 40, bias=True)
    ids = torch.tensor([0, 3, 7, 20])
    head = PrunedHead(head_rows(full, ids), ids, 40, source=full)
    x = torch.randn(2, 3, 16)
    ref = full(x)
    out = head(x)
    assert out.shape == (2, 3, 40)
    # fp32: within 1e-5 (the few-row product sums in another order than torch's; kernels/dense.py)
    torch.testing.assert_close(out[..., ids], ref[..., ids], rtol=1e-5, atol=1e-5)
    rest = torch.ones(40, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[..., rest]).all()
    assert head.add_tokens(torch.tensor([[5, 7], [5, 39]])) == 2  # 7 is scored already
    assert head.add_tokens(torch.tensor([39])) == 0
    out = head(x)
    for t in (0, 3, 5, 7, 20, 39):
        torch.testing.assert_close(out[..., t], ref[..., t], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(out[..., 6]).all()
    head.reset_tokens()
    assert torch.isneginf(head(x)[..., 5]).all()
    # the source head is read, never owned: moving the draft leaves it alone
    assert all(p is not full.weight for p in head.parameters())
    head.to(torch.bfloat16)
    assert full.weight.dtype == torch.float32


def test_pruned_head_refuses_ids_outside_the_vocabulary():
    full = nn.Linear(4, 10)
    with pytest.raises(ValueError, match="subset"):
        PrunedHead(head_rows(full, torch.tensor([1, 2])), torch.tensor([1, 12]), 10)


@pytest.mark.parametrize("spec", ["self:w4g32", "model"])
def test_pruned_draft_stays_lossless(target, target_dir, tok, spec):
    """A draft that scores 40 of 320 tokens: the target writes tokens outside them, the output is
    still the target's greedy output, and the draft proposes only tokens it scores."""
    spec = str(target_dir) if spec == "model" else spec
    prop = make_proposer(spec, target, tok, vocab=40)
    assert isinstance(prop.model.get_output_embeddings(), PrunedHead) and prop.pruned is not None
    ids = torch.tensor([[5, 9, 17, 33, 5, 9, 101, 250]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    base = set(prop.pruned.token_ids.tolist())
    assert not set(ref[0, ids.shape[1]:].tolist()) <= base  # the set misses some target tokens
    for fast in (True, False):
        got, stats = speculative_generate(target, prop, ids, max_new_tokens=24, k=3, fast_verify=fast)
        assert torch.equal(got, ref)
        assert stats.accepted > 0
    # after the run, the prompt's tokens and written ones (those the draft caught up on) are scored too
    scored = set(prop.pruned.scored.nonzero().flatten().tolist())
    added = set(prop.pruned.extra_ids.tolist())
    assert set(ids[0].tolist()) <= scored and added - set(ids[0].tolist())
    assert added <= set(ref[0].tolist()) - base
    prop.reset()
    proposal = prop.propose([ids[0]], 4, _greedy())
    assert set(proposal.tokens.flatten().tolist()) <= base | set(ids[0].tolist())


def _greedy():
    from quantspec.specdec.sampling import SamplingConfig

    return SamplingConfig()


def test_pruned_draft_keeps_its_special_tokens_and_report(target, tok):
    prop = make_proposer("self:w4g32", target, tok, vocab=16)
    kept = set(prop.pruned.token_ids.tolist())
    assert set(tok.all_special_ids) <= kept and prop.report["draft_vocab"] == 16
    assert make_proposer("self:w4g32", target, tok, vocab=320).pruned is None  # the whole vocabulary
    assert make_proposer("self:w4g32", target, tok).pruned is None


def test_draft_vocab_refusals(target, tok):
    with pytest.raises(QuantspecError, match="n-?gram|has none of its own"):
        make_proposer("ngram", target, tok, vocab=64)
    with pytest.raises(QuantspecError, match="negative"):
        make_proposer("self:w4g32", target, tok, vocab=-1)
    with pytest.raises(QuantspecError, match="special tokens"):
        make_proposer("self:w4g32", target, tok, vocab=2)
    with pytest.raises(QuantspecError, match="tokenizer"):
        make_proposer("self:w4g32", target, None, vocab=64)


def test_draft_vocab_flag():
    parser = argparse.ArgumentParser()
    add_specdec_args(parser)
    assert parser.parse_args(["--draft", "self:w4g128", "--draft-vocab", "32768"]).draft_vocab == 32768
    assert parser.parse_args(["--draft", "self:w4g128"]).draft_vocab is None  # make_proposer's default
    assert f"default: {draft_vocab.DEFAULT_DRAFT_VOCAB}" in " ".join(parser.format_help().split())


def test_default_prunes_only_larger_vocabularies(tmp_path, tok):
    """The default (DEFAULT_DRAFT_VOCAB) prunes a head of more logits than it, and leaves a smaller
    one whole (the 320 of the other tests); 0 keeps every token."""
    big_dir = make_tiny_model(tmp_path, "llama", seed=0, vocab_size=draft_vocab.DEFAULT_DRAFT_VOCAB + 100)
    big = AutoModelForCausalLM.from_pretrained(big_dir, dtype=torch.float32).eval()
    prop = make_proposer("self:w8gpc", big, tok)
    assert prop.pruned is not None and prop.pruned.token_ids.numel() == draft_vocab.DEFAULT_DRAFT_VOCAB
    assert prop.model.get_output_embeddings().out_features == draft_vocab.DEFAULT_DRAFT_VOCAB + 100
    assert make_proposer("self:w8gpc", big, tok, vocab=0).pruned is None
