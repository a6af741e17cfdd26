"""Asymmetric calibration (``gptq.asymmetric``): GPTQ rounds the weight that minimizes
||W X - Q Xq|| (float inputs X, quantized-model inputs Xq) instead of W itself."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.errors import QuantspecError
from quantspec.quant.arch import block_linears
from quantspec.quant.arch_infer import get_arch
from quantspec.quant.block_methods import GPTQMethod
from quantspec.quant.block_ops import block_forward
from quantspec.quant.calibrate import run_blockwise
from quantspec.quant.capture import capture_inputs
from quantspec.quant.gptq import asymmetric_target
from quantspec.quant.hessian import accumulate_hessian, cross_term, make_empty_hessian, weight_cross_term
from quantspec.quant.recipe import GPTQOptions

from helpers import Interrupt, raise_interrupt, tiny_model

SCHEME = QuantScheme(bits=3, group_size=32)
# intermediate 160 > 2 x hidden 64: down_proj takes weight_cross_term, the others cross_term
SMALL = dict(vocab_size=128, intermediate_size=160, max_position_embeddings=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls on a shared CPU


def tiny_llama(layers: int = 3):
    return tiny_model("llama", num_hidden_layers=layers, **SMALL)


def calib(n: int = 6, L: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (n, L), generator=torch.Generator().manual_seed(1))


def _objective(W, Q, x, xq, lam):
    """(2/T) ||x W^T - xq Q^T||^2 + lam ||Q - W||^2, fp64."""
    T = x.shape[0]
    return (2.0 / T) * (x @ W.T - xq @ Q.T).pow(2).sum() + lam * (Q - W).pow(2).sum()


def test_asymmetric_target_minimizes_the_damped_objective():
    g = torch.Generator().manual_seed(0)
    T, K, N, damp = 300, 24, 16, 0.01
    x = torch.randn(T, K, generator=g, dtype=torch.float64)
    xq = x + 0.3 * torch.randn(T, K, generator=g, dtype=torch.float64)
    W = torch.randn(N, K, generator=g, dtype=torch.float64)
    H, _ = accumulate_hessian(make_empty_hessian(K), xq.float(), 0)
    C = cross_term(x.float(), xq.float())
    torch.testing.assert_close(C.double(), (2.0 / T) * (x - xq).T @ xq, rtol=1e-5, atol=1e-5)
    Wstar = asymmetric_target(W.float(), H, W.float() @ C, damp).double()

    Hd = (2.0 / T) * xq.T @ xq
    lam = damp * Hd.diagonal().mean()
    exact = ((2.0 / T) * W @ x.T @ xq + lam * W) @ torch.linalg.inv(Hd + lam * torch.eye(K, dtype=torch.float64))
    torch.testing.assert_close(Wstar, exact, rtol=1e-4, atol=1e-4)
    # for any Q the objective is tr((W* - Q) Hd (W* - Q)^T) plus a constant: GPTQ's own objective on W*
    base = _objective(W, exact, x, xq, lam)
    Hdamped = Hd + lam * torch.eye(K, dtype=torch.float64)
    for _ in range(3):
        Q = exact + 0.5 * torch.randn(N, K, generator=g, dtype=torch.float64)
        D = exact - Q
        torch.testing.assert_close(_objective(W, Q, x, xq, lam) - base, ((D @ Hdamped) * D).sum(), rtol=1e-8, atol=1e-8)


def test_bf16_cross_term_is_that_of_the_bf16_rounded_operands():
    g = torch.Generator().manual_seed(3)
    xq = torch.randn(3000, 96, generator=g)
    x = xq + 0.05 * torch.randn(3000, 96, generator=g)
    d = (x - xq).to(torch.bfloat16).double()
    exact = (2.0 / 3000) * d.t() @ xq.to(torch.bfloat16).double()
    fast = cross_term(x, xq, bf16=True, chunk_rows=500)
    err = float((fast.double() - exact).norm() / exact.norm())
    assert fast.dtype == torch.float32 and err < 2e-3, err
    # and the rounding is all it changes: fp32 lies within bf16's rounding of the operands
    full = cross_term(x, xq).double()
    assert float((fast.double() - full).norm() / full.norm()) < 2e-2


def test_weight_cross_term_is_w_times_the_cross_term():
    g = torch.Generator().manual_seed(4)
    xq = torch.randn(2000, 160, generator=g)
    x = xq + 0.1 * torch.randn(2000, 160, generator=g)
    W = torch.randn(40, 160, generator=g)
    exact = W.double() @ ((2.0 / 2000) * (x - xq).double().t() @ xq.double())
    rel = lambda a: float((a.double() - exact).norm() / exact.norm())  # noqa: E731
    assert rel(weight_cross_term(W, x, xq)) < 1e-5
    assert rel(W @ cross_term(x, xq)) < 1e-5
    assert rel(weight_cross_term(W, x, xq, bf16=True, chunk_rows=700)) < 2e-2  # bf16 operands


def test_equal_inputs_leave_the_weight_unchanged():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 12, generator=g)
    x[:, 3] = 0  # a dead input: its column is zero, as GPTQ makes it
    W = torch.randn(5, 12, generator=g)
    H, _ = accumulate_hessian(make_empty_hessian(12), x, 0)
    Wstar = asymmetric_target(W, H, W @ cross_term(x, x), 0.01)
    expected = W.clone()
    expected[:, 3] = 0
    assert torch.equal(Wstar, expected)


def _run(model, options, plan=None, **kw):
    arch = get_arch(model)
    plan = plan if plan is not None else {n: SCHEME for n in block_linears(model, arch)}
    report: dict = {}
    res = run_blockwise(model, arch, calib(), GPTQMethod(options), plan, progress=False, report=report, **kw)
    return res, report


def _final_error(base, quantized, ids) -> float:
    """Relative error of the last block's output of ``quantized`` against the float ``base``."""
    arch = get_arch(base)
    with torch.no_grad():
        outs = []
        for m in (base, quantized):
            h, kwargs = capture_inputs(m, arch, ids, torch.device("cpu"))
            for i, block in enumerate(arch.block_list(m)):
                h = block_forward(block, h, kwargs[i])
            outs.append(h)
    return float((outs[1] - outs[0]).norm() / outs[0].norm())


