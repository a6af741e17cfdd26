"""Smoothing scales fold exactly: the float model's logits do not change.

Tolerance (fp32): max |logits' - logits| <= 1e-4 * max |logits|, with scales drawn from
exp(U(-1, 1)) and random non-trivial norm weights and biases.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import tiny_model
from quantspec.quant.arch_infer import get_arch
from quantspec.quant.smoothing import (
    collect_input_stats,
    fold_scales,
    resolve_pairs,
    scale_columns,
    scale_norm,
    scale_rows,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")


def build(arch: str, kv_heads: int, seed: int = 0) -> nn.Module:
    """A tiny random fp32 model of ``arch`` with randomised norm weights and biases."""
    model = tiny_model(arch, seed, num_key_value_heads=kv_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:  # norms: centre 1 (Gemma: weight 0 = identity)
                base = 0.0 if "gemma" in arch else 1.0
                p.copy_(base + torch.rand(p.shape, generator=g) - 0.5)
            elif p.dim() == 1:  # biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_folding_random_scales_keeps_logits(arch, kv_heads):
    model = build(arch, kv_heads)
    spec = get_arch(model)
    assert spec.name == arch
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = logits(model, ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    applied = 0
    for block in spec.block_list(model):
        pairs, skipped = resolve_pairs(block, spec)
        # MHA: every declared pair fits; GQA: v -> o (Phi-3: qkv -> o) cannot be smoothed.
        assert len(pairs) == (4 if kv_heads == 4 else 3), skipped
        for pair in pairs:
            s = torch.exp(torch.empty(pair.channels).uniform_(-1, 1, generator=g))
            fold_scales(pair, s)
            applied += 1
    out = logits(model, ids)
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-4 * ref.abs().max().item(), f"{arch}: max abs diff {diff}"
    # the fold really changed the parameters (a no-op fold would also pass the check above)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert applied > 0 and any("norm" in n for n in changed) and any("proj" in n for n in changed)


def test_pure_fold_functions():
    torch.manual_seed(0)
    k = 8
    x = torch.randn(5, k)
    w_norm = torch.rand(k) - 0.5
    W = torch.randn(6, k)
    s = torch.rand(k) + 0.5
    for offset in (0.0, 1.0):
        y = (x * (offset + w_norm)) @ W.T
        y2 = (x * (offset + scale_norm(w_norm, s, offset))) @ scale_columns(W, s).T
        torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    prev = torch.randn(3 * k, 4)
    b = torch.randn(3 * k)
    out = scale_rows(prev, s)
    torch.testing.assert_close(out[:2 * k], prev[:2 * k], rtol=0, atol=0)
    torch.testing.assert_close(out[2 * k:], prev[2 * k:] / s[:, None])
    torch.testing.assert_close(scale_rows(b, s)[2 * k:], b[2 * k:] / s)


def test_collect_input_stats_matches_direct():
    model = build("llama", 2)
    spec = get_arch(model)
    block = spec.block_list(model)[0]
    from quantspec.quant.capture import capture_inputs

    ids = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(0))
    inputs, kwargs = capture_inputs(model, spec, ids, torch.device("cpu"))
    seen = []
    h = block.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 128)))
    with torch.no_grad():
        stats = collect_input_stats(
            block, "model.layers.0", inputs, kwargs[0],
            {"model.layers.0.mlp.down_proj": block.mlp.down_proj}, sample_tokens=12,
        )["model.layers.0.mlp.down_proj"]
    h.remove()
    x = torch.cat(seen)
    assert stats.tokens == 48 and stats.sample.shape == (12, 128)
    torch.testing.assert_close(stats.absmax, x.abs().amax(0))
    torch.testing.assert_close(stats.absmean, x.abs().mean(0))
