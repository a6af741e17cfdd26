"""make_proposer specs, the draft/target compatibility check, the CLI flags and the bench
command end to end on tiny local models (no downloads)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import make_tiny_model, make_tiny_tokenizer
from quantspec.cli.bench_specdec import add_specdec_args, sampling_from_args
from quantspec.errors import QuantspecError
from quantspec.specdec import (
    DraftModel,
    NGram,
    QuantizedSelf,
    make_proposer,
    parse_scheme,
    speculative_generate,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0, initializer_range=0.1)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def test_parse_scheme():
    assert parse_scheme("w4g128").group_size == 128
    assert parse_scheme("w8gpc").group_size == -1 and parse_scheme("w8gpc").bits == 8
    assert not parse_scheme("w4g64-asym").symmetric
    with pytest.raises(QuantspecError):
        parse_scheme("int4")


def test_make_proposer_specs(target, target_dir):
    tok = AutoTokenizer.from_pretrained(target_dir)
    assert isinstance(make_proposer("ngram", target, tok), NGram)
    assert make_proposer("ngram:5", target, tok).max_n == 5
    selfdraft = make_proposer("self:w4g128", target, tok)
    assert isinstance(selfdraft, QuantizedSelf)
    # hidden 64 / intermediate 128: g128 is regrouped where K=64, and the target is untouched
    assert selfdraft.report["regrouped"] and selfdraft.report["quantized"]
    assert all(type(m).__name__ != "QuantLinear" for m in target.modules())
    draft = make_proposer(str(target_dir), target, tok)
    assert isinstance(draft, DraftModel) and not isinstance(draft, QuantizedSelf)
    with pytest.raises(QuantspecError):
        make_proposer("self:w5g128", target, tok)


def test_draft_with_other_vocab_size_is_refused(target, target_dir, tmp_path):
    other = make_tiny_model(tmp_path, "qwen2", seed=1, vocab_size=384)
    with pytest.raises(QuantspecError, match="384 vocabulary logits.*320"):
        make_proposer(str(other), target, AutoTokenizer.from_pretrained(target_dir))


def test_draft_with_other_tokenizer_is_refused(target, target_dir, tmp_path):
    folder = make_tiny_model(tmp_path, "qwen2", seed=1)
    make_tiny_tokenizer(vocab_size=290).save_pretrained(folder)  # other merges, same size cap
    with pytest.raises(QuantspecError, match="tokenize") as err:
        make_proposer(str(folder), target, AutoTokenizer.from_pretrained(target_dir))
    assert "Fix:" in str(err.value)


def test_quantized_checkpoint_as_self_draft(target, target_dir, tmp_path):
    import quantspec

    out = tmp_path / "ckpt"
    quantspec.quantize(str(target_dir), "rtn-w4g128", out=out, progress=False)
    proposer = make_proposer(f"self:{out}", target, AutoTokenizer.from_pretrained(target_dir))
    assert isinstance(proposer, QuantizedSelf)
    ids = torch.tensor([[5, 9, 17, 33, 5, 9]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    out_ids, stats = speculative_generate(target, proposer, ids, max_new_tokens=12, k=3)
    assert torch.equal(out_ids, ref)
    assert stats.accepted > 0


def _head(proposer):
    return proposer.model.get_output_embeddings()


def test_self_draft_head_and_dtype(target, target_dir, tmp_path):
    """The draft's output head: 8 bits by default, the body's scheme, or dense; its dtype."""
    import quantspec
    from quantspec.kernels.quant_linear import QuantLinear
    from quantspec.specdec.factory import draft_dtype

    tok = AutoTokenizer.from_pretrained(target_dir)
    default = make_proposer("self:w4g32", target, tok, dtype=torch.float32)
    assert isinstance(_head(default), QuantLinear) and _head(default).scheme.bits == 8
    same = make_proposer("self:w4g32", target, tok, dtype=torch.float32, head="same")
    assert _head(same).scheme.short_name == "w4g32"
    dense = make_proposer("self:w4g32", target, tok, dtype=torch.float32, head="dense")
    assert type(_head(dense)) is torch.nn.Linear
    assert make_proposer("self:w4g32", target, tok, dtype="bfloat16").model.dtype == torch.bfloat16
    assert draft_dtype(target, "float16") == torch.float16
    assert draft_dtype(target.to(torch.bfloat16)) == torch.bfloat16  # not an fp32 target: its own
    target.to(torch.float32)
    with pytest.raises(QuantspecError, match="floating dtype"):
        draft_dtype(target, "int8")
    with pytest.raises(QuantspecError, match="draft head 'int8' is not a scheme name"):
        make_proposer("self:w4g32", target, tok, head="int8")
    with pytest.raises(QuantspecError, match="64 inputs do not split into groups of 128"):
        make_proposer("self:w4g32", target, tok, head="w8g128")

    out = tmp_path / "ckpt"
    quantspec.quantize(str(target_dir), "rtn-w4g128", out=out, progress=False)
    ckpt = make_proposer(f"self:{out}", target, tok, dtype=torch.float32)
    assert isinstance(_head(ckpt), QuantLinear) and ckpt.report["head"] == "w8gpc"
    assert type(_head(make_proposer(f"self:{out}", target, tok, head="dense"))) is torch.nn.Linear
    ids = torch.tensor([[5, 9, 17, 33, 5, 9]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    for fast in (True, False):
        got, stats = speculative_generate(target, ckpt, ids, max_new_tokens=12, k=3, fast_verify=fast)
        assert torch.equal(got, ref)
        assert stats.draft_s > 0 and stats.target_s > 0


def test_specdec_flags():
    parser = argparse.ArgumentParser()
    add_specdec_args(parser)
    args = parser.parse_args(["--draft", "ngram", "--k", "6", "--adaptive", "--temperature", "0.7",
                              "--top-k", "20", "--top-p", "0.9"])
    assert (args.draft, args.k, args.adaptive) == ("ngram", 6, True)
    s = sampling_from_args(args)
    assert (s.temperature, s.top_k, s.top_p) == (0.7, 20, 0.9)
    assert not parser.parse_args(["--no-adaptive"]).adaptive
    assert sampling_from_args(parser.parse_args([])).greedy
    defaults = parser.parse_args([])
    assert (defaults.fast_verify, defaults.draft_dtype, defaults.draft_head) == (None, "auto", "w8gpc")
    assert not parser.parse_args(["--no-fast-verify"]).fast_verify


def test_bench_specdec_command(target_dir, tmp_path):
    from quantspec.cli.main import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "kind": "code-edit", "prompt": "def forward(self, x):\n    return self.linear(x) + 1\n"},
        {"id": "b", "kind": "prose", "prompt": "The quick brown fox"},
    ]))
    out = tmp_path / "r.json"
    rc = main(["bench-specdec", str(target_dir), "--draft", "self:w4g64", "--prompts", str(prompts),
               "--max-new-tokens", "8", "--k", "3", "--json", str(out), "--threads", "1",
               "--repeats", "2"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"target", "ours", "target_fast", "hf_assisted"}
    assert result["repeats"] == 2 and "agreement" not in result
    assert all(len(m["tokens_per_s_repeats"]) == 2 for m in result["modes"].values())
    for mode in result["modes"].values():
        assert mode["greedy_matches_target"], mode
    assert result["modes"]["ours"]["tokens"] == result["modes"]["target"]["tokens"] > 0
    assert len(result["prompts"]) == 2
    assert main(["bench-specdec", str(target_dir), "--draft", "ngram", "--prompts", str(prompts),
                 "--kinds", "nothing"]) == 2  # bad input: exit code 2
