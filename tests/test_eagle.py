"""EAGLE draft heads (quantspec/specdec/eagle/) on tiny random models.

Lossless: greedy output with an EAGLE draft equals ``target.generate`` token for token (both
verification runtimes, batch 2 with left padding), and sampled output follows the target's
exact law (chi-square). The loop hands the head exactly the target's features of the committed
tokens. Training: it learns (held-out agreement above an untrained head's), a stopped run
resumes to the same head bit for bit, target features are computed once, and bad input is
refused in one line.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from helpers import make_tiny_model, tiny_model
from test_specdec_loop import _chi2, _exact_two_token_laws, left_pad, reference

from quantspec.errors import QuantspecError
from quantspec.kernels.cpu_ext import load_cpu_ext
from quantspec.quant.rtn import rtn
from quantspec.specdec import SamplingConfig, speculative_generate
from quantspec.specdec.eagle import features as features_mod
from quantspec.specdec.eagle import train as train_mod
from quantspec.specdec.eagle.draft_weights import LINEARS, quantize_head
from quantspec.specdec.eagle.features import model_features
from quantspec.specdec.eagle.head import EagleConfig, EagleHead, load_head
from quantspec.specdec.eagle.proposer import EagleProposer, eagle_proposer
from quantspec.specdec.eagle.train import TrainConfig, draft_vocabulary, train_head
from quantspec.specdec.factory import make_proposer
from quantspec.specdec.selfdraft import DRAFT_HEAD

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls on a shared CPU


def target(arch: str = "llama", vocab: int = 256, seed: int = 0):
    return tiny_model(arch, seed, vocab_size=vocab, initializer_range=0.1)


def random_head(model, draft_vocab: int, seed: int = 0) -> EagleHead:
    """An untrained head (random layer) over the ``draft_vocab`` lowest token ids."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(EagleConfig.for_target(model.config, draft_vocab))
    head.set_vocabulary(torch.arange(draft_vocab), model.get_output_embeddings().weight)
    return head.eval()


def greedy_reply(model, prompt: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
    """``generate(do_sample=False)``'s window of ``length`` tokens after ``prompt``, ended at the
    model's first stop token as self-distillation ends it (the rest that token), and its length."""
    ref = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.int64),
                         do_sample=False, max_new_tokens=length - prompt.numel(), eos_token_id=None,
                         pad_token_id=0)[0][:length]
    stops = model.generation_config.eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops or [])
    end = next((i + 1 for i in range(prompt.numel(), length) if int(ref[i]) in stops), length)
    return torch.cat([ref[:end], ref[end - 1].repeat(length - end)]), end


