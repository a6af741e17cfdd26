"""The screened argmax of an fp32 output head (``kernels.output_head``, csrc/cpu_screen.cpp).

Its contract is exact: ``OutputHead.argmax(x)`` is ``OutputHead.logits(x).argmax(-1)``, the same
index (the first maximum; a NaN as torch orders it), for 1 to 8 rows, whatever the weights. The
tests compare with the full fp32 logits of ``f32_gemv`` (no tolerance), on random heads and on
heads built so that the int8 copy alone picks the wrong token: near-ties that the rounding
reorders, exact ties, rows that differ by one unit in the last place. A kernel run with zero
bounds (the screen trusted as it is) must fail those, so the bound is what makes it exact.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from torch import nn

from quantspec.core.scheme import QuantScheme
from quantspec.kernels.cpu_ext import ext_supports, load_cpu_ext
from quantspec.kernels.output_head import OutputHead, screen_refusal, screen_tables
from quantspec.kernels.small_ops import argmax
from quantspec.runtime.decoder import StaticDecoder
from quantspec.specdec.selfdraft import quantize_in_memory

pytestmark = pytest.mark.skipif(not ext_supports("has_screened_argmax") or not ext_supports("has_avx512f"),
                                reason="the screened argmax needs the extension with AVX-512; this CPU or build has none")


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    load_cpu_ext()
    return argmax(torch.ops.quantspec_cpu.f32_gemv.default(x, w))


def _screened(x: torch.Tensor, w: torch.Tensor, zero_bounds: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    t = screen_tables(w)
    bound = torch.zeros_like(t.bound) if zero_bounds else t.bound
    return torch.ops.quantspec_cpu.screened_argmax.default(x, t.q, t.scale, bound, w)


def test_bound_holds_for_every_row():
    """|f32 logit - screened logit| <= bound * ||x|| for every row and x (the screened logit in
    fp64 from the int8 copy)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 200, generator=gen) * torch.rand(3000, 1, generator=gen)
    w[5] = 0.0  # a zero row: scale 1, codes 0
    w[7, 3] = 40.0  # an outlier weight: a coarse row
    t = screen_tables(w)
    x = torch.randn(8, 200, generator=gen) * 4
    x[0, 11] = 300.0  # a massive activation
    load_cpu_ext()
    exact = torch.ops.quantspec_cpu.f32_gemv.default(x, w).double()
    approx = x.double() @ (t.q.double() * t.scale.double().unsqueeze(1)).T
    room = t.bound.double().unsqueeze(0) * x.double().norm(dim=1, keepdim=True)
    assert bool(((exact - approx).abs() <= room).all())
    assert t.q.dtype == torch.int8 and int(t.q[5].abs().sum()) == 0 and float(t.bound[5]) < 1e-40  # 0, rounded up


