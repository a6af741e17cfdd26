"""GPTQ against a slow unblocked reference, and its edge cases (dead inputs, damping retry)."""

from __future__ import annotations

import pytest
import torch

from quantspec.errors import QuantspecError
from quantspec.quant.gptq import (
    accumulate_hessian,
    gptq_quantize,
    gptq_quantize_with_values,
    make_empty_hessian,
)
from quantspec.quant.rtn import dequantize_codes, qparams, quantize_codes, rtn
from quantspec.core.scheme import QuantScheme


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on a shared CPU: more threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, k, generator=g)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.rand(k, generator=g) * 3 + 0.1
    return (z @ mix) * scale


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    H, n = make_empty_hessian(x.shape[-1]), 0
    for chunk in x.split(100):
        H, n = accumulate_hessian(H, chunk, n)
    return H


def reference_gptq(W, H, scheme, damp_percent=0.01):
    """Column-by-column OBS update with the full inverse Hessian (fp64), no blocking."""
    W, H = W.double().clone(), H.double().clone()
    n, k = W.shape
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    glen = scheme.group_len(k)
    static = None
    if scheme.static_groups:
        static = [qparams(W[:, s : s + glen], scheme) for s in range(0, k, glen)]
    order = torch.arange(k)
    if scheme.act_order:
        order = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    W, H = W[:, order], H[order][:, order]
    H += damp_percent * torch.diagonal(H).mean() * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    deq = torch.zeros(n, k, dtype=torch.float32)
    for c in range(k):
        if static is not None:
            scale, zero = static[int(order[c]) // glen]
        elif c % glen == 0:
            scale, zero = qparams(W[:, c : c + glen], scheme)
        dq = dequantize_codes(quantize_codes(W[:, c : c + 1], scale, zero, scheme), scale, zero, scheme)
        deq[:, c] = dq[:, 0]
        err = (W[:, c] - dq[:, 0].double()) / Hinv[c, c]
        W[:, c + 1 :] -= torch.outer(err, Hinv[c, c + 1 :])
        Hinv -= torch.outer(Hinv[:, c], Hinv[c, :]) / Hinv[c, c]
    return deq[:, torch.argsort(order)]


CASES = [
    (QuantScheme(bits=4, group_size=32), 16),
    (QuantScheme(bits=4, group_size=32), 64),
    (QuantScheme(bits=3, group_size=-1, symmetric=False), 32),
    (QuantScheme(bits=2, group_size=64, act_order=True), 48),
    (QuantScheme(bits=4, group_size=32, act_order=True, static_groups=True), 16),
    (QuantScheme(bits=8, group_size=128, symmetric=False), 128),
]


@pytest.mark.parametrize("scheme,block_size", CASES, ids=lambda c: str(c))
def test_matches_unblocked_reference(scheme, block_size):
    k = 160  # not a multiple of 64 or 128: the last group is shorter
    torch.manual_seed(1)
    W = torch.randn(24, k)
    H = hessian_of(correlated_inputs(1000, k))
    res, deq, info = gptq_quantize_with_values(W, H, scheme, block_size=block_size)
    ref = reference_gptq(W, H, scheme)
    res.validate()
    torch.testing.assert_close(deq, ref, rtol=0, atol=1e-5)
    assert torch.equal(res.dequantize(), deq)  # the QuantResult stands for what GPTQ computed
    assert info["retries"] == 0 and info["loss"] > 0


def test_beats_rtn_on_correlated_inputs():
    k = 128
    x = correlated_inputs(2000, k, seed=3)
    W = torch.randn(64, k, generator=torch.Generator().manual_seed(4))
    scheme = QuantScheme(bits=4, group_size=32)
    res, _ = gptq_quantize(W, hessian_of(x), scheme)

    def out_err(wq):
        return ((x @ (W - wq).T) ** 2).mean().item()

    e_gptq, e_rtn = out_err(res.dequantize()), out_err(rtn(W, scheme).dequantize())
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)