def self_windows(model, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """Text the target itself wrote (sampled from its top 4): windows a head can learn."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(3, model.config.vocab_size, (n, 4), generator=g)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return model.generate(starts, attention_mask=torch.ones_like(starts), do_sample=True, top_k=4,
                              max_new_tokens=length - 4)


def test_head_files_round_trip(tmp_path):
    model = target()
    head = random_head(model, 100)
    head.save(tmp_path)
    again = load_head(tmp_path)
    assert again.config == head.config
    for (k, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(QuantspecError, match="not an EAGLE head"):
        load_head(tmp_path / "missing")


@pytest.mark.parametrize("arch,fast_verify,weights", [("llama", True, None), ("llama", False, None),
                                                      ("qwen2", True, None), ("llama", True, DRAFT_HEAD)])
def test_greedy_with_an_eagle_draft_equals_target_generate(arch, fast_verify, weights):
    model = target(arch)
    rows = [torch.arange(20, 31), torch.tensor([9, 40, 41, 42, 40, 41])]
    refs = [reference(model, r) for r in rows]
    head = random_head(model, 200)
    if weights is not None:  # the head's weights quantized for drafting (eagle_proposer's default)
        quantize_head(head, weights)
    prop = EagleProposer(head, model.get_input_embeddings())
    ids, mask = left_pad(rows)
    out, stats = speculative_generate(model, prop, ids, attention_mask=mask, max_new_tokens=20, k=3,
                                      fast_verify=fast_verify)
    for b, ref in enumerate(refs):
        assert torch.equal(out[b, ids.shape[1]:ids.shape[1] + len(ref)], ref)
    assert stats.proposed > 0 and stats.draft_calls > 0


# Each of the head's products runs in the CPU extension, within test_cpu_backend's EXT_TOL (2e-2, its
# int8 activations) of the dequantized weights' product; the layer chains four of them (fc, attention,
# o_proj, the MLP), and its logits one more: 4e-2 of the largest value, fp32 (observed ~1e-2).
QUANTIZED_HEAD_TOL = 4e-2


def test_a_head_quantized_for_drafting_computes_its_rounded_weights():
    """``quantize_head`` swaps every Linear and the LM-head rows for 8-bit layers: the head then
    computes what a dense head with the RTN-rounded weights computes (its features and its
    logits), each layer in the report. A head quantized for drafting is never saved."""
    if load_cpu_ext() is None:
        pytest.skip("no C++ CPU extension here (the tolerance is the extension's)")
    model = target()
    dense = random_head(model, 200)
    head = copy.deepcopy(dense)
    report = quantize_head(head, DRAFT_HEAD)
    assert report == {name: "w8gpc" for name in (*LINEARS, "lm_head")}
    rounded = copy.deepcopy(dense)
    with torch.no_grad():
        for name in LINEARS:
            w = getattr(rounded, name).weight
            w.copy_(rtn(w, DRAFT_HEAD).dequantize(torch.float32))
        rounded.lm_head.copy_(rtn(rounded.lm_head, DRAFT_HEAD).dequantize(torch.float32))
    g = torch.Generator().manual_seed(0)
    feats, emb = torch.randn(2, 1, 12, 64, generator=g)
    pos = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        got, _ = head(feats, emb, pos)
        want, _ = rounded(feats, emb, pos)
        assert (got - want).abs().max() <= QUANTIZED_HEAD_TOL * want.abs().max()
        assert (head.logits(want) - rounded.logits(want)).abs().max() <= QUANTIZED_HEAD_TOL * rounded.logits(want).abs().max()
        assert not torch.equal(rounded.lm_head, dense.lm_head)  # the rounding is real: a dense head differs
    with pytest.raises(ValueError, match="not saved"):
        head.save("/nonexistent-never-written")


def test_layers_a_format_cannot_hold_stay_dense_and_are_reported(tmp_path):
    """A draft vocabulary of 201 rows does not pack into 8-bit GPTQ (rows in fours): the LM-head
    rows stay dense with the reason, the layer is quantized; the proposer's report says so, and
    ``--draft-head dense`` keeps the whole head as trained."""
    model = target()
    random_head(model, 201).save(tmp_path / "h")
    prop = eagle_proposer(str(tmp_path / "h"), model)
    weights = prop.report["weights"]
    assert weights["lm_head"].startswith("dense: ") and "multiple of 4" in weights["lm_head"], weights
    if load_cpu_ext() is not None:
        assert all(weights[name] == "w8gpc" for name in LINEARS), weights
    assert make_proposer(f"eagle:{tmp_path / 'h'}", model, head="dense").report == {"weights": "dense"}
    with pytest.raises(QuantspecError, match="an eagle: head has none"):
        make_proposer(f"eagle:{tmp_path / 'h'}", model, head="same")


class _Spy(EagleProposer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[list[torch.Tensor]] = []

    def observe(self, features):
        self.seen.append([f.clone() for f in features])
        super().observe(features)


@pytest.mark.parametrize("fast_verify", [True, False])
def test_the_loop_hands_over_the_targets_features_of_committed_tokens(fast_verify):
    """Concatenated, what ``observe`` got for a row is the target's own features of every
    committed token but the last (fp32, 1e-4 relative), whatever was accepted or rejected."""
    model = target()
    prompt = torch.arange(30, 39)
    spy = _Spy(random_head(model, 256), model.get_input_embeddings())
    out, stats = speculative_generate(model, spy, prompt, max_new_tokens=16, k=3, fast_verify=fast_verify)
    assert stats.accepted < stats.proposed  # rejections happened (an untrained head)
    got = torch.cat([step[0] for step in spy.seen])
    committed = out[0]
    want = model_features(model, committed[None, :-1])[0]
    assert got.shape == want.shape  # every committed token but the last, once
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


class _Oracle(_Spy):
    """Proposes the target's own greedy continuation (every draft accepted) and still takes
    the target's features through ``observe``."""

    def __init__(self, model, prompt, *a, **kw):
        super().__init__(*a, **kw)
        self.prompt_len, self.continuation = len(prompt), reference(model, prompt, 30)

    def propose(self, sequences, k, sampling, generator=None):
        from quantspec.specdec.proposers import Proposal

        at = len(sequences[0]) - self.prompt_len
        return Proposal(tokens=self.continuation[at:at + k].unsqueeze(0), model_calls=0)


def test_a_step_cut_by_a_stop_token_hands_over_only_committed_features():
    """All 4 drafts accepted, but the stop token is the second: the features of the 2 tokens
    never committed after it must not reach the proposer."""
    model = target()
    prompt = torch.arange(30, 39)
    spy = _Oracle(model, prompt, random_head(model, 256), model.get_input_embeddings())
    stop = int(spy.continuation[1])
    out, stats = speculative_generate(model, spy, prompt, max_new_tokens=16, k=4, eos_token_id=stop)
    assert out.shape[1] == len(prompt) + 2 and stats.accepted == 4
    got = torch.cat([step[0] for step in spy.seen])
    assert got.shape[0] == out.shape[1] - 1


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.8, top_k=8, top_p=0.9)])
def test_sampling_with_an_eagle_draft_matches_the_target_law(sampling):
    """1,500 rows of one prompt, vocabulary 16, a draft vocabulary of 12 tokens (q is 0 on 4)."""
    model = tiny_model("llama", 3, vocab_size=16, initializer_range=0.1)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([3, 7, 5, 9])
    prop = EagleProposer(random_head(model, 12), model.get_input_embeddings())
    n = 1500
    out, stats = speculative_generate(model, prop, prompt.expand(n, -1), max_new_tokens=2, k=2,
                                      sampling=sampling, seed=11)
    p1, p2 = _exact_two_token_laws(model, prompt, sampling)
    assert _chi2(torch.bincount(out[:, 4], minlength=16), p1) > 1e-3
    assert _chi2(torch.bincount(out[:, 5], minlength=16), p2) > 1e-3
    assert 0 < stats.acceptance_rate < 1


