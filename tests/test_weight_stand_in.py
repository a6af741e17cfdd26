"""A quantized Linear's ``.weight``: reads as the layer's shape, compute dtype and device; any
computation with it raises a one-line QuantspecError naming the layer (never a silent result)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantspec.core.scheme import QuantScheme
from quantspec.errors import QuantspecError
from quantspec.kernels.quant_linear import QuantLinear
from quantspec.quant.rtn import rtn


@pytest.fixture()
def layer():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q = QuantLinear.from_result(rtn(w, QuantScheme(4, 32, True)), "gptq", bias=None, dtype=torch.bfloat16)
    q.prepare("reference")
    q.layer_name = "model.layers.0.self_attn.indexer.weights_proj"
    return q


def test_the_weight_reads_as_a_linears(layer):
    w = layer.weight
    assert w.shape == (16, 64) and w.dtype == torch.bfloat16 and w.device.type == "cpu"
    assert w.ndim == 2 and w.size(1) == 64 and w.dim() == 2 and not w.is_meta and w.is_floating_point()
    assert w.stride() == (0, 0)  # one element expanded: no copy of the weights
    x = torch.randn(3, 64)
    assert layer(x.to(layer.weight.dtype)).dtype == torch.bfloat16


@pytest.mark.parametrize("use", [lambda w, x: F.linear(x, w), lambda w, x: x @ w.T, lambda w, x: w.float(),
                                 lambda w, x: w.detach(), lambda w, x: w.sum()])
def test_computing_with_it_raises_naming_the_layer(layer, use):
    with pytest.raises(QuantspecError, match="computed with model.layers.0.self_attn.indexer.weights_proj.weight") as err:
        use(layer.weight, torch.randn(3, 64, dtype=torch.bfloat16))
    assert "ignore list" in str(err.value) and "\n" not in str(err.value)
