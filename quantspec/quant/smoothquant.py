"""SmoothQuant W8A8 (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", arXiv 2211.10438).

Activation outliers sit in a few input channels, which makes per-token int8 activation
quantization lossy. SmoothQuant migrates them into the weights with a per-channel scale

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (X: [T, K] inputs, W: [N, K] weights)

folded exactly into the previous op (``smoothing.fold_scales``: norm weight / s, or the rows of
a previous Linear / s) and the balanced Linears' input columns (* s). ``max|W_j|`` is taken over
all balanced Linears of a pair (q/k/v together). Channels with no activation or no weight keep
``s = 1``. Then the weights are quantized int8 per output channel, symmetric, by the rounding
step the recipe composes it with (``compose.py``: ``smoothquant`` is SmoothQuant then RTN,
``smoothquant+gptq`` SmoothQuant then GPTQ), and the activations are quantized per token,
dynamically, at run time
(``scheme.activations == "int8-token-dynamic"``; kernels/reference.py, kernels/cpu.py).

Every smoothing pair of the ArchSpec is used (norm -> q/k/v, v -> o when shapes allow,
norm -> gate/up, up -> down): scaling a previous Linear's output rows does not change its own
per-channel int8 error, so the prev-Linear pairs smooth o/down inputs for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .method import BlockContext, Smoother
from .options import SmoothQuantOptions
from .smoothing import fold_scales, pair_stats, resolve_pairs

if TYPE_CHECKING:
    from .recipe import Recipe


def smoothquant_scales(
    x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """``s = x_absmax^alpha / w_absmax^(1-alpha)`` ([K], [K] -> fp32 [K]); 1 where either is 0."""
    x = x_absmax.to(torch.float32)
    w = w_absmax.to(torch.float32).to(x.device)
    ok = (x > 0) & (w > 0)
    s = x.clamp(min=1e-12).pow(alpha) / w.clamp(min=1e-12).pow(1 - alpha)
    return torch.where(ok, s.clamp(min=1e-5), torch.ones_like(s))


def weight_absmax(linears) -> torch.Tensor:
    """max |W[:, j]| over the rows of every Linear in ``linears`` (same K) -> fp32 [K]."""
    return torch.stack([l.weight.detach().abs().amax(dim=0).float() for l in linears]).amax(dim=0)


class SmoothQuantMethod(Smoother):
    """SmoothQuant's smoothing step: folds the scales into each block (norms and Linears change
    in place); a rounding step (``compose.py``) then quantizes the smoothed Linears. ``smooth``
    reports per layer ``sq_alpha``, ``sq_scale_max``/``min``."""

    data_parallel = True  # its one statistic, max |x| per channel, is max-reduced across processes

    def __init__(self, options: SmoothQuantOptions | None = None):
        super().__init__(options or SmoothQuantOptions())

    def smooth(self, ctx: BlockContext) -> dict[str, dict]:
        """Find and fold the scales of every smoothing pair with a planned Linear."""
        block, block_name, plan = ctx.block, ctx.name, ctx.plan
        info: dict[str, dict] = {}
        rel = {n[len(block_name) + 1 :] for n in plan}
        pairs, skipped = resolve_pairs(block, ctx.arch)
        pairs = [p for p in pairs if any(n in rel for n in p.linear_names)]
        if not pairs:
            return info
        stats = pair_stats(block, block_name, ctx.inputs, ctx.kwargs, pairs)
        for p, st in zip(pairs, stats):
            s = smoothquant_scales(ctx.reducer.max(st.absmax), weight_absmax(p.linears), self.options.alpha)
            fold_scales(p, s)
            for n in p.linear_names:
                if n in rel:
                    info.setdefault(f"{block_name}.{n}", {}).update(
                        {"sq_alpha": self.options.alpha, "sq_scale_max": float(s.max()),
                         "sq_scale_min": float(s.min())})
        if skipped:
            for n in plan:
                info.setdefault(n, {})["smoothing_skipped"] = skipped
        return info


def method_from_recipe(recipe: "Recipe") -> SmoothQuantMethod:
    """SmoothQuant's smoothing with ``recipe.smoothquant`` (alpha)."""
    return SmoothQuantMethod(recipe.smoothquant)


__all__ = ["SmoothQuantMethod", "method_from_recipe", "smoothquant_scales", "weight_absmax"]
