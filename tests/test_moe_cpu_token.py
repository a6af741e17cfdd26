"""The cpu backend's one-token MoE path (``kernels.cpu_moe``, op ``quantspec_cpu::moe_token``):
a decode token through a quantized MoE block in one op call gives the per-expert path's output
(same kernels, same roundings; only the exp inside SiLU differs, std::exp against torch's
vectorized exp), is attached only where every expert qualifies, and decodes the same tokens.

Tolerances, relative to the largest output: fp32 1e-5, bf16 4e-3 (a bf16 ulp: one rounding of a
GLU value may differ when the two exps straddle a rounding boundary). Observed on 100 random
tokens per case (tiny Qwen3-MoE and Mixtral, W4 g32): fp32 at most 3.4e-7 (about 80% bit-equal),
bf16 bit-equal throughout.
"""

from __future__ import annotations

import pytest
import torch

import quantspec
from helpers import tiny_model
from quantspec.core.scheme import QuantScheme
from quantspec.kernels import cpu as cpu_mod
from quantspec.kernels.cpu_ext import load_cpu_ext
from quantspec.kernels.cpu_moe import CpuTokenExperts, attach_cpu_token, cannot_attach
from quantspec.models.experts import experts_modules
from quantspec.quant.recipe import Recipe

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(load_cpu_ext() is None, reason="the cpu extension is not built here"),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
LAYOUTS = ["auto", "rows"]  # auto: panels on AVX-512 VNNI CPUs


def _quantized(arch, dtype, layout, monkeypatch, scheme=QuantScheme(4, 32, True), **overrides):
    if layout == "rows":
        monkeypatch.setattr(cpu_mod, "panels_supported", lambda: False)
    model = tiny_model(arch, **overrides).to(dtype)
    recipe = Recipe(name="t", method="rtn", scheme=scheme, format="gptq")
    return quantspec.quantize_model(model, recipe, backend="cpu")


