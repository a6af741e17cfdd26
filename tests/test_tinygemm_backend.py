"""The tinygemm backend (torch's int4 tile ops, torchao's int4 layout) against the reference.

Tolerances (relative Frobenius error of y against the reference, per activation dtype and bits):
* fp32: the ops get the exact scales and float zeros and accumulate in fp32: 1e-5 (what catches
  packing, ordering and zero-point bugs; one zero point off by one moves y by more).
* bf16 / fp16: the scales and float zeros zf = (8 - z) * s are rounded to the activation dtype.
  Below 4 bits zf is several times the weight it corrects (codes 0..2^b-1 against the op's
  fixed 8), so its rounding weighs more: observed max 2.8e-3 / 8.2e-3 / 3.9e-2 (bf16) and
  2.7e-4 / 8.7e-4 / 3.4e-3 (fp16) for 4 / 3 / 2 bits; the bounds are ~2.5x those.
"""

from __future__ import annotations

import pytest
import torch

from quantspec.core.scheme import QuantResult, QuantScheme
from quantspec.kernels.backend import choose_backend, computes_declared_scheme
from quantspec.kernels.reference import ReferenceBackend
from quantspec.kernels.tinygemm import TinygemmBackend
from quantspec.quant.rtn import rtn

TOLS = {torch.float32: {4: 1e-5, 3: 1e-5, 2: 1e-5}, torch.bfloat16: {4: 7e-3, 3: 2e-2, 2: 1e-1},
        torch.float16: {4: 7e-4, 3: 2e-3, 2: 1e-2}}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rel_err(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def make_result(bits, group_size, symmetric, act_order, n, k, seed=0) -> QuantResult:
    torch.manual_seed(seed)
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric, act_order=act_order)
    result = rtn(torch.randn(n, k), scheme)
    if act_order:
        result.g_idx = (torch.randperm(k) // scheme.group_len(k)).to(torch.int32)
    return result


CASES = [(bits, gs, sym, act) for bits in (2, 3, 4) for gs in (-1, 32, 64, 128) for sym in (True, False)
         for act in (False, True) if not (act and gs == -1)]


@pytest.mark.parametrize("bits,gs,sym,act", CASES)
@pytest.mark.parametrize("dtype", TOLS, ids=str)
def test_matches_reference(bits, gs, sym, act, dtype):
    backend, ref = TinygemmBackend(), ReferenceBackend()
    for n, k in ((48, 256), (32, 200), (64, 576)):  # 200: groups padded; 576 = 4.5 x 128
        result = make_result(bits, gs, sym, act, n, k)
        prepared = backend.prepare(result, dtype)
        bias = torch.randn(n)
        for m in (1, 5, 33):
            x = torch.randn(2, m, k).to(dtype)
            y = backend.linear(x, prepared, result.scheme, n, k, bias)
            assert y.shape == (2, m, n) and y.dtype == dtype
            want = ref.linear(x.float(), ref.prepare(result, torch.float32), result.scheme, n, k, bias)
            assert rel_err(y, want) < TOLS[dtype][bits], (n, k, m)


def test_a_wrong_zero_point_is_caught():
    """The fp32 bound is tight enough to see one zero point off by one."""
    backend, ref = TinygemmBackend(), ReferenceBackend()
    result = make_result(4, 64, False, False, 48, 256)
    prepared = backend.prepare(result, torch.float32)
    result.zeros[3, 1] += 1
    x = torch.randn(4, 256)
    want = ref.linear(x, ref.prepare(result, torch.float32), result.scheme, 48, 256, None)
    assert rel_err(backend.linear(x, prepared, result.scheme, 48, 256, None), want) > TOLS[torch.float32][4]


@pytest.mark.parametrize("scheme,n,why", [
    (QuantScheme(bits=8), 64, "at most 4 bits"),
    (QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic"), 64, "weight-only"),
    (QuantScheme(bits=4, weights="nvfp4", group_size=16), 64, "weight-only"),
    (QuantScheme(bits=4), 40, "multiple of 16"),
])
def test_cannot_run_names_the_limit(scheme, n, why):
    assert why in TinygemmBackend().cannot_run(scheme, n, 256, torch.device("cpu"), torch.float32)


def test_cuda_limits_are_declared_without_a_gpu():
    why = TinygemmBackend().cannot_run(QuantScheme(bits=4), 64, 256, torch.device("cuda"), torch.bfloat16)
    assert why is not None and ("CUDA" in why or "NVIDIA" in why)
    assert "not mps" in TinygemmBackend().cannot_run(QuantScheme(bits=4), 64, 256, torch.device("mps"), torch.float16)


def test_named_by_request_and_not_exact():
    """Selectable by name; ``exact`` passes it over (its scales follow the activation dtype)."""
    scheme = QuantScheme(bits=4, group_size=128)
    backend, why = choose_backend(scheme, 64, 256, torch.device("cpu"), torch.float32, "tinygemm")
    assert backend.name == "tinygemm" and why == "requested"
    assert not computes_declared_scheme("tinygemm", scheme)
