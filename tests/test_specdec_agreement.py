"""Teacher-forced greedy agreement of a draft with its target, on a tiny model: a draft equal to
the target agrees everywhere; a draft whose blocks add nothing (o_proj and down_proj zeroed)
predicts the next token from the current one alone, a bigram table computed here by hand."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import make_tiny_model
from quantspec.cli.main import main
from quantspec.specdec import DraftModel
from quantspec.specdec.agreement import greedy_agreement, teacher_forced_matches

PROMPTS = [{"id": "a", "prompt": "def forward(self, x):\n    return self.linear(x) + 1\n"},
           {"id": "b", "prompt": "The quick brown fox"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, fp32 model, tokenizer) of a tiny random Llama."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0, initializer_range=0.1)
    return (folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def target(tiny):
    return tiny[1]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[2]


def _bigram_draft(target) -> tuple[DraftModel, torch.Tensor]:
    """A copy whose blocks add nothing to the residual stream, and its next-token table:
    table[t] = argmax(W_head @ (g * e_t / rms(e_t))), e_t the embedding of t, g the final norm."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    e = draft.model.embed_tokens.weight.detach()
    eps = draft.config.rms_norm_eps
    h = draft.model.norm.weight.detach() * e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + eps)
    table = (h @ draft.lm_head.weight.detach().T).argmax(-1)
    return DraftModel(draft, name="bigram"), table


def test_identical_draft_agrees_everywhere(target, tokenizer):
    result = greedy_agreement(target, DraftModel(copy.deepcopy(target)), tokenizer, PROMPTS,
                              max_new_tokens=12, chat=False)
    assert result["positions"] == sum(r["positions"] for r in result["prompts"]) > 0
    assert result["agreement"] == 1.0 and result["matches"] == result["positions"]
    assert all(r["first_miss"] is None for r in result["prompts"])


def test_bigram_draft_on_a_hand_made_sequence(target):
    draft, table = _bigram_draft(target)
    t = table.tolist()
    x = next(v for v in range(3, 300) if v != t[t[9]])  # breaks the chain after T[9]
    y = next(v for v in range(3, 300) if v != t[t[t[x]]])
    seq = torch.tensor([5, 9, t[9], x, t[x], t[t[x]], y])
    assert teacher_forced_matches(draft, seq, prompt_len=2) == [True, False, True, True, False]


def test_bigram_draft_on_the_targets_greedy_tokens(target, tokenizer):
    """The target: attention off and the last MLP at a tenth (each next token still depends on
    the current one alone, but not always as the table says), so the draft agrees on some
    positions and misses others."""
    near = copy.deepcopy(target)
    with torch.no_grad():
        for layer in near.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.mul_(0.1)
        near.model.layers[0].mlp.down_proj.weight.zero_()
    draft, table = _bigram_draft(target)
    result = greedy_agreement(near, draft, tokenizer, PROMPTS, max_new_tokens=16, chat=False)
    matches = positions = 0
    for row, rec in zip(PROMPTS, result["prompts"]):
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        seq = near.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)[0]
        p = ids.shape[1]
        hits = [int(table[seq[i - 1]]) == int(seq[i]) for i in range(p, len(seq))]
        assert (rec["positions"], rec["matches"]) == (len(hits), sum(hits))
        assert rec["first_miss"] == (hits.index(False) if False in hits else None)
        matches, positions = matches + sum(hits), positions + len(hits)
    assert result["agreement"] == round(matches / positions, 4)
    assert 0 < matches < positions  # the case tells a right count from 0 and from 1


def test_bench_specdec_agreement_command(tiny, tmp_path):
    tiny_dir = tiny[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in PROMPTS))
    out = tmp_path / "a.json"
    common = ["bench-specdec", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "8"]
    assert main(common + ["--draft", str(tiny_dir), "--draft-dtype", "float32", "--no-timing",
                          "--agreement", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["agreement"]["agreement"] == 1.0 and result["agreement"]["positions"] > 0
    assert "modes" not in result and result["draft_dtype"] == "float32"
    assert main(common + ["--draft", "self:w4g64", "--no-timing"]) == 2  # measures nothing
    assert main(common + ["--draft", "ngram", "--agreement"]) == 2  # no logits to compare
    assert main(common + ["--draft", "ngram", "--repeats", "0"]) == 2