@pytest.mark.parametrize("n,k", [(1000, 64), (5003, 100), (777, 17), (64, 576)])
def test_random_heads_equal_the_full_argmax(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    for m in range(1, 9):
        x = torch.randn(m, k, generator=gen) * 3
        ids, count = _screened(x, w)
        assert torch.equal(ids, _exact(x, w)), (n, k, m)
        assert bool((count >= 1).all()) and bool((count <= n).all())


def _near_ties(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose rows come in pairs nearly equal along x: each pair's order is decided by
    differences far below the int8 rounding, and the winning pair is the same for all rows of x."""
    k, pairs = 96, 200
    x = torch.randn(4, k, generator=gen)
    base = torch.randn(pairs, k, generator=gen) * 0.02
    base[17] = x[0] * 0.05  # the winning pair's base row
    step = torch.randn(pairs, k, generator=gen) * 2e-5
    w = torch.cat([base, base + step]).contiguous()
    return x[:1].expand(4, k) + torch.randn(4, k, generator=gen) * 1e-3, w


def test_near_ties_need_the_bound():
    """The screen alone (zero bounds) picks another token than the fp32 logits on some of these
    heads; with the bounds it never does."""
    gen = torch.Generator().manual_seed(1)
    wrong_without = 0
    for _ in range(12):
        x, w = _near_ties(gen)
        want = _exact(x, w)
        ids, count = _screened(x, w)
        assert torch.equal(ids, want)
        assert bool((count >= 2).all())  # both rows of the winning pair are candidates
        wrong_without += int((_screened(x, w, zero_bounds=True)[0] != want).sum())
    assert wrong_without > 0


def test_exact_ties_and_one_ulp_apart():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 64, generator=gen)
    w[200] = w[17]
    w[250] = w[17]
    x = w[17:18] * 5
    assert int(_screened(x, w)[0]) == int(_exact(x, w)) == 17  # the first of three equal logits
    w[250, 0] = torch.nextafter(w[250, 0], torch.tensor(float("inf")) * w[250, 0].sign())
    w[250, 1:] = w[17, 1:]
    x = w[17:18].clone()
    x[0, 0] = 1e3 * x[0, 0].sign()  # the last-place step of w[250, 0] shows in the logit
    assert int(_screened(x, w)[0]) == int(_exact(x, w))


def test_non_finite_inputs_follow_torch():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(500, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    assert torch.equal(_screened(x, w)[0], _exact(x, w))
    big = torch.full((1, 32), 3e37)  # finite x whose products overflow fp32
    assert torch.equal(_screened(big, w)[0], _exact(big, w))


def test_output_head_refusals():
    assert screen_refusal(nn.Linear(8, 16, bias=False)) is None
    assert "bias" in screen_refusal(nn.Linear(8, 16))
    assert "bfloat16" in screen_refusal(nn.Linear(8, 16, bias=False).to(torch.bfloat16))
    head = OutputHead(nn.Linear(8, 16, bias=False), screen=False)
    assert head.refusal == "turned off (screen=False)"
    lin = nn.Linear(8, 16, bias=False)
    with torch.no_grad():
        lin.weight[3, 2] = float("inf")
    head = OutputHead(lin)
    x = torch.randn(2, 8)
    assert torch.equal(head.argmax(x), head.logits(x).argmax(-1))  # non-finite weights: every logit
    assert head.screened_rows == 0


def test_output_head_argmax_is_the_argmax_of_its_logits():
    gen = torch.Generator().manual_seed(4)
    lin = nn.Linear(72, 4099, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4099, 72, generator=gen) * 0.1)
    head = OutputHead(lin)
    assert head.refusal is None
    for rows in (1, 2, 5, 8, 9, 20):
        x = torch.randn(1, rows, 72, generator=gen)
        assert torch.equal(head.argmax(x), argmax(head.logits(x)))
    assert head.screened_rows == 1 + 2 + 5 + 8  # 9 and 20 rows: every logit
    # one row's logits come from f32_gemv too (the rows argmax screens agree bit for bit)
    x = torch.randn(1, 72, generator=gen)
    assert torch.equal(head.logits(x), torch.ops.quantspec_cpu.f32_gemv.default(x, lin.weight))
    # the int8 copy is rebuilt after an in-place change of the weight
    with torch.no_grad():
        lin.weight[:, 0] *= -3
    x = torch.randn(6, 72, generator=gen)
    assert torch.equal(head.argmax(x), argmax(head.logits(x)))
    assert torch.equal(OutputHead(lin).argmax(x), head.argmax(x))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_decoder_forward_argmax(arch):
    """forward_argmax (and the tree's) against the argmax of forward's logits through a second
    decoder over the same model, over a prefill, single steps and a 5-token verification."""
    model = helpers.tiny_model(arch)
    a, b = StaticDecoder(model), StaticDecoder(model)
    assert a.lm_head.refusal is None
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for n in (17, 1, 5, 1):
            ids = torch.randint(3, 300, (n,), generator=gen)
            got, feats = a.forward_argmax([ids], keep=min(n, 8), features=True)
            logits, want_feats = b.forward_features([ids], keep=min(n, 8))
            assert torch.equal(got, argmax(logits)) and torch.equal(feats, want_feats)
        parents = torch.tensor([-1, 0, 0, 1])
        nodes = torch.randint(3, 300, (4,), generator=gen)
        got, none = a.forward_tree_argmax([nodes], [parents])
        assert none is None and torch.equal(got, argmax(b.forward_tree([nodes], [parents])))
    assert a.lm_head.screened_rows > 0


def test_quantized_head_is_refused_with_its_reason():
    model = helpers.tiny_model("llama")
    draft, _ = quantize_in_memory(model, QuantScheme(bits=4, group_size=32), include_lm_head=True)
    dec = StaticDecoder(draft)
    assert dec.lm_head.refusal is not None and "QuantLinear" in dec.lm_head.refusal
    with torch.inference_mode():
        ids = torch.randint(3, 300, (9,))
        got, _ = dec.forward_argmax([ids], keep=3)
    assert got.shape == (1, 3)
