"""The cpu backend's one-token MoE path (``kernels.cpu_moe``, op ``quantspec_cpu::moe_token``):
a decode token through a quantized MoE block in one op call gives the per-expert path's output
(same kernels, same roundings; only the exp inside SiLU / sigmoid differs, std::exp against
torch's vectorized exp), for SiLU experts and GPT-OSS's clamped SwiGLU, with or without biases;
it is attached only where every expert qualifies, and decodes the same tokens.

Tolerances, relative to the largest output: fp32 1e-5, bf16 4e-3 (a bf16 ulp: one rounding of a
GLU value may differ when the two exps straddle a rounding boundary). Observed on 100 random
tokens per case (tiny Qwen3-MoE and Mixtral, W4 g32): fp32 at most 3.4e-7 (about 80% bit-equal),
bf16 bit-equal throughout.
"""

from __future__ import annotations

import pytest
import torch

import quantspec
from helpers import act_order_result, tiny_model
from moe_cpu_helpers import LAYOUTS, LIMIT, Counted, both, close, gpt_oss_biases, quantized
from quantspec.core.scheme import QuantScheme
from quantspec.kernels import cpu as cpu_mod
from quantspec.kernels.cpu_ext import load_cpu_ext
from quantspec.kernels.cpu_moe import GLU_CLAMPED_SWIGLU, CpuTokenExperts, attach_cpu_token, cannot_attach
from quantspec.kernels.quant_linear import QuantLinear
from quantspec.models.experts import ClampedSwiGLU, experts_modules
from quantspec.quant.recipe import Recipe

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(load_cpu_ext() is None, reason="the cpu extension is not built here"),
]


def _add_biases(experts, dtype, seed):
    """Random biases on the expert Linears, but none on expert 0's up and expert 1's down (the op
    adds zeros there); the one-op path bound again."""
    g = torch.Generator().manual_seed(seed)
    for e, mlp in enumerate(experts):
        for j, (lin, scale) in enumerate(zip(mlp.linears(), (0.2, 0.2, 0.01))):
            if (e, j) not in ((0, 1), (1, 2)):
                lin.bias = torch.nn.Parameter((scale * torch.randn(lin.out_features, generator=g)).to(dtype),
                                              requires_grad=False)
    experts.token_runner = CpuTokenExperts(experts)


def _routing(n_experts, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(n_experts, generator=g)[:k]
    ids[1] = -1 if seed % 2 else n_experts  # a dropped token's slot (outside [0, E))
    weights = torch.rand(k, generator=g).to(dtype)
    return ids.view(1, k), weights.view(1, k)


def _tokens(experts, dtype, seed, n=3):
    """n random (x [1, H], top-k ids holding a dropped index, weights) for ``experts``; the last
    routes to experts 0 and 1."""
    hidden = experts[0].linears()[0].in_features
    for t in range(n):
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed + t)).to(dtype)
        ids, weights = _routing(len(experts), 4, seed + t, dtype)
        if t == n - 1:
            ids = torch.tensor([[0, -1, 1, len(experts) - 1]])
        yield x, ids, weights