def test_asymmetric_gptq_reports_and_lowers_the_model_error(monkeypatch):
    import quantspec.quant.block_methods as bm

    wide: list[tuple] = []
    real = bm.weight_cross_term
    monkeypatch.setattr(bm, "weight_cross_term", lambda w, *a: wide.append(tuple(w.shape)) or real(w, *a))
    base = tiny_llama()
    opts = GPTQOptions(block_size=16, hessian_dtype="float32")
    plain_model, asym_model = copy.deepcopy(base), copy.deepcopy(base)
    plain, plain_report = _run(plain_model, opts)
    # the whole correction (alpha 1) and no bound: the objective as derived
    full = GPTQOptions(block_size=16, hessian_dtype="float32", asymmetric=True, asymmetric_alpha=1.0,
                       asymmetric_max_shift=1e9)
    asym, report = _run(asym_model, full)
    assert wide == [(64, 160)] * 3  # the down_projs
    assert all(report[n]["asymmetric"] == "on" for n in asym), report
    assert all("asymmetric" not in plain_report[n] for n in plain)
    # block 0's q/k/v read the embeddings, the same in both models: nothing to correct
    for n in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"):
        assert plain[n].equal(asym[n]), n
    assert not plain["model.layers.0.self_attn.o_proj"].equal(asym["model.layers.0.self_attn.o_proj"])
    # on the calibration tokens (what both minimize; a model this small overfits 144 rows, so
    # held-out text is the real-model benchmark's job: benchmarks/gptq_options.py)
    e_plain, e_asym = _final_error(base, plain_model, calib()), _final_error(base, asym_model, calib())
    assert e_asym < 0.5 * e_plain, (e_asym, e_plain)


def test_a_correction_beyond_max_shift_keeps_gptqs_target():
    base = tiny_llama()
    plain, _ = _run(copy.deepcopy(base), GPTQOptions(block_size=16))
    bounded, report = _run(copy.deepcopy(base), GPTQOptions(block_size=16, asymmetric=True, asymmetric_max_shift=1e-9))
    for name in plain:
        assert plain[name].equal(bounded[name]), name
    o = report["model.layers.1.self_attn.o_proj"]
    assert o["asymmetric"].startswith("off: the correction would move the weight by") and o["asymmetric_shift"] > 1e-9
    # at the default alpha the correction is a quarter of the full one
    _, quarter = _run(copy.deepcopy(base), GPTQOptions(block_size=16, asymmetric=True, asymmetric_max_shift=1e9))
    _, whole = _run(copy.deepcopy(base), GPTQOptions(block_size=16, asymmetric=True, asymmetric_alpha=1.0,
                                                     asymmetric_max_shift=1e9))
    n = "model.layers.0.self_attn.o_proj"  # the first layer whose inputs (hence H and C) are the same in both runs
    assert quarter[n]["asymmetric_shift"] == pytest.approx(whole[n]["asymmetric_shift"] / 4, rel=1e-4)


def test_a_block_with_nothing_planned_restarts_the_float_stream():
    base = tiny_llama()
    arch = get_arch(base)
    plan = {n: SCHEME for n in block_linears(base, arch) if not n.startswith("model.layers.1.")}
    _, report = _run(base, GPTQOptions(asymmetric=True, asymmetric_max_shift=1e9), plan)
    assert report["model.layers.0.mlp.down_proj"]["asymmetric"] == "on"
    assert report["model.layers.2.mlp.down_proj"]["asymmetric"].startswith("on, from this block's quantized inputs")


