"""quantspec::quant_linear: one opaque op under torch.compile, matching eager.

Tolerance: the compiled module runs the same op on the same tensors, so it must match eager
exactly for "aot_eager"; "inductor" (run with ``-m slow``) may fuse the surrounding ops (the residual add, the
activation) differently, so it is compared with atol=rtol=1e-5 in fp32. The eager op is
compared with the reference backend called directly: exactly equal (same computation).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from quantspec.kernels.custom_ops import (
    flatten_prepared,
    quant_linear,
    register_ops,
    unflatten_prepared,
)
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import QuantScheme

SCHEMES = [
    QuantScheme(4, 32, False),
    QuantScheme(8, -1, True, activations="int8-token-dynamic"),
]


class TwoLayer(torch.nn.Module):
    """x -> quant_linear -> gelu -> quant_linear + x: ops around the custom op for the compiler."""

    def __init__(self, scheme: QuantScheme, dim: int = 64, hidden: int = 96):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        ref = ReferenceBackend()
        self.scheme = scheme
        self.shapes = [(hidden, dim), (dim, hidden)]
        self.prepared = [
            ref.prepare(rtn(torch.randn(n, k, generator=g), scheme), torch.float32)
            for n, k in self.shapes
        ]
        self.bias = torch.randn(hidden, generator=g)

    def forward(self, x):
        (n1, k1), (n2, k2) = self.shapes
        h = quant_linear(x, self.prepared[0], "reference", self.scheme, n1, k1, self.bias)
        h = torch.nn.functional.gelu(h)
        return x + quant_linear(h, self.prepared[1], "reference", self.scheme, n2, k2)


def test_flatten_round_trip():
    p = {"scales": torch.ones(2), "codes": torch.zeros(3), "group": torch.arange(3)}
    tensors, names = flatten_prepared(p)
    assert names == "codes,group,scales"
    back = unflatten_prepared(tensors, names)
    assert list(back) == ["codes", "group", "scales"]
    assert all(back[k] is p[k] for k in p)
    assert unflatten_prepared([], "") == {}
    with pytest.raises(ValueError):
        unflatten_prepared(tensors[:2], names)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.short_name)
def test_eager_op_equals_reference_backend(scheme):
    torch.manual_seed(1)
    r = rtn(torch.randn(48, 40), scheme)
    ref = ReferenceBackend()
    p = ref.prepare(r, torch.float32)
    x, b = torch.randn(2, 5, 40), torch.randn(48)
    y = quant_linear(x, p, "reference", scheme, 48, 40, b)
    assert torch.equal(y, ref.linear(x, p, scheme, 48, 40, b))
    assert torch.equal(quant_linear(x, p, "reference", scheme, 48, 40), ref.linear(x, p, scheme, 48, 40, None))


def test_registration_is_lazy_and_idempotent():
    code = ("import torch, quantspec, quantspec.kernels.custom_ops as c; "
            "assert not hasattr(torch.ops.quantspec, 'quant_linear'); c.register_ops(); "
            "assert hasattr(torch.ops.quantspec, 'quant_linear')")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    register_ops()
    register_ops()
    op = torch.ops.quantspec.quant_linear.default
    assert "quant_linear" in str(op)
    fake = torch.empty(3, 7, 40, device="meta")
    p = {"codes": torch.empty(16, 40, dtype=torch.uint8, device="meta")}
    out = op(fake, list(p.values()), "codes", "reference", 4, 32, True, False, "", 16, 40, None)
    assert out.shape == (3, 7, 16) and out.device.type == "meta"


def _compile_and_compare(backend: str, scheme: QuantScheme, exact: bool):
    torch._dynamo.reset()
    model = TwoLayer(scheme)
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(2))
    register_ops()
    eager = model(x)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fails on any graph break
    got = compiled(x)
    if exact:
        assert torch.equal(got, eager)
    else:
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.short_name)
def test_compile_fullgraph_aot_eager(scheme):
    _compile_and_compare("aot_eager", scheme, exact=True)


@pytest.mark.slow
def test_compile_fullgraph_inductor(request):
    """Runs with ``-m slow``: a cold inductor C++ build takes ~2 min on 2 shared cores."""
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("inductor compile is slow; run with -m slow")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler")
    _compile_and_compare("inductor", SCHEMES[0], exact=False)


def test_op_is_one_node_in_the_graph():
    """The graph dynamo captures holds exactly two quant_linear calls and no dequant ops."""
    torch._dynamo.reset()
    seen = []

    def count(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    model = TwoLayer(SCHEMES[0])
    register_ops()
    torch.compile(model, backend=count, fullgraph=True)(torch.randn(2, 64))
    assert sum("quant_linear" in t for t in seen) == 2, seen