def test_draft_vocabulary_is_the_most_frequent_next_tokens():
    tokens = torch.tensor([[0, 5, 5, 5, 2, 2, 7], [1, 7, 3, 3, 3, 3, 9]])
    # next tokens (column 0 dropped): 3 x4, 5 x3, 2 x2, 7 x2, 9 x1; ties go to the lower id
    assert draft_vocabulary(tokens, 3, 10).tolist() == [2, 3, 5]
    assert draft_vocabulary(tokens, 4, 10).tolist() == [2, 3, 5, 7]


def test_training_learns():
    """Held-out top-1 agreement with the target: a trained head well above an untrained one
    (measured 0.073 vs ~0.01 at depth 1 on this setup while it was written)."""
    model = target()
    windows = self_windows(model, 40, 32)
    cfg = TrainConfig(samples=40, seqlen=32, epochs=8, batch_size=4, lr=3e-3, draft_vocab=256, val_fraction=0.2,
                      unroll=2, prompts="text")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = train_head(model, windows, cfg, tmp, {"target": "tiny"}, progress=False)
    held = report["history"][-1]["val_agreement"]
    val = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:8]
    feats = model_features(model, windows[val])
    emb = model.get_input_embeddings()(windows[val][:, 1:])
    every = torch.ones(emb.shape[:2], dtype=torch.bool)
    untrained = train_mod.agreement(random_head(model, 256), [(feats, emb, every)],
                                    model.get_output_embeddings().weight, 2)
    assert held[0] >= untrained[0] + 0.03, (held, untrained)
    assert report["history"][-1]["loss"] < report["history"][0]["loss"]


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_a_stopped_training_resumes_to_the_same_head(tmp_path, monkeypatch, noise):
    """Bit for bit, also with input-feature noise (drawn per step from the seed)."""
    model = target()
    windows = self_windows(model, 30, 32)
    cfg = TrainConfig(samples=30, seqlen=32, epochs=2, batch_size=4, draft_vocab=256, val_fraction=0.2, save_every=3,
                      noise=noise, unroll=2, prompts="text")
    key = {"target": "tiny"}
    full = train_head(model, windows, cfg, tmp_path / "full", key, progress=False)
    if noise:  # the noise is applied: the head differs from one trained without it
        quiet = train_head(model, windows, TrainConfig(**{**cfg.__dict__, "noise": 0.0}), tmp_path / "quiet", key,
                           progress=False)
        assert quiet["history"][-1]["loss"] != full["history"][-1]["loss"]
    calls = {"n": 0}
    real = torch.nn.utils.clip_grad_norm_

    def dying(*a, **kw):  # the 8th training step dies; the state was saved at step 6
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dying)
    with pytest.raises(KeyboardInterrupt):
        train_head(model, windows, cfg, tmp_path / "cut", key, progress=False)
    assert not (tmp_path / "cut" / "eagle_head.safetensors").exists()
    assert torch.load(tmp_path / "cut" / "train_state.pt", weights_only=False)["step"] == 6
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real)
    resumed = train_head(model, windows, cfg, tmp_path / "cut", key, progress=False)
    assert resumed["history"] == full["history"]
    a, b = load_head(tmp_path / "full"), load_head(tmp_path / "cut")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    with pytest.raises(QuantspecError, match="other settings"):
        train_head(model, windows, TrainConfig(**{**cfg.__dict__, "lr": 1e-4}), tmp_path / "cut", key,
                   progress=False)


