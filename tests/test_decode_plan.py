"""The decode plan (``runtime.decode_plan``: a step's blocks as one C++ loop) against the Python loop.

The plan makes the same op calls with the same arguments as ``StaticDecoder._blocks``, so the
logits must be the same bits (``torch.equal``, no tolerance), for every kind of block it takes:
dense fp32 and bf16 products (few-row gemv and torch's), 4-bit layouts fused and unfused, q/k
norms, biases, sliding windows and attention sinks. Steps cover a prefill, single tokens, several
tokens at once (a verification) and dropped tokens. Blocks it does not take get the Python loop
and a reason (``plan_refusal``).
"""

from __future__ import annotations

import helpers
import pytest
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.kernels.cpu import panels_supported
from quantspec.kernels.cpu_ext import ext_supports
from quantspec.runtime.decode_plan import build_plan
from quantspec.runtime.decoder import StaticDecoder
from quantspec.specdec.selfdraft import quantize_in_memory

pytestmark = pytest.mark.skipif(not ext_supports("has_avx512f"),
                                reason="the decode plan runs the extension's AVX-512 attention; this CPU or build has none")


def _steps(decoder: StaticDecoder, gen: torch.Generator) -> list[torch.Tensor]:
    out = [decoder.forward([torch.randint(3, 300, (23,), generator=gen)])]
    for n in (1, 1, 5, 1):
        out.append(decoder.forward([torch.randint(3, 300, (n,), generator=gen)]))
    decoder.drop_last([3])
    out.append(decoder.forward([torch.randint(3, 300, (2,), generator=gen)], keep=1))
    return out


def _assert_same_logits(planned: StaticDecoder, python: StaticDecoder, seed: int) -> None:
    """``_steps`` through both decoders: the same logits, bit for bit."""
    with torch.inference_mode():
        got = _steps(planned, torch.Generator().manual_seed(seed))
        want = _steps(python, torch.Generator().manual_seed(seed))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {i}: max diff {(g.float() - w.float()).abs().max():.3e}"


def _same_as_python_loop(model: torch.nn.Module) -> StaticDecoder:
    planned, python = StaticDecoder(model), StaticDecoder(model, plan=False)
    _assert_same_logits(planned, python, 3)
    assert planned.plan_refusal is None and planned._plan is not None
    assert python._plan is None
    return planned


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Random q/k/v biases and norm weights (initialized as zeros and ones: a swapped pair of
    them would go unseen)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_dense_fp32_same_bits(arch):
    _same_as_python_loop(_perturbed(helpers.tiny_model(arch)))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_bf16_same_bits(arch):
    _same_as_python_loop(helpers.tiny_model(arch).to(torch.bfloat16))


@pytest.mark.parametrize("arch,fuse,layout", [("llama", True, "auto"), ("llama", False, "auto"), ("qwen2", True, "auto"),
                                               ("qwen3", True, "auto"), ("llama", True, "rows")])
def test_quantized_same_bits(arch, fuse, layout, monkeypatch):
    """4-bit bodies with W8 heads, on this CPU's layout (panels with AVX-512 VNNI) and on the rows
    layout (qgemm) that CPUs without VNNI get."""
    if layout == "rows":
        monkeypatch.setattr("quantspec.kernels.cpu.panels_supported", lambda: False)
    model, _ = quantize_in_memory(_perturbed(helpers.tiny_model(arch)), QuantScheme(bits=4, group_size=32),
                                  include_lm_head=True, head_scheme=QuantScheme(bits=8, group_size=-1))
    planned, python = StaticDecoder(model, fuse=fuse), StaticDecoder(model, fuse=fuse, plan=False)
    _assert_same_logits(planned, python, 5)
    assert planned.plan_refusal is None
    panels = {blk.qkv.fused_op()[0].panels for blk in planned.blocks} if fuse else None
    assert panels in ({False} if layout == "rows" else {panels_supported()}, None)


def test_window_and_sinks_same_bits():
    """A sliding window shorter than the steps' context, and per-head sink logits (GPT-OSS's,
    set here on a dense Llama-family model through the blocks the plan reads)."""
    model = helpers.tiny_model("mistral", sliding_window=8)
    planned, python = StaticDecoder(model), StaticDecoder(model, plan=False)
    for dec in (planned, python):
        for blk in dec.blocks:
            assert blk.window == 8
            blk.sinks = torch.linspace(-1.0, 2.0, dec.n_heads)
    _assert_same_logits(planned, python, 7)


def test_rows_with_holes_take_the_python_loop():
    """Uneven rows leave holes in the cache: the masked path, not the plan. The logits still
    equal the Python loop's, and the plan serves the batch of one after a reset."""
    model = helpers.tiny_model("llama")
    planned, python = StaticDecoder(model), StaticDecoder(model, plan=False)
    rows = [torch.arange(5, 17), torch.arange(30, 34)]
    with torch.inference_mode():
        for dec in (planned, python):
            dec.forward(rows)
        assert planned.mask is not None
        assert torch.equal(planned.forward([torch.tensor([7]), torch.tensor([9])]),
                           python.forward([torch.tensor([7]), torch.tensor([9])]))
    _same_as_python_loop(model)


def test_moe_blocks_are_refused_with_a_reason():
    dec = StaticDecoder(helpers.tiny_model("qwen3_moe"))
    plan, why = build_plan(dec)
    assert plan is None and "mixture-of-experts" in why
    with torch.inference_mode():
        dec.forward([torch.arange(5, 12)])  # the Python loop runs
    assert dec._plan is None and "mixture-of-experts" in dec.plan_refusal


def test_turned_off():
    dec = StaticDecoder(helpers.tiny_model("llama"), plan=False)
    with torch.inference_mode():
        dec.forward([torch.arange(5, 12)])
    assert dec._plan is None and "turned off" in dec.plan_refusal
