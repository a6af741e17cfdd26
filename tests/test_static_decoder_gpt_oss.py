"""GPT-OSS through the static decoder, against transformers' own GPT-OSS forward.

Model: a tiny random GPT-OSS (``helpers.tiny_config``: hidden 64, 4 heads of 16 over 2 KV heads,
8 experts top-2) with 4 blocks (sliding, full, sliding, full), a window of 5 positions (every
sequence here is longer, so the window cuts), GPT-OSS's YaRN rotary (the model's own
``rotary_emb``: half-width cos/sin scaled by its attention factor), random sinks N(1, 1.5^2) per
head (transformers draws N(0, 0.02^2), which barely moves a softmax), random q/k/v/o biases
N(0, 0.2^2) and expert biases (``moe_cpu_helpers.gpt_oss_biases``), and a SwiGLU limit low
enough that its clamps bite.

Reference: transformers' forward (eager attention with its sinks and sliding-window mask) over
each row's whole sequence so far: a row's logits at every step, prefill and each decode step,
are the last positions of ``model(row)``. ``KVDecoder`` cannot be the reference past the window
(transformers' sliding-window cache layers refuse ``crop`` once the window is reached).

Tolerances, relative to the reference's largest |logit| (~0.44 here), at every real position
of every step: fp32 with exact activations (dense, or the ``reference`` backend) 1e-4 (only op
order differs: measured 4.8e-7); the ``cpu`` backend rounds activations to int8 per block, and
another op order may flip some of those roundings: 1e-3 (measured 3.5e-5); bf16 (norms in fp32)
6e-2 (measured 3.0e-2: the fused ops round once where transformers rounds per op, and its
softmax runs in bf16, ours in fp32), with greedy tokens equal to ``generate``'s.
"""

from __future__ import annotations

from dataclasses import replace

import helpers
import pytest
import torch
from moe_cpu_helpers import LIMIT, gpt_oss_biases

import quantspec
from quantspec.core.scheme import QuantScheme
from quantspec.errors import QuantspecError
from quantspec.kernels import small_ops
from quantspec.kernels.quant_linear import QuantLinear
from quantspec.models.experts import LinearExperts
from quantspec.quant.recipe import Recipe
from quantspec.runtime.decoder import StaticDecoder, fast_decoder
from quantspec.runtime.families import FAMILIES
from quantspec.runtime.kv import KVDecoder
from quantspec.specdec import DraftModel, speculative_generate
from quantspec.specdec.tree import TreeSpec

WINDOW = 5
# GPT-OSS's YaRN (attention factor 1 + 0.1 ln 8 on cos and sin), consistent with 512 positions
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
TOL = {"fp32": 1e-4, "cpu": 1e-3, "bf16": 6e-2}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls on a shared CPU