def test_features_are_computed_once_and_never_mixed(tmp_path, monkeypatch):
    model = target()
    windows = torch.randint(3, 256, (10, 16), generator=torch.Generator().manual_seed(2))
    calls = {"n": 0}
    real = features_mod.model_features

    def counting(m, ids):
        calls["n"] += ids.shape[0]
        return real(m, ids)

    monkeypatch.setattr(features_mod, "model_features", counting)
    paths = features_mod.extract_features(model, windows, tmp_path, {"t": 1}, shard_size=4, progress=False)
    assert calls["n"] == 10 and len(paths) == 3
    paths[1].unlink()  # a run stopped before the second shard was written
    features_mod.extract_features(model, windows, tmp_path, {"t": 1}, shard_size=4, progress=False)
    assert calls["n"] == 14
    tokens, feats = features_mod.load_features(paths)
    assert torch.equal(tokens, windows)
    torch.testing.assert_close(feats.float(), real(model, windows), rtol=1e-2, atol=1e-2)
    with pytest.raises(QuantspecError, match="another run"):
        features_mod.extract_features(model, windows, tmp_path, {"t": 2}, shard_size=4, progress=False)


def test_a_head_of_another_target_is_refused(tmp_path):
    model = target()
    random_head(model, 100).save(tmp_path / "h")
    other = target(vocab=320)
    with pytest.raises(QuantspecError, match="vocabulary 256"):
        eagle_proposer(str(tmp_path / "h"), other)


@pytest.mark.parametrize("field,value", [("samples", 1), ("unroll", 0), ("lr", 0.0), ("val_fraction", 1.0),
                                         ("noise", -0.1)])
def test_bad_training_settings_are_refused(field, value):
    with pytest.raises(QuantspecError, match=field):
        TrainConfig(**{field: value})
    with pytest.raises(QuantspecError, match="prompts='instructions' with prompt_tokens=8"):
        TrainConfig(prompts="instructions", prompt_tokens=8)
    with pytest.raises(QuantspecError, match="--prompts text --prompt-tokens P"):  # requests are the default
        TrainConfig(prompt_tokens=8)


def test_the_default_recipe_learns_from_replies_to_instructions():
    """The defaults of docs/decisions/eagle-training.md; '' is the earlier spelling of 'text'."""
    cfg = TrainConfig()
    assert (cfg.prompts, cfg.samples, cfg.seqlen, cfg.epochs, cfg.unroll) == ("instructions", 384, 384, 8, 1)
    assert TrainConfig(prompts="").prompts == "text" and TrainConfig(prompts="text", prompt_tokens=8).prompt_tokens == 8


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "quantspec", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_trains_on_the_quantized_target_and_drafts_with_the_head(tmp_path):
    import quantspec
    from quantspec.quant.recipe import Recipe

    folder = make_tiny_model(tmp_path, "llama")
    ckpt = quantspec.quantize(str(folder), Recipe(name="t", method="rtn", format="gptq",
                                                  scheme=quantspec.QuantScheme(4, 32, True)),
                              tmp_path / "ckpt", progress=False, device="cpu").out
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["Speculative decoding drafts tokens and the target verifies them."] * 200))
    head = tmp_path / "head"
    r = _cli("train-draft", str(folder), "--quantized", str(ckpt), "--out", str(head), "--data", str(text),
             "--samples", "8", "--seqlen", "32", "--epochs", "1", "--draft-vocab", "64", "--unroll", "2",
             "--prompts", "text", "--no-progress")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((head / "eagle_config.json").read_text())
    assert cfg["target_features"] == str(ckpt) and cfg["draft_vocab_size"] == 64
    # the features are the quantized target's, not the dense one's
    from safetensors.torch import load_file

    shard = load_file(str(head / "features" / "shard-00000.safetensors"))
    dense = make_tiny_model(tmp_path / "again", "llama")
    from transformers import AutoModelForCausalLM

    dense_model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    assert not torch.allclose(shard["features"].float(), model_features(dense_model, shard["tokens"]), atol=1e-2)
    out = tmp_path / "gen.json"
    r = _cli("generate", str(ckpt), "--prompt", "Speculative decoding", "--draft", f"eagle:{head}",
             "--max-new-tokens", "8", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["mode"] == "speculative"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "prose", "prompt": "Speculative decoding drafts"}) + "\n")
    r = _cli("bench-specdec", str(folder), "--draft", f"eagle:{head}", "--prompts", str(prompts), "--no-timing",
             "--agreement", "--max-new-tokens", "8", "--no-chat", "--json", str(out))
    assert r.returncode == 0, r.stderr  # before: AttributeError (no teacher forcing for EAGLE heads)
    assert json.loads(out.read_text())["agreement"]["positions"] == 8


