"""generate / bench-specdec refuse bad prompts and flags that would do nothing, in one line (exit 2)."""

from __future__ import annotations

import pytest
from helpers import make_tiny_model

from quantspec.cli.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _refused(argv, capsys, needle):
    rc = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("quantspec")]  # no loading bars
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("quantspec: error:") and needle in err[0], err


def test_an_empty_prompt_is_refused(tiny, capsys):
    for draft in ([], ["--draft", "ngram"]):
        _refused(["generate", str(tiny), "--prompt", "", "--max-new-tokens", "2", *draft], capsys, "is no tokens")


@pytest.mark.parametrize("text,needle", [
    ('{"prompt": "a"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"text": "a"}\n', "line 1 has no string field \"prompt\""),
    ('{"prompt": 5}\n', "line 1 has no string field"),
    ('[1, 2]\n', "line 1 has no string field"),
    ('{"prompt": "a"}\n\n{"prompt": "  "}\n', "line 3 has a blank prompt"),
])
def test_bench_specdec_checks_every_prompt_line_before_loading(tmp_path, capsys, text, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(text)
    _refused(["bench-specdec", str(tmp_path / "no-such-model"), "--draft", "ngram", "--prompts", str(prompts)],
             capsys, needle)


@pytest.mark.parametrize("draft", ["self:", "eagle:", " ", "ngram:"])
def test_a_draft_prefix_without_a_path_is_refused(tiny, capsys, draft):
    _refused(["generate", str(tiny), "--prompt", "hi", "--draft", draft], capsys, "'")


@pytest.mark.parametrize("flags,needle", [
    (["--adaptive"], "--adaptive sets speculative decoding"),
    (["--k", "9"], "--k sets speculative decoding"),
    (["--draft-head", "w4g32"], "--draft-head"),
    (["--draft-dtype", "bfloat16"], "--draft-dtype"),
    (["--draft-vocab", "100"], "--draft-vocab"),
    (["--fast-verify"], "--fast-verify"),
    (["--top-p", "0.5"], "--top-p shapes sampling"),
    (["--top-k", "3"], "--top-k shapes sampling"),
    (["--seed", "1"], "--seed shapes sampling"),
    (["--chat"], "has no chat template"),
])
def test_flags_that_would_do_nothing_are_refused(tiny, capsys, flags, needle):
    _refused(["generate", str(tiny), "--prompt", "hi", "--max-new-tokens", "2", *flags], capsys, needle)


def test_sampling_flags_with_a_temperature_still_run(tiny, capsys):
    assert main(["generate", str(tiny), "--prompt", "hi", "--max-new-tokens", "2", "--temperature", "0.8",
                 "--top-p", "0.9", "--top-k", "5", "--seed", "1"]) == 0


def test_a_draft_stops_at_every_stop_token_the_target_alone_stops_at(tmp_path):
    """A model whose generation config lists more stop tokens than its tokenizer's end token
    (Llama-3-Instruct, Gemma-it): ``generate --draft`` ends where ``generate`` does."""
    import json

    import transformers
    from helpers import make_tiny_tokenizer, tiny_model

    model, tok = tiny_model("llama"), make_tiny_tokenizer()
    ids = tok("hello world", return_tensors="pt").input_ids
    free = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    extra = next(t for t in free[2:] if t != tok.eos_token_id)  # a token the target writes, made a stop
    model.generation_config = transformers.GenerationConfig(eos_token_id=[tok.eos_token_id, extra])
    folder = tmp_path / "multi-stop"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    runs = {}
    for name, draft in (("target", []), ("ngram", ["--draft", "ngram"]), ("self", ["--draft", "self:w4g128"])):
        out = tmp_path / f"{name}.json"
        assert main(["generate", str(folder), "--prompt", "hello world", "--max-new-tokens", "12",
                     "--json", str(out), *draft]) == 0
        runs[name] = json.loads(out.read_text())
    stop = free.index(extra) + 1
    assert runs["target"]["new_tokens"] == stop < 12
    assert all((r["new_tokens"], r["text"]) == (stop, runs["target"]["text"]) for r in runs.values())


def test_draft_refusals_name_the_real_problem_before_the_target_loads(tiny, tmp_path, capsys):
    ckpt = tmp_path / "q"
    assert main(["quantize", str(tiny), "--method", "rtn", "--bits", "4", "--group-size", "32", "--out", str(ckpt),
                 "--no-progress"]) == 0
    missing = str(tmp_path / "no-such-target")  # refused before it would be looked for
    _refused(["generate", missing, "--prompt", "hi", "--draft", str(ckpt)], capsys, f"--draft self:{ckpt}")
    _refused(["generate", missing, "--prompt", "hi", "--draft", "self:w4g128", "--draft-head", "w4g7"], capsys,
             "group_size=7")
    _refused(["generate", missing, "--prompt", "hi", "--draft", "self:w4g128", "--draft-head", "fast"], capsys,
             "'fast' is not a scheme name")


def test_work_past_the_declared_context_is_refused(tmp_path, capsys):
    """A model of 32 positions: generating, measuring perplexity or benchmarking past them is
    refused before it runs (learned-position families crash there, RoPE ones extrapolate)."""
    short = make_tiny_model(tmp_path, "llama", max_position_embeddings=32)
    _refused(["generate", str(short), "--prompt", "hi", "--max-new-tokens", "40"], capsys, "context of 32")
    _refused(["generate", str(short), "--prompt", "hi", "--max-new-tokens", "40", "--draft", "ngram"], capsys,
             "context of 32")
    assert main(["generate", str(short), "--prompt", "hi", "--max-new-tokens", "8"]) == 0
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(600)))
    _refused(["eval", str(short), "--ppl", str(text), "--seqlen", "64", "--no-progress"], capsys, "use --seqlen 32")
    _refused(["bench", str(short), "--prompt-lengths", "64", "--no-baseline-run", "--no-progress"], capsys,
             "context of 32")


def test_a_tree_a_sliding_window_cannot_hold_is_refused_before_the_draft_is_built(tmp_path, capsys, monkeypatch):
    from quantspec import specdec

    model = make_tiny_model(tmp_path, "gemma3_text")
    built = []
    monkeypatch.setattr(specdec, "make_proposer", lambda *a, **k: built.append(a))
    _refused(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "80", "--draft", "self:w4g128",
              "--tree", "static"], capsys, "sliding-window")
    assert built == []  # refused before the draft would have been built


def test_the_api_past_a_learned_position_table_names_the_context(tmp_path):
    """speculative_generate (no CLI check before it) on a 128-position GPT-2 run past 128: the
    error names the context, not the cache (it said the forward "refuses incremental decoding")."""
    from helpers import make_tiny_tokenizer, tiny_model

    from quantspec.errors import QuantspecError
    from quantspec.specdec import NGram, speculative_generate

    model, tok = tiny_model("gpt2"), make_tiny_tokenizer()
    ids = tok(" ".join(["word"] * 120), return_tensors="pt").input_ids[:, :120]
    with pytest.raises(QuantspecError, match="context of 128"):
        speculative_generate(model, NGram(), ids, max_new_tokens=40, k=4, fast_verify=False)