def _routing(n_experts, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(n_experts, generator=g)[:k]
    ids[1] = -1 if seed % 2 else n_experts  # a dropped token's slot (outside [0, E))
    weights = torch.rand(k, generator=g).to(dtype)
    return ids.view(1, k), weights.view(1, k)


def _both(experts, x, ids, weights):
    """(the one-op output, the per-expert path's output) of ``experts`` for one token."""
    runner = experts.token_runner
    with torch.no_grad():
        fast = experts(x, ids, weights)
        experts.token_runner = None
        try:
            ref = experts(x, ids, weights)
        finally:
            experts.token_runner = runner
    return fast, ref


def _close(fast, ref, dtype):
    assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape
    err = (fast.float() - ref.float()).abs().max()
    assert err <= TOL[dtype] * ref.float().abs().max(), (float(err), float(ref.float().abs().max()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_one_op_equals_the_per_expert_path(arch, dtype, layout, monkeypatch):
    """Every MoE block of a W4 tiny Qwen3-MoE / Mixtral (experts without bias) gets the path, and
    its output for one token, a top-k holding a dropped index, equals the per-expert path's."""
    model, report = _quantized(arch, dtype, layout, monkeypatch)
    blocks = experts_modules(model)
    assert report["cpu_token_experts"] == list(blocks) and len(blocks) == 2
    assert report["grouped_experts"] == []
    for i, (name, experts) in enumerate(blocks.items()):
        runner = experts.token_runner
        assert isinstance(runner, CpuTokenExperts)
        assert runner.panels == (layout == "auto" and cpu_mod.panels_supported())
        assert all(lin.bias is None for mlp in experts for lin in mlp.linears())
        assert runner.shared == 3 * len(experts)  # every expert Linear views the stacked copy
        hidden = experts[0].linears()[0].in_features
        for seed in range(3):
            x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(10 * i + seed)).to(dtype)
            ids, weights = _routing(len(experts), 4, seed, dtype)
            _close(*_both(experts, x, ids, weights), dtype)
        none = torch.full((1, 2), -1)  # every slot dropped: zeros, as the per-expert path
        fast, ref = _both(experts, x, none, torch.ones(1, 2, dtype=dtype))
        assert torch.equal(fast, ref) and not fast.any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_work_split_across_threads_and_experts(layout, monkeypatch):
    """Larger experts on 2 threads (each thread's share of the (expert, panel) items ends inside
    an expert; 8-bit weights and group 64 too): still the per-expert path's output."""
    torch.set_num_threads(2)
    for scheme in (QuantScheme(4, 128, True), QuantScheme(8, 64, False)):
        model, report = _quantized("qwen3_moe", torch.float32, layout, monkeypatch, scheme=scheme,
                                   hidden_size=512, moe_intermediate_size=256, num_experts_per_tok=3,
                                   num_hidden_layers=1)
        (experts,) = experts_modules(model).values()
        assert experts.token_runner is not None
        for seed in range(2):
            x = torch.randn(1, 512, generator=torch.Generator().manual_seed(seed))
            ids = torch.tensor([[5, 0, 7]]) if seed else torch.tensor([[2, 6, 1]])
            weights = torch.tensor([[0.5, 0.3, 0.2]])
            _close(*_both(experts, x, ids, weights), torch.float32)


def test_attached_only_where_every_expert_qualifies(monkeypatch):
    """GPT-OSS (biases, clamped SwiGLU), the reference backend, a dense expert Linear and a
    column-gathering (act-order) layout keep the per-expert path, and ``cannot_attach`` says why."""
    model, report = _quantized("gpt_oss", torch.float32, "auto", monkeypatch)
    assert report["cpu_token_experts"] == []
    assert all(cannot_attach(e) == "the experts have biases" for e in experts_modules(model).values())
    recipe = Recipe(name="t", method="rtn", scheme=QuantScheme(4, 32, True), format="gptq")
    model, report = quantspec.quantize_model(tiny_model("qwen3_moe"), recipe, backend="reference")
    assert report["cpu_token_experts"] == []
    # one block with one dense expert Linear, the other with a column-gathering layout
    model, _ = _quantized("qwen3_moe", torch.float32, "auto", monkeypatch)
    first, second = experts_modules(model).values()
    for experts in (first, second):
        experts.token_runner = None
    first[3].add_module(first[3].names[2], torch.nn.Linear(32, 64, bias=False))
    second[5].linears()[0]._p_src = torch.arange(64, dtype=torch.int32)
    second[5].linears()[0]._prepared_cache = None
    assert cannot_attach(first) == "not every expert Linear is quantized"
    assert cannot_attach(second) == "a layout gathers columns (act-order / padding map)"
    assert attach_cpu_token(model) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decoder_decodes_the_same_tokens(dtype, monkeypatch):
    """Greedy decoding through the static decoder with the one-op path equals the per-expert
    path's (tokens, and logits within the tolerance); the prefill (rows > 1) goes per expert."""
    from quantspec.runtime.decoder import StaticDecoder

    model, report = _quantized("qwen3_moe", dtype, "auto", monkeypatch)
    blocks = experts_modules(model)
    runners = {n: e.token_runner for n, e in blocks.items()}
    assert all(runners.values())
    prompt = torch.randint(3, 300, (5,), generator=torch.Generator().manual_seed(4))

    def greedy(new=6):
        dec = StaticDecoder(model)
        logits = dec.forward([prompt], keep=1)
        tokens, steps = [], []
        for _ in range(new):
            token = logits[0, -1].argmax().view(1)
            tokens.append(int(token))
            logits = dec.forward([token], keep=1)
            steps.append(logits[0, -1].float())
        return tokens, torch.stack(steps)

    calls = []

    class Counted:
        def __init__(self, real):
            self.real, self.gate_up_layout = real, real.gate_up_layout

        def __call__(self, hidden, ids, weights):
            calls.append(hidden.shape[0])
            return self.real(hidden, ids, weights)

    for name, experts in blocks.items():
        experts.token_runner = Counted(experts.token_runner)
    fast_tokens, fast = greedy()
    assert calls and set(calls) == {1}  # one token at a time, never the prefill
    for name, experts in blocks.items():  # the decoder's fused gate/up are views of the stack
        for e, mlp in enumerate(experts):
            assert mlp.gate_up.fused
            assert mlp.gate_up._prepared["w"].data_ptr() == runners[name].gu["w"][e].data_ptr()
    for name, experts in blocks.items():
        experts.token_runner = None
    ref_tokens, ref = greedy()
    assert fast_tokens == ref_tokens
    _close(fast.to(dtype), ref.to(dtype), dtype)


def test_load_quantized_attaches_it(tmp_path):
    """A checkpoint loaded for the cpu backend gets the path on every MoE block
    (``model.quantspec_cpu_token_experts``), with the per-expert path's output."""
    from helpers import make_tiny_model

    folder = make_tiny_model(tmp_path, "qwen3_moe")
    recipe = Recipe(name="t", method="rtn", scheme=QuantScheme(4, 32, True), format="gptq")
    outcome = quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False)
    model = quantspec.load_quantized(outcome.out, backend="cpu", dtype="float32")
    blocks = experts_modules(model)
    assert model.quantspec_cpu_token_experts == list(blocks) and len(blocks) == 2
    for experts in blocks.values():
        x = torch.randn(1, experts[0].linears()[0].in_features, generator=torch.Generator().manual_seed(1))
        ids, weights = _routing(len(experts), 2, 0, torch.float32)
        _close(*_both(experts, x, ids, weights), torch.float32)