def test_cli_bad_input_exits_2_before_loading(tmp_path, capsys):
    from quantspec.cli.main import main

    def cli(*args) -> str:  # in this process: the CLI's own entry point; exit 2 and one line on stderr
        code = main(list(args))
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, (args, err)
        return err

    r = _cli("train-draft", "no-such-model-anywhere", "--out", str(tmp_path / "h"), "--samples", "1")  # as users run it
    assert r.returncode == 2 and "samples=1" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "one"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    for prompts, says in [(bad, "line 2 has no string field \"prompt\""), (tmp_path / "none.jsonl", "does not exist")]:
        assert says in cli("train-draft", "no-such-model-anywhere", "--out", str(tmp_path / "h"), "--prompts",
                           str(prompts))
    bad.write_text(json.dumps({"prompt": "one"}) + "\n")
    assert "holds 1 prompts, fewer than --samples 4" in cli("train-draft", "no-such-model-anywhere", "--out",
                                                            str(tmp_path / "h"), "--prompts", str(bad), "--samples", "4")
    folder = make_tiny_model(tmp_path, "llama")
    capsys.readouterr()  # the model's own save progress
    # refused before the target loads (one line: no loading progress before it)
    for draft, says in [(f"eagle:{tmp_path / 'nothing'}", "not an EAGLE head"), ("ngram:x", "n-gram size 'x'"),
                        ("self:w4x", "not a scheme name")]:
        assert says in cli("generate", str(folder), "--prompt", "hi", "--draft", draft)
        assert says in cli("bench-specdec", str(folder), "--draft", draft)