def test_act_order_g_idx_and_static_groups():
    k, glen = 128, 32
    x = correlated_inputs(1000, k, seed=5)
    H = hessian_of(x)
    W = torch.randn(16, k)
    dyn, deq_dyn, _ = gptq_quantize_with_values(W, H, QuantScheme(group_size=glen, act_order=True))
    assert dyn.g_idx is not None and dyn.g_idx.dtype == torch.int32
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    assert torch.equal(dyn.g_idx[perm].long(), torch.arange(k) // glen)
    assert torch.equal(dyn.dequantize(), deq_dyn)

    sta, deq_sta, _ = gptq_quantize_with_values(
        W, H, QuantScheme(group_size=glen, act_order=True, static_groups=True)
    )
    assert sta.g_idx is None
    assert torch.equal(sta.dequantize(), deq_sta)
    for g in range(k // glen):
        scale, _ = qparams(W[:, g * glen : (g + 1) * glen], sta.scheme)
        assert torch.equal(sta.scales[:, g], scale)


def test_dead_inputs_get_zero_weights():
    k = 64
    x = correlated_inputs(500, k)
    x[:, [3, 17]] = 0
    W = torch.randn(8, k)
    res, info = gptq_quantize(W, hessian_of(x), QuantScheme(group_size=32))
    assert info["dead_inputs"] == 2
    assert torch.all(res.dequantize()[:, [3, 17]] == 0)
    assert torch.all(res.qweight[:, [3, 17]] == res.scheme.sym_zero)


def test_cholesky_failure_retries_with_more_damping():
    k = 32
    H = torch.eye(k)
    H[0, 0] = -0.5  # indefinite: fails at damping 0.01 and 0.1 of the mean diagonal
    res, info = gptq_quantize(torch.randn(4, k), H, QuantScheme(group_size=32))
    assert info["retries"] == 2 and info["damp_percent"] == pytest.approx(1.0)
    res.validate()
    H[0, 0] = -1e6
    with pytest.raises(QuantspecError, match="damp_percent"):
        gptq_quantize(torch.randn(4, k), H, QuantScheme(group_size=32))


def test_hessian_is_running_mean():
    x = torch.randn(7, 5, 16)
    H, n = make_empty_hessian(16), 0
    for part in x.split(2):
        H, n = accumulate_hessian(H, part, n)
    flat = x.reshape(-1, 16)
    assert n == 35
    torch.testing.assert_close(H, 2 / 35 * flat.T @ flat)


def test_gram_by_blocks_matches_the_full_product():
    from quantspec.quant.hessian import TRI_MIN_K, gram

    torch.manual_seed(0)
    for k in (8, TRI_MIN_K, TRI_MIN_K + 7):  # below the threshold, on it, not a multiple of the blocks
        x = torch.randn(300, k, dtype=torch.float64)
        torch.testing.assert_close(gram(x), x.t() @ x, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("k", [96, 600, 1031])  # one triangular solve; halves of halves; odd halves
def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_damped_inverse(k):
    from quantspec.quant.gptq import inverse_hessian_factor

    H = hessian_of(correlated_inputs(4 * k, k, seed=k))
    U, damp, retries = inverse_hessian_factor(H, 0.01)
    Hd = H.double() + damp * torch.diagonal(H).double().mean() * torch.eye(k, dtype=torch.float64)
    ref = torch.linalg.cholesky(torch.linalg.inv(Hd), upper=True)  # fp64, the unique factor
    assert retries == 0 and torch.equal(U, U.triu()) and bool((torch.diagonal(U) > 0).all())
    assert float((U.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("static", [False, True])
def test_fp4_column_loop_search_gives_the_comparison_codes(preset, static, monkeypatch):
    """GPTQ's FP4 rounding by one search (``e2m1_round``) writes what ``e2m1_codes`` wrote."""
    from dataclasses import replace

    import quantspec.quant.gptq as gptq_mod
    from quantspec.core.scheme import SCHEME_PRESETS

    scheme = replace(SCHEME_PRESETS[preset], act_order=static, static_groups=static)
    torch.manual_seed(2)
    W = torch.randn(40, 160) * 0.05
    W[:, :16] = 0  # an all-zero group: NVFP4's scale 0, where w / s is NaN
    H = hessian_of(correlated_inputs(1000, 160))
    fast, fast_deq, _ = gptq_quantize_with_values(W, H, scheme, block_size=64)
    monkeypatch.setattr(gptq_mod, "e2m1_search_table", lambda device=None: None)  # the comparisons
    slow, slow_deq, _ = gptq_quantize_with_values(W, H, scheme, block_size=64)
    assert torch.equal(fast.qweight, slow.qweight) and torch.equal(fast.scales, slow.scales)
    assert torch.equal(fast_deq, slow_deq)


def test_bf16_gram_is_the_gram_of_the_bf16_inputs_summed_in_fp32():
    from quantspec.quant.hessian import gram, gram_bf16

    x = correlated_inputs(3000, 520, seed=5)
    xb = x.to(torch.bfloat16).double()
    exact = xb.t() @ xb  # what bf16 inputs stand for
    by_chunks, at_once = gram_bf16(x, 500), gram_bf16(x, 3000)
    err = lambda g: float((g.double() - exact).norm() / exact.norm())  # noqa: E731
    # each chunk's sums come back rounded to bf16 (2**-9 relative): chunks summed in fp32 halve it
    assert by_chunks.dtype == torch.float32 and err(by_chunks) < 1.5e-3 and err(by_chunks) < err(at_once)
    assert err(gram(x.double())) > 1e-4  # the bf16 rounding of the inputs is what it measures
