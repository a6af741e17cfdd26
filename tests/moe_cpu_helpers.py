"""Shared by the tests of the cpu backend's one-op MoE path (``kernels.cpu_moe``):
test_moe_cpu_token.py (one token) and test_moe_cpu_rows.py (a few rows).

Tolerances, relative to the largest output: fp32 1e-5, bf16 4e-3 (a bf16 ulp: one rounding of a
GLU value may differ when the two exps straddle a rounding boundary; std::exp in the op, torch's
vectorized exp in the per-expert path).
"""

from __future__ import annotations

import torch

import quantspec
from helpers import tiny_model
from quantspec.core.scheme import QuantScheme
from quantspec.kernels import cpu as cpu_mod
from quantspec.models.experts import is_fused_experts
from quantspec.quant.recipe import Recipe

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
LAYOUTS = ["auto", "rows"]  # auto: panels on AVX-512 VNNI CPUs
LIMIT = 0.2  # the tiny GPT-OSS's swiglu_limit: low enough that both clamps bite on random tokens
W4 = QuantScheme(4, 32, True)


def quantized(arch, dtype, layout, monkeypatch, scheme=W4, fmt="gptq", edit=None,
              **overrides):
    """A tiny ``arch`` (``edit(model)`` applied in fp32 first) in ``dtype``, quantized with RTN
    for the cpu backend: (model, report)."""
    if layout == "rows":
        monkeypatch.setattr(cpu_mod, "panels_supported", lambda: False)
    model = tiny_model(arch, **overrides)
    if edit is not None:
        edit(model)
    recipe = Recipe(name="t", method="rtn", scheme=scheme, format=fmt)
    return quantspec.quantize_model(model.to(dtype), recipe, backend="cpu")


def gpt_oss_biases(model):
    """Random biases on GPT-OSS's fused experts (transformers initializes them to zero), about
    the size of the products they are added to."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in filter(is_fused_experts, model.modules()):
            mod.gate_up_proj_bias.copy_(0.2 * torch.randn(mod.gate_up_proj_bias.shape, generator=g))
            mod.down_proj_bias.copy_(0.01 * torch.randn(mod.down_proj_bias.shape, generator=g))


def close(fast, ref, dtype):
    """``fast`` equals ``ref`` within the tolerance of ``dtype`` (same dtype and shape)."""
    assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape
    err = (fast.float() - ref.float()).abs().max()
    assert err <= TOL[dtype] * ref.float().abs().max(), (float(err), float(ref.float().abs().max()))


def both(experts, x, ids, weights):
    """(the one-op output, the per-expert path's output) of ``experts`` for the rows of x."""
    runner = experts.token_runner
    with torch.no_grad():
        fast = experts(x, ids, weights)
        experts.token_runner = None
        try:
            ref = experts(x, ids, weights)
        finally:
            experts.token_runner = runner
    return fast, ref


class Counted:
    """A token runner recording the rows of each call into ``calls``."""

    def __init__(self, real, calls: list[int]):
        self.real, self.calls = real, calls
        self.gate_up_layout, self.max_rows = real.gate_up_layout, real.max_rows

    def __call__(self, hidden, ids, weights):
        self.calls.append(hidden.shape[0])
        return self.real(hidden, ids, weights)