def _same_tokens(experts, dtype, seed, n=3) -> torch.Tensor:
    """The one op equals the per-expert path on ``_tokens``; returns the last x."""
    for x, ids, weights in _tokens(experts, dtype, seed, n):
        close(*both(experts, x, ids, weights), dtype)
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_one_op_equals_the_per_expert_path(arch, dtype, layout, monkeypatch):
    """Every MoE block of a W4 tiny Qwen3-MoE / Mixtral (experts without bias) gets the path, and
    its output for one token, a top-k holding a dropped index, equals the per-expert path's."""
    model, report = quantized(arch, dtype, layout, monkeypatch)
    blocks = experts_modules(model)
    assert report["cpu_token_experts"] == list(blocks) and len(blocks) == 2
    assert report["grouped_experts"] == []
    for i, (name, experts) in enumerate(blocks.items()):
        runner = experts.token_runner
        assert isinstance(runner, CpuTokenExperts)
        assert runner.panels == (layout == "auto" and cpu_mod.panels_supported())
        assert all(lin.bias is None for mlp in experts for lin in mlp.linears())
        assert runner.shared == 3 * len(experts)  # every expert Linear views the stacked copy
        x = _same_tokens(experts, dtype, 10 * i)
        none = torch.full((1, 2), -1)  # every slot dropped: zeros, as the per-expert path
        fast, ref = both(experts, x, none, torch.ones(1, 2, dtype=dtype))
        assert torch.equal(fast, ref) and not fast.any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_work_split_across_threads_and_experts(layout, monkeypatch):
    """Larger experts on 2 threads (each thread's share of the (expert, panel) items ends inside
    an expert; 8-bit weights and group 64 too): still the per-expert path's output."""
    torch.set_num_threads(2)
    for scheme in (QuantScheme(4, 128, True), QuantScheme(8, 64, False)):
        model, report = quantized("qwen3_moe", torch.float32, layout, monkeypatch, scheme=scheme,
                                  hidden_size=512, moe_intermediate_size=256, num_experts_per_tok=3,
                                   num_hidden_layers=1)
        (experts,) = experts_modules(model).values()
        assert experts.token_runner is not None
        for seed in range(2):
            x = torch.randn(1, 512, generator=torch.Generator().manual_seed(seed))
            ids = torch.tensor([[5, 0, 7]]) if seed else torch.tensor([[2, 6, 1]])
            weights = torch.tensor([[0.5, 0.3, 0.2]])
            close(*both(experts, x, ids, weights), torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_clamped_swiglu_and_biases(dtype, layout, monkeypatch):
    """GPT-OSS (clamped SwiGLU, biased gate/up/down Linears) gets the path on every block, with
    its alpha and limit, and its output for one token equals the per-expert path's, on tokens
    that drive gate above the limit and up past both ends of [-limit, limit]."""
    model, report = quantized("gpt_oss", dtype, layout, monkeypatch, edit=gpt_oss_biases, swiglu_limit=LIMIT)
    blocks = experts_modules(model)
    assert report["cpu_token_experts"] == list(blocks) and len(blocks) == 2
    clamped = set()
    for i, experts in enumerate(blocks.values()):
        runner, glu = experts.token_runner, experts[0].glu
        assert isinstance(glu, ClampedSwiGLU) and glu.limit == LIMIT
        assert (runner.glu, runner.alpha, runner.limit) == (GLU_CLAMPED_SWIGLU, glu.alpha, LIMIT)
        assert runner.gu_bias.shape == (len(experts), 2 * runner.inter) and runner.gu_bias.all()
        assert runner.down_bias.shape == (len(experts), runner.hidden) and runner.down_bias.all()
        assert runner.shared == 3 * len(experts)
        _same_tokens(experts, dtype, 10 * i)
        for x, ids, _ in _tokens(experts, dtype, 10 * i):
            for e in ids[0].tolist():
                if 0 <= e < len(experts):
                    gate, up, _ = experts[e].linears()
                    clamped |= {"gate" for v in gate(x).flatten().tolist() if v > LIMIT}
                    clamped |= {"up<" for v in up(x).flatten().tolist() if v < -LIMIT}
                    clamped |= {"up>" for v in up(x).flatten().tolist() if v > LIMIT}
    assert clamped == {"gate", "up<", "up>"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_silu_experts(dtype, layout, monkeypatch):
    """SiLU experts whose gate/up/down Linears have biases (some Linears without) take the path,
    each bias added to the fp32 product before its rounding, as the per-expert path's kernel."""
    model, _ = quantized("qwen3_moe", dtype, layout, monkeypatch)
    for i, experts in enumerate(experts_modules(model).values()):
        _add_biases(experts, dtype, seed=i)
        runner = experts.token_runner
        assert runner.gu_bias[0, runner.inter:].eq(0).all() and runner.down_bias[1].eq(0).all()
        assert runner.gu_bias[1].all() and runner.down_bias[0].all()
        _same_tokens(experts, dtype, 10 * i)


def test_attached_only_where_every_expert_qualifies(monkeypatch):
    """The reference backend, a dense expert Linear and a column-gathering (act-order) layout keep
    the per-expert path, and ``cannot_attach`` says why."""
    recipe = Recipe(name="t", method="rtn", scheme=QuantScheme(4, 32, True), format="gptq")
    model, report = quantspec.quantize_model(tiny_model("qwen3_moe"), recipe, backend="reference")
    assert report["cpu_token_experts"] == []
    # one block with one dense expert Linear, the other with a column-gathering layout
    model, _ = quantized("qwen3_moe", torch.float32, "auto", monkeypatch)
    first, second = experts_modules(model).values()
    for experts in (first, second):
        experts.token_runner = None
    first[3].add_module(first[3].names[2], torch.nn.Linear(32, 64, bias=False))
    second[5].linears()[0]._p_src = torch.arange(64, dtype=torch.int32)
    second[5].linears()[0]._prepared_cache = None
    assert cannot_attach(first) == "not every expert Linear is quantized"
    assert cannot_attach(second) == "a layout gathers columns (act-order / padding map)"
    assert attach_cpu_token(model) == []


def _act_order_experts(model):
    """Every expert Linear of ``model`` replaced by an act-order W4 g32 one (GPTQ's column order,
    without calibration), prepared for the cpu backend."""
    scheme = QuantScheme(4, 32, True, act_order=True)
    for experts in experts_modules(model).values():
        experts.token_runner = None
        for e, mlp in enumerate(experts):
            for name, lin in zip(mlp.names, mlp.linears()):
                w = torch.randn(lin.out_features, lin.in_features, generator=torch.Generator().manual_seed(e))
                new = QuantLinear.from_result(act_order_result(w, scheme, seed=e), "gptq", None, torch.float32)
                new.prepare("cpu")
                mlp.add_module(name, new)


@pytest.mark.parametrize("case, reason", [
    ("w8a8", "W8A8 (the op runs weight-only schemes)"),
    ("fp8", "fp8 weights (the op runs integer weights)"),
    ("act_order", "act-order (each expert's own column order; the op quantizes x once for all)"),
    ("gelu", "the GLU is neither SiLU(gate) * up nor GPT-OSS's clamped SwiGLU"),
])
def test_what_the_op_does_not_run_keeps_the_per_expert_path(case, reason, monkeypatch):
    """W8A8, float weights, act-order experts and a GLU other than SiLU / GPT-OSS's are not
    attached, and ``cannot_attach`` names the reason; the per-expert path still runs."""
    schemes = {"w8a8": QuantScheme(8, -1, True, activations="int8-token-dynamic"),
               "fp8": QuantScheme(8, -1, True, weights="fp8")}
    model, report = quantized("qwen3_moe", torch.float32, "auto", monkeypatch,
                              scheme=schemes.get(case, QuantScheme(4, 32, True)), fmt="compressed-tensors",
                               **({"hidden_act": "gelu"} if case == "gelu" else {}))
    if case == "act_order":
        _act_order_experts(model)
    else:
        assert report["cpu_token_experts"] == []
    blocks = experts_modules(model)
    assert all(cannot_attach(e) == reason for e in blocks.values())
    assert attach_cpu_token(model) == [] and all(e.token_runner is None for e in blocks.values())
    x, ids, weights = next(_tokens(next(iter(blocks.values())), torch.float32, 0, n=1))
    with torch.no_grad():
        assert torch.isfinite(next(iter(blocks.values()))(x, ids, weights)).all()


def _greedy(dec, prompt, new=6):
    """``new`` greedy tokens after ``prompt`` from the decoder ``dec`` (a ``runtime`` Decoder),
    with the logits of each decoded step: (tokens, [new, V] fp32)."""
    with torch.no_grad():
        logits = dec.forward([prompt], keep=1)
        tokens, steps = [], []
        for _ in range(new):
            token = logits[0, -1].argmax().view(1)
            tokens.append(int(token))
            logits = dec.forward([token], keep=1)
            steps.append(logits[0, -1].float())
    return tokens, torch.stack(steps)


def _same_decoding(blocks, greedy, dtype, prefill, check_fast=None):
    """``greedy()`` -> (tokens, logits) with the one-op path (called for the ``prefill`` rows of
    the prompt, then single tokens; ``check_fast()`` then) equals it with the per-expert path: the
    tokens, and the logits within the tolerance."""
    calls = []
    for experts in blocks.values():
        experts.token_runner = Counted(experts.token_runner, calls)
    fast_tokens, fast = greedy()
    assert calls and set(calls) == {prefill, 1}  # the prompt, then one token at a time
    if check_fast is not None:
        check_fast()
    for experts in blocks.values():
        experts.token_runner = None
    ref_tokens, ref = greedy()
    assert fast_tokens == ref_tokens
    close(fast.to(dtype), ref.to(dtype), dtype)


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decoder_decodes_the_same_tokens(dtype, biased, monkeypatch):
    """Greedy decoding through the static decoder with the one-op path equals the per-expert
    path's (tokens, and logits within the tolerance); the 5-token prefill goes through it too.
    Biased experts: the decoder's fused gate/up adds their biases, so does the op."""
    from quantspec.runtime.decoder import StaticDecoder

    model, _ = quantized("qwen3_moe", dtype, "auto", monkeypatch)
    blocks = experts_modules(model)
    if biased:
        for i, experts in enumerate(blocks.values()):
            _add_biases(experts, dtype, seed=i)
    runners = {n: e.token_runner for n, e in blocks.items()}
    assert all(runners.values())
    prompt = torch.randint(3, 300, (5,), generator=torch.Generator().manual_seed(4))

    def fused_views():  # the decoder's fused gate/up are views of the stack
        for name, experts in blocks.items():
            for e, mlp in enumerate(experts):
                assert mlp.gate_up.fused
                assert mlp.gate_up._prepared["w"].data_ptr() == runners[name].gu["w"][e].data_ptr()

    _same_decoding(blocks, lambda: _greedy(StaticDecoder(model), prompt), dtype, len(prompt), fused_views)


@pytest.mark.parametrize("decoder", ["KVDecoder", "StaticDecoder"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_decodes_the_same_tokens(dtype, decoder, monkeypatch):
    """GPT-OSS greedy decoding through transformers with its KV cache (``KVDecoder``) and
    through the static decoder (its experts' gate/up fused, with their biases, as views of the
    op's stack): the prompt's and each decoded token's blocks run as the op, and the tokens and
    logits are the per-expert path's."""
    from quantspec.runtime.decoder import StaticDecoder
    from quantspec.runtime.kv import KVDecoder

    model, _ = quantized("gpt_oss", dtype, "auto", monkeypatch, edit=gpt_oss_biases, swiglu_limit=LIMIT)
    prompt = torch.randint(3, 300, (5,), generator=torch.Generator().manual_seed(4))
    make = {"KVDecoder": KVDecoder, "StaticDecoder": StaticDecoder}[decoder]
    _same_decoding(experts_modules(model), lambda: _greedy(make(model), prompt), dtype, len(prompt))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_load_quantized_attaches_it(arch, tmp_path):
    """A checkpoint loaded for the cpu backend gets the path on every MoE block
    (``model.quantspec_cpu_token_experts``), with the per-expert path's output."""
    from helpers import make_tiny_model

    folder = make_tiny_model(tmp_path, arch, **({"swiglu_limit": LIMIT} if arch == "gpt_oss" else {}))
    recipe = Recipe(name="t", method="rtn", scheme=QuantScheme(4, 32, True), format="gptq")
    outcome = quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False)
    model = quantspec.load_quantized(outcome.out, backend="cpu", dtype="float32")
    blocks = experts_modules(model)
    assert model.quantspec_cpu_token_experts == list(blocks) and len(blocks) == 2
    for experts in blocks.values():
        x = torch.randn(1, experts[0].linears()[0].in_features, generator=torch.Generator().manual_seed(1))
        ids, weights = _routing(len(experts), 2, 0, torch.float32)
        close(*both(experts, x, ids, weights), torch.float32)