def test_the_vllm_export_is_a_llama_layer_that_computes_what_the_head_does(tmp_path):
    """vLLM's EAGLE-1 runs fc, then transformers-Llama's decoder layer without its input norm:
    built from the exported config and tensors, it gives the head's own output (fp32, 1e-5)."""
    from safetensors.torch import load_file
    from torch import nn
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    from quantspec.specdec.eagle.export import export_vllm, vllm_tensors

    model = target("qwen2")  # a non-Llama target: the head is Llama-shaped all the same
    head = random_head(model, 100, seed=4)
    with torch.no_grad():  # a trained-looking norm, not ones
        head.post_attention_layernorm.uniform_(0.5, 1.5)
    export_vllm(head, model.config, tmp_path / "v")
    saved = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert saved.keys() == vllm_tensors(head).keys()
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tmp_path / "v")
    assert cfg.num_hidden_layers == 1 and cfg.vocab_size == 256 and cfg.architectures == ["LlamaForCausalLM"]
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    fp32 = vllm_tensors(head, torch.float32)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in fp32.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = nn.Identity()
    g = torch.Generator().manual_seed(0)
    feats, emb = torch.randn(2, 7, 64, generator=g), torch.randn(2, 7, 64, generator=g)
    pos = torch.arange(3, 10).expand(2, -1)
    with torch.no_grad():
        x = torch.cat([emb, feats], -1) @ fp32["fc.weight"].T
        ref = layer(x, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos), position_ids=pos)
        ref = ref[0] if isinstance(ref, tuple) else ref
        ours, _ = head(feats, emb, pos)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_self_distilled_windows_are_the_targets_greedy_continuations(tmp_path):
    """Ragged chat prompts in one batch, each continued as ``generate(do_sample=False)`` would,
    to the target's stop token or the window's length; train_head writes them once."""
    from helpers import make_tiny_tokenizer

    from quantspec.specdec.eagle.distill import (
        chat_prompt,
        self_distilled_windows,
        window_prompts,
    )

    model = target(vocab=320)
    tok = make_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    windows = torch.stack([tok("The quick brown fox jumps over the lazy dog again and again", return_tensors="pt")
                           .input_ids[0][:24], torch.arange(40, 64)])
    out, lengths = self_distilled_windows(model, window_prompts(tok, windows, 9), 24, batch_size=2, progress=False)
    assert out.shape == (2, 24)
    for w, row, n in zip(windows, out, lengths):
        prompt = chat_prompt(tok, w[:9])
        assert prompt.numel() != 9 or not torch.equal(prompt, w[:9])  # the template was applied
        ref, end = greedy_reply(model, prompt, 24)
        assert torch.equal(row, ref) and int(n) == end
    cfg = TrainConfig(samples=2, seqlen=24, epochs=1, batch_size=1, draft_vocab=64, val_fraction=0.5, prompt_tokens=9,
                      prompts="text")
    train_head(model, windows, cfg, tmp_path / "h", {"target": "tiny"}, progress=False, tokenizer=tok)
    from safetensors.torch import load_file, save_file

    held = load_file(str(tmp_path / "h" / "features" / "distilled-00000.safetensors"))
    assert torch.equal(held["windows"], out) and torch.equal(held["lengths"], lengths)
    assert torch.equal(features_mod.load_features([tmp_path / "h" / "features" / "shard-00000.safetensors"])[0], out)
    # a stopped run continues: batches already written are read back, the rest are computed
    parts = tmp_path / "parts"
    parts.mkdir()
    marked = out[:1].clone()
    marked[0, -1] = 7
    save_file({"windows": marked, "lengths": lengths[:1]}, str(parts / "distilled-00000.safetensors"))
    again, n2 = self_distilled_windows(model, window_prompts(tok, windows, 9), 24, batch_size=1, progress=False,
                                       folder=parts)
    assert torch.equal(again[0], marked[0]) and torch.equal(again[1], out[1]) and torch.equal(n2, lengths)
    assert (parts / "distilled-00001.safetensors").is_file()
    # a file of another batch size (rows 0-1 where this run's batch starting at 0 has one row) is
    # written again, not read as that batch
    save_file({"windows": torch.cat([marked, marked]), "lengths": torch.cat([lengths[:1]] * 2)},
              str(parts / "distilled-00000.safetensors"))
    third, n3 = self_distilled_windows(model, window_prompts(tok, windows, 9), 24, batch_size=1, progress=False,
                                       folder=parts)
    assert torch.equal(third, out) and torch.equal(n3, lengths)
    assert torch.equal(load_file(str(parts / "distilled-00000.safetensors"))["windows"], out[:1])


@pytest.mark.parametrize("tree", ["dynamic", "static"])
@pytest.mark.parametrize("fast_verify", [True, False])
def test_eagle_token_trees_stay_lossless_and_accept_at_least_the_chain(tree, fast_verify):
    """Greedy tree drafting from the head equals the target's greedy output (batch 2), and a tree
    whose first branch is the chain accepts at least as many tokens per target call."""
    from quantspec.specdec.tree import TreeSpec

    model = target()
    rows = [torch.arange(20, 31), torch.tensor([9, 40, 41, 42, 40, 41])]
    refs = [reference(model, r) for r in rows]
    ids, mask = left_pad(rows)
    head = random_head(model, 256)
    spec = TreeSpec(tree, total=12, top_k=3, depth=3)
    out, st = speculative_generate(model, EagleProposer(head, model.get_input_embeddings()), ids,
                                   attention_mask=mask, max_new_tokens=20, k=3, tree=spec, fast_verify=fast_verify)
    for b, ref in enumerate(refs):
        assert torch.equal(out[b, ids.shape[1]:ids.shape[1] + len(ref)], ref)
    _, chain = speculative_generate(model, EagleProposer(head, model.get_input_embeddings()), ids,
                                    attention_mask=mask, max_new_tokens=20, k=3, fast_verify=fast_verify)
    assert st.tokens_per_call >= chain.tokens_per_call