def gpt_oss(seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny GPT-OSS of the module docstring (fp32, eval)."""
    config = {"num_hidden_layers": 4, "sliding_window": WINDOW, "swiglu_limit": LIMIT, "rope_parameters": YARN}
    model = helpers.tiny_model("gpt_oss", seed, **{**config, **overrides})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.sinks.copy_(1 + 1.5 * torch.randn(attn.sinks.shape, generator=g))
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.copy_(0.2 * torch.randn(proj.bias.shape, generator=g))
    gpt_oss_biases(model)
    return model


def quantized(backend: str) -> torch.nn.Module:
    """``gpt_oss()`` through RTN W4 g32 (attention, experts and lm_head; router dense), on ``backend``."""
    recipe = Recipe(name="t", method="rtn", scheme=QuantScheme(4, 32, True), format="gptq")
    model, _ = quantspec.quantize_model(gpt_oss(), recipe, backend=backend)
    return model


class FullForward:
    """Each row's tokens so far, and transformers' logits of its last n positions."""

    def __init__(self, model: torch.nn.Module, batch: int):
        self.model, self.rows = model, [[] for _ in range(batch)]

    def forward(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for row, c in zip(self.rows, chunks):
            row += c.tolist()
            out.append(self.model(torch.tensor([row])).logits[0, len(row) - len(c):])
        return out

    def drop_last(self, counts: list[int]) -> None:
        for row, n in zip(self.rows, counts):
            del row[len(row) - n:]


def _script(rows: list[torch.Tensor], gen: torch.Generator, ragged: bool):
    """(chunks, drops) of each step: prefill ``rows``, decode past the window (ragged: chunks of
    uneven sizes, and rows dropping uneven counts of their last tokens)."""
    yield rows, None
    for _ in range(8):
        yield [torch.randint(3, 300, (1,), generator=gen) for _ in rows], None
    sizes = [3, 1, 2][: len(rows)] if ragged else [2] * len(rows)
    yield [torch.randint(3, 300, (n,), generator=gen) for n in sizes], [2, 0, 1][: len(rows)] if ragged else None
    for _ in range(3):
        yield [torch.randint(3, 300, (1,), generator=gen) for _ in rows], None


def _compare(model, rows: list[torch.Tensor], ragged: bool, tol: float) -> StaticDecoder:
    """Run the script on a StaticDecoder and on ``FullForward``; every real position's logits
    agree within ``tol`` x max |logit|. Returns the decoder."""
    dec, ref = StaticDecoder(model), FullForward(model, len(rows))
    with torch.inference_mode():
        for step, (chunks, drops) in enumerate(_script(rows, torch.Generator().manual_seed(1), ragged)):
            got, want = dec.forward(chunks), ref.forward(chunks)
            for b, w in enumerate(want):
                g = got[b, got.shape[1] - len(w):]
                err, scale = (g - w).abs().max().item(), w.abs().max().item()
                assert err <= tol * scale, f"step {step} row {b}: max |Δlogit| {err:.3g} > {tol} x {scale:.3g}"
            if drops:
                dec.drop_last(drops)
                ref.drop_last(drops)
    assert min(len(r) for r in ref.rows) > 2 * WINDOW
    return dec


def test_sink_attention_equals_transformers_eager():
    """``small_ops.attention`` with sinks (the masked path's, and ``attend``'s reference) against
    transformers' own GPT-OSS attention, grouped heads, a window and holes (fp32, 1e-6)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    b, h, kv, t, cols, d = 2, 6, 2, 3, 9, 16
    q, k, v = (torch.randn(b, n, m, d, generator=g) for n, m in ((h, t), (kv, cols), (kv, cols)))
    sinks = 2 * torch.randn(h, generator=g)
    pos, col = torch.arange(cols - t, cols)[:, None], torch.arange(cols)[None]
    allowed = ((col <= pos) & (col > pos - 4)).expand(b, 1, t, cols).clone()
    allowed[1, 0, :, 7] = False  # a hole in row 1
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=h // kv, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=d ** -0.5)
    got = small_ops.attention(q, k, v, allowed, sinks).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-6)
    plain = small_ops.attention(q, k, v, allowed, None).transpose(1, 2)
    assert (plain - want).abs().max() > 1e-2  # the sinks move it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rounded_once_equals_gpt_oss_rmsnorm(dtype):
    """fp32 weights (as transformers keeps them) on fp32 or bf16 activations: bf16 bit-exact,
    fp32 within 1e-6 (the extension's op sums in another order)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    g = torch.Generator().manual_seed(0)
    norm = GptOssRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x = (3 * torch.randn(3, 5, 64, generator=g)).to(dtype)
    with torch.inference_mode():
        want, got = norm(x), small_ops.rms_norm_rounded_once(x, norm.weight, 1e-5)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_window_sinks_and_biases_matter_here():
    """The setup is sensitive: the window cuts these sequences, the sinks and the biases move
    the logits by far more than the fp32 tolerance."""
    ids = torch.arange(5, 25)[None]
    with torch.inference_mode():
        base = gpt_oss()(ids).logits
        scale = base.abs().max()
        variants = {"window": gpt_oss(sliding_window=64)}
        variants["sinks"], variants["bias"] = gpt_oss(), gpt_oss()
        for layer in variants["sinks"].model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sink: exp(-1e4) == 0
        for layer in variants["bias"].model.layers:
            layer.self_attn.o_proj.bias.zero_()
        for name, model in variants.items():
            assert (model(ids).logits - base).abs().max() > 100 * TOL["fp32"] * scale, name


@pytest.mark.parametrize("rows", [1, 2])
def test_fp32_logits_match_transformers_past_the_window(rows):
    """Batch one, and two rows of one length (no holes: the extension's attend, windowed)."""
    prompts = [torch.arange(5, 13), torch.arange(40, 48)][:rows]
    dec = _compare(gpt_oss(), prompts, ragged=False, tol=TOL["fp32"])
    assert dec.mask is None
    assert [b.window for b in dec.blocks] == [WINDOW, None, WINDOW, None]
    assert all(b.sinks is not None and b.moe is not None for b in dec.blocks)


def test_fp32_uneven_rows_match_transformers():
    """Ragged chunks and dropped tokens leave holes in the cache (the masked attention path with
    sinks and windows); each row computes what it would alone."""
    rows = [torch.arange(5, 17), torch.arange(30, 34), torch.arange(40, 48)]
    dec = _compare(gpt_oss(), rows, ragged=True, tol=TOL["fp32"])
    assert dec.mask is not None


def _greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    dec = StaticDecoder(model)
    ids = prompt.tolist()
    with torch.inference_mode():
        logits = dec.forward([prompt], keep=1)
        for _ in range(new):
            ids.append(int(logits[0, -1].argmax()))
            logits = dec.forward([torch.tensor(ids[-1:])], keep=1)
    return torch.tensor([ids])


def _generate(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    ids = prompt[None]
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new)


def test_fp32_greedy_tokens_equal_generate():
    model, prompt = gpt_oss(), torch.arange(5, 12)
    assert torch.equal(_greedy(model, prompt, 16), _generate(model, prompt, 16))


def test_bf16_with_fp32_norms_follows_transformers():
    """bf16 weights with the norms kept in fp32, as ``from_pretrained`` keeps GPT-OSS's
    (``_keep_in_fp32_modules``): the decoder's norm multiplies in fp32 and rounds once, as
    transformers' does; greedy tokens equal ``generate``'s, logits within the bf16 tolerance."""
    model = gpt_oss().to(torch.bfloat16)
    norms = [model.model.norm] + [n for layer in model.model.layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms:
        norm.float()
    prompt = torch.arange(5, 12)
    assert torch.equal(_greedy(model, prompt, 12), _generate(model, prompt, 12))
    rows = [torch.arange(5, 17), torch.arange(30, 34), torch.arange(40, 48)]
    _compare(model, rows, ragged=True, tol=TOL["bf16"])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_rtn_w4_matches_transformers_on_the_same_model(backend):
    """RTN W4 through quantspec's API (attention with its biases, each expert, lm_head): the
    decoder against transformers' forward of the same quantized model, rows with holes."""
    model = quantized(backend)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert isinstance(model.model.layers[0].mlp.experts, LinearExperts)
    rows = [torch.arange(5, 17), torch.arange(30, 34), torch.arange(40, 48)]
    _compare(model, rows, ragged=True, tol=TOL["fp32" if backend == "reference" else "cpu"])


def test_rtn_w4_cpu_greedy_tokens_equal_generate():
    model, prompt = quantized("cpu"), torch.arange(5, 12)
    assert torch.equal(_greedy(model, prompt, 12), _generate(model, prompt, 12))


def test_trees_run_inside_the_window_and_are_refused_past_it():
    """Inside the window a tree's nodes equal their paths' forwards; once a window would cut the
    tree's columns, a clear refusal (chains still run)."""
    model = gpt_oss()
    dec = StaticDecoder(model)
    with torch.inference_mode():
        dec.forward([torch.tensor([5, 6])])
        logits = dec.forward_tree([torch.tensor([11, 12, 13])], [torch.tensor([-1, -1, 0])])[0]
        for node, path in enumerate([[11], [12], [11, 13]]):
            want = model(torch.tensor([[5, 6, *path]])).logits[0, -1]
            assert (logits[node] - want).abs().max() <= TOL["fp32"] * want.abs().max(), node
        dec.keep_path([[0, 2]])
        dec.forward([torch.tensor([7, 8])])
        with pytest.raises(QuantspecError, match="sliding window of 5"):
            dec.forward_tree([torch.tensor([9])], [torch.tensor([-1])])


class _NoTrees(DraftModel):
    """A draft that fails the test if a tree is ever asked of it."""

    def propose_tree(self, *args, **kwargs):
        raise AssertionError("the run started: the refusal must come before any draft")


@pytest.mark.parametrize("fast", [True, False])
def test_tree_runs_past_the_window_are_refused_before_they_start(fast):
    """A tree run that would reach past the sliding window is refused before the first draft:
    the StaticDecoder's by the window's length, transformers' cache (sliding layers) for any
    tree. The bound is exact: with 2 prompt tokens and trees of 2 nodes at depth 1, the last
    full tree is fed at 1 + (new - 2) columns + 1 pending + 2 nodes, so 3 new tokens fill the
    window of 5 and run to the end (the forward's own check would stop them otherwise), 4 do not."""
    model = gpt_oss()
    prompt = torch.tensor([[5, 6]])
    tree = TreeSpec("static", total=2, top_k=2, depth=1)
    match = "reaches 6 positions, past this model's sliding window of 5" if fast else "sliding-window layers"
    with pytest.raises(QuantspecError, match=match):
        speculative_generate(model, _NoTrees(model), prompt, max_new_tokens=4, tree=tree, fast_verify=fast)
    if fast:
        out, stats = speculative_generate(model, DraftModel(model), prompt, max_new_tokens=3, tree=tree,
                                          fast_verify=True)
        assert torch.equal(out, _generate(model, prompt[0], 3))
        assert stats.proposed >= 2  # a full tree was fed


def test_what_does_not_fit_is_refused_and_falls_back():
    """A block without its sinks or its MLP: ``family_of`` names what is missing and
    ``fast_decoder`` falls back to transformers; a rotary embedding of another width than the
    family declares is refused when the decoder is built."""
    model = gpt_oss()
    del model.model.layers[1].self_attn.sinks
    with pytest.raises(QuantspecError, match=r"layers\.1\.self_attn\.sinks"):
        StaticDecoder(model)
    assert isinstance(fast_decoder(model), KVDecoder)
    model = gpt_oss()
    del model.model.layers[3].mlp
    with pytest.raises(QuantspecError, match=r"layers\.3\.mlp"):
        StaticDecoder(model)
    full_width = replace(FAMILIES["gpt_oss"], rotary_half=False)  # a rotary narrower than the heads
    with pytest.raises(QuantspecError, match="covers 8 of 16 head dimensions"):
        StaticDecoder(gpt_oss(), family=full_width)