def test_resume_carries_the_float_stream(tmp_path):
    base = tiny_llama()
    opts = GPTQOptions(block_size=16, asymmetric=True, asymmetric_max_shift=1e9)
    clean, _ = _run(copy.deepcopy(base), opts)
    interrupted = copy.deepcopy(base)
    interrupted.model.layers[2].register_forward_pre_hook(raise_interrupt)  # dies inside block 2
    with pytest.raises(Interrupt):
        _run(interrupted, opts, resume_dir=tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["done"] == 2
    resumed, report = _run(copy.deepcopy(base), opts, resume_dir=tmp_path)
    for name in clean:
        assert clean[name].equal(resumed[name]), name
    assert report["model.layers.2.mlp.down_proj"]["asymmetric"] == "on"


def test_the_float_stream_counts_against_the_single_pass_limit():
    """A block whose activations fit the single pass but not with the float stream beside them
    is refused under asymmetric calibration (before, it ran and could run out of memory)."""
    from quantspec.quant.block_methods import float_stream_bytes, single_pass_bytes

    model = tiny_llama(layers=1)
    arch = get_arch(model)
    h, _ = capture_inputs(model, arch, calib(), torch.device("cpu"))
    modules = dict(arch.block_list(model)[0].named_modules())
    plain, extra = single_pass_bytes(modules, h), float_stream_bytes(modules, h)
    assert extra == h.shape[0] * h.shape[1] * (2 * 64 + 64 + 160) * 4  # hidden 64 (q/k/v/gate/up and o_proj), down 160
    gb = (plain + extra / 2) / 2**30
    _, report = _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=gb))
    assert report["model.layers.0.mlp.down_proj"]["gptq_pass"] == "single"  # plain GPTQ: the single pass fits
    with pytest.raises(QuantspecError, match="float stream exceed gptq.single_pass_gb"):
        _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=gb, asymmetric=True))
    _, report = _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=(plain + extra) / 2**30, asymmetric=True))
    assert report["model.layers.0.mlp.down_proj"]["gptq_pass"] == "single"


def test_asymmetric_refuses_the_per_group_path_and_bad_values():
    with pytest.raises(QuantspecError, match="gptq.asymmetric needs the single pass"):
        _run(tiny_llama(), GPTQOptions(single_pass_gb=0, asymmetric=True))
    with pytest.raises(QuantspecError, match="gptq.asymmetric="):
        GPTQOptions(asymmetric="yes")
    assert GPTQOptions(asymmetric="auto").asymmetric == "auto"
    with pytest.raises(QuantspecError, match="gptq.asymmetric_alpha="):
        GPTQOptions(asymmetric_alpha=0)
    with pytest.raises(QuantspecError, match="gptq.asymmetric_max_shift="):
        GPTQOptions(asymmetric_max_shift=-1)



def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].qweight, b[n].qweight) and torch.equal(a[n].scales, b[n].scales) for n in a)


def test_auto_runs_it_where_it_fits_and_plain_gptq_elsewhere_with_the_reason():
    """``asymmetric: auto`` gives asymmetric calibration's results where the single pass holds
    the float stream, and plain GPTQ's (not an error) where it does not, saying so per layer."""
    from quantspec.quant.block_methods import float_stream_bytes, single_pass_bytes

    model = tiny_llama(layers=2)
    arch = get_arch(model)
    h, _ = capture_inputs(model, arch, calib(), torch.device("cpu"))
    modules = dict(arch.block_list(model)[0].named_modules())
    plain, extra = single_pass_bytes(modules, h), float_stream_bytes(modules, h)
    down = "model.layers.1.mlp.down_proj"
    for gb in (None, (plain + extra / 2) / 2**30, 0):
        auto, report = _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=gb, asymmetric="auto"))
        if gb is None:  # fits: asymmetric calibration's results
            asym, asym_report = _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=gb, asymmetric=True))
            assert _same(auto, asym) and report[down]["asymmetric"] == asym_report[down]["asymmetric"] == "on"
            assert not _same(auto, _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=gb))[0])
        else:  # plain GPTQ's, in the single pass where that alone fits, else per group
            assert _same(auto, _run(copy.deepcopy(model), GPTQOptions(single_pass_gb=gb))[0])
            assert report[down]["asymmetric"].startswith("off (auto): the single pass with the float stream")
            assert report[down]["gptq_pass"] == ("per-group" if gb == 0 else "single")


def test_auto_is_plain_gptq_when_the_calibration_is_split_across_processes():
    from quantspec.quant.distributed import Reducer

    model, two = tiny_llama(layers=1), Reducer(rank=0, world=2)  # identity reductions, active
    auto, report = _run(copy.deepcopy(model), GPTQOptions(asymmetric="auto"), reducer=two)
    assert _same(auto, _run(copy.deepcopy(model), GPTQOptions(), reducer=two)[0])
    assert report["model.layers.0.mlp.down_proj"]["asymmetric"] == "off (auto): the calibration is split across processes"
    with pytest.raises(QuantspecError, match="does not split its calibration across processes"):
        _run(copy.deepcopy(model), GPTQOptions(asymmetric=True), reducer=two)