def test_eagle_trees_sample_the_target_law():
    from quantspec.specdec.tree import TreeSpec

    model = tiny_model("llama", 3, vocab_size=16, initializer_range=0.1)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([3, 7, 5, 9])
    sampling = SamplingConfig(temperature=1.0)
    prop = EagleProposer(random_head(model, 12), model.get_input_embeddings())
    out, stats = speculative_generate(model, prop, prompt.expand(1500, -1), max_new_tokens=2, k=2,
                                      sampling=sampling, seed=5, tree=TreeSpec("static", total=4, top_k=2, depth=2))
    p1, p2 = _exact_two_token_laws(model, prompt, sampling)
    assert _chi2(torch.bincount(out[:, 4], minlength=16), p1) > 1e-3
    assert _chi2(torch.bincount(out[:, 5], minlength=16), p2) > 1e-3


def test_teacher_forced_agreement_reads_what_the_loop_drafts_first():
    """``teacher_forced_logits`` (bench-specdec --agreement) gives, for each position, the token
    the proposer drafts first when the loop has committed the tokens before it: the same head
    outputs (pairs (f_t, x_{t+1}), output t predicting token t + 2), through the agreement
    helper's own feature forward."""
    from quantspec.specdec.agreement import teacher_forced_matches

    model = target()
    head = random_head(model, 256)
    seq = self_windows(model, 1, 14)[0]
    prop = EagleProposer(head, model.get_input_embeddings())
    feats = model(input_ids=seq[None], output_hidden_states=True).hidden_states[-1][0]
    n = 6
    with torch.no_grad():
        forced = prop.teacher_forced_logits(seq, n, feats).argmax(-1)
    live = []
    for p in range(seq.numel() - n, seq.numel()):
        prop.reset()
        prop.observe([feats[: p - 1]])  # the features of every committed token but the last
        live.append(int(prop.propose([seq[:p]], 1, SamplingConfig()).tokens[0, 0]))
    assert forced.tolist() == live
    hits = teacher_forced_matches(prop, seq, seq.numel() - n, model)
    assert hits == (forced == seq[-n:]).tolist()


def test_training_on_requests_learns_the_targets_replies(tmp_path):
    """With ``prompts`` (a JSONL file), the windows are the chat-templated requests and the
    target's greedy replies; a different file is a different run (the features are refused)."""
    from helpers import make_tiny_tokenizer

    from quantspec.specdec.bench import encode

    model = target(vocab=320)
    tok = make_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    requests = ["Explain the fox", "Write a function that adds two numbers", "Summarize the lazy dog"]
    file = tmp_path / "requests.jsonl"
    file.write_text("".join(json.dumps({"id": i, "prompt": r}) + "\n" for i, r in enumerate(requests)))
    cfg = TrainConfig(samples=3, seqlen=64, epochs=1, batch_size=1, draft_vocab=64, val_fraction=0.34,
                      prompts=str(file))
    report = train_head(model, None, cfg, tmp_path / "h", {"target": "tiny"}, progress=False, tokenizer=tok)
    assert report["features"]["prompts"] == str(file) and report["windows"] == 3
    tokens = features_mod.load_features([tmp_path / "h" / "features" / "shard-00000.safetensors"])[0]
    ends, replies = [], []
    for r, row in zip(requests, tokens):
        prompt = encode(tok, r, chat=True)[0]
        ref, end = greedy_reply(model, prompt, 64)
        assert prompt.numel() < 40 and torch.equal(row, ref)
        ends.append(end)
        replies.append(end - prompt.numel())  # the reply's tokens, each predicted from the one before
    assert report["scored_positions"] == sum(e - 1 for e in ends)
    assert report["reply_positions"] == sum(replies) > 0
    held = report["history"][-1]
    assert len(held["val_reply_agreement"]) == len(held["val_agreement"]) == cfg.unroll
    file.write_text("".join(json.dumps({"prompt": r + "!"}) + "\n" for r in requests))
    with pytest.raises(QuantspecError, match="prompts_sha256"):
        train_head(model, None, cfg, tmp_path / "h", {"target": "tiny"}, progress=False, tokenizer=tok)


def test_instruction_prompts_are_seeded_mixed_and_not_the_benchmarks():
    """A third each of prose, write-a-function and edit-a-function requests, from the given
    documents; the same seed gives the same requests; none is a benchmark or validation prompt."""
    from pathlib import Path

    from quantspec.specdec.eagle.prompts import (
        EDIT,
        PROSE,
        WRITE,
        instruction_prompts,
        python_functions,
    )

    code = [('import os\n\n\ndef join_all(parts, sep=","):\n    """Join the parts with a separator."""\n'
             '    total = sep.join(parts)\n    return total\n\n\ndef _private(x):\n    return x\n    # no\n'),
            "def broken(:\n"]
    funcs = python_functions(code)
    assert [f["name"] for f in funcs] == ["join_all"]  # private and unparsable left out
    assert funcs[0]["signature"] == "join_all(parts, sep=',')" and funcs[0]["summary"] == "Join the parts with a separator."
    assert funcs[0]["names"] == ["parts", "sep", "total"]
    prose = ["The fox ran far. It was a long way to the river. The river was cold and wide. "
             "The fox swam across it anyway, because the other side had food. " * 3]
    a = instruction_prompts(9, 1, prose, code)
    assert a == instruction_prompts(9, 1, prose, code) and a != instruction_prompts(9, 2, prose, code)
    leads = [[t.split("{")[0] for t in ts] for ts in (PROSE, WRITE, EDIT)]
    kinds = [next(i for i, hs in enumerate(leads) if any(p.startswith(h) for h in hs)) for p in a]
    assert kinds == [0, 1, 2] * 3
    assert all("join_all" in p for p, k in zip(a, kinds) if k)
    here = Path(__file__).resolve().parents[1] / "benchmarks"
    bench = [json.loads(x)["prompt"] for f in ("specdec_prompts.jsonl", "specdec_prompts_validation.jsonl")
             for x in (here / f).read_text().splitlines() if x.strip()]
    for template in PROSE + WRITE + EDIT:
        lead = template.split("{")[0].strip()
        assert lead and not any(b.startswith(lead) for b in bench), lead


def test_replies_end_at_the_first_stop_token_and_only_text_is_scored():
    """``continue_greedily`` ends a row at its first stop token (its length counts it), fills the
    rest with it, and keeps the other rows' greedy text; the training loss and the held-out
    agreement ignore every position past a window's length (changing the filler changes
    nothing; scoring it, as before the lengths existed, does)."""
    from quantspec.specdec.eagle.distill import continue_greedily

    model = target()
    prompts = [torch.arange(20, 26), torch.tensor([9, 40, 41])]
    full, n_full = continue_greedily(model, prompts, 16)
    assert n_full.tolist() == [16, 16]
    stop = int(full[0, 8])  # row 0 writes it at position 8 (its 3rd new token)
    first = [next(i for i in range(len(p), 16) if int(full[b, i]) == stop) if stop in full[b, len(p):].tolist()
             else None for b, p in enumerate(prompts)]
    out, lengths = continue_greedily(model, prompts, 16, frozenset({stop}))
    for b, f in enumerate(first):
        end = 16 if f is None else f + 1
        assert int(lengths[b]) == end
        assert torch.equal(out[b, :end], full[b, :end])
        assert (out[b, end:] == stop).all()
    assert int(lengths[0]) <= 9  # row 0 did stop

    head = random_head(model, 256)
    windows = self_windows(model, 2, 12)
    feats = model_features(model, windows)
    emb = model.get_input_embeddings()(windows[:, 1:])
    valid = train_mod.scored(torch.tensor([7, 12]), 11)
    assert valid.sum(1).tolist() == [6, 11]
    other_feats, other_emb = feats.clone(), emb.clone()
    other_feats[0, 7:] = torch.randn_like(other_feats[0, 7:])
    other_emb[0, 6:] = torch.randn_like(other_emb[0, 6:])
    with torch.no_grad():
        loss, _ = train_mod.unrolled_losses(head, feats, emb, 2, 0.1, valid)
        same, _ = train_mod.unrolled_losses(head, other_feats, other_emb, 2, 0.1, valid)
        unmasked, _ = train_mod.unrolled_losses(head, other_feats, other_emb, 2, 0.1)
    torch.testing.assert_close(same, loss, rtol=1e-6, atol=1e-7)
    assert abs(float(unmasked) - float(loss)) > 1e-3
    lm = model.get_output_embeddings().weight
    assert train_mod.agreement(head, [(feats, emb, valid)], lm, 2) == \
        train_mod.agreement(head, [(other_feats, other_emb, valid)], lm, 2)
