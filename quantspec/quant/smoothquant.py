"""SmoothQuant W8A8 (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models", arXiv 2211.10438).

Activation outliers sit in a few input channels, which makes per-token int8 activation
quantization lossy. SmoothQuant migrates them into the weights with a per-channel scale

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (X: [T, K] inputs, W: [N, K] weights)

folded exactly into the previous op (``smoothing.fold_scales``: norm weight / s, or the rows of
a previous Linear / s) and the balanced Linears' input columns (* s). ``max|W_j|`` is taken over
all balanced Linears of a pair (q/k/v together). Channels with no activation or no weight keep
``s = 1``. Then the weights are quantized int8 per output channel, symmetric (RTN by default,
or GPTQ), and the activations are quantized per token, dynamically, at run time
(``scheme.activations == "int8-token-dynamic"``; kernels/reference.py, kernels/cpu.py).

Every smoothing pair of the ArchSpec is used (norm -> q/k/v, v -> o when shapes allow,
norm -> gate/up, up -> down): scaling a previous Linear's output rows does not change its own
per-channel int8 error, so the prev-Linear pairs smooth o/down inputs for free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .arch import ArchSpec
from .recipe import GPTQOptions, Recipe
from .rtn import rtn
from .scheme import QuantResult, QuantScheme
from .smoothing import fold_scales, pair_stats, resolve_pairs


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


@dataclass(frozen=True)
class SmoothQuantSettings:
    """alpha: migration strength. weights: "rtn" (default) or "gptq" (with ``gptq`` options)."""

    alpha: float = 0.5
    weights: str = "rtn"
    gptq: GPTQOptions = GPTQOptions()


class SmoothQuantMethod:
    """SmoothQuant as a calibration-engine BlockMethod.

    Folds the scales into the block (norms and Linears change in place), then quantizes the
    planned Linears; each keeps its smoothed float weight (the engine contract).
    ``info``: per-layer ``sq_alpha``, ``sq_scale_max``/``min``, ``seconds``.
    """

    def __init__(self, settings: SmoothQuantSettings | None = None,
                 scale_dtype: torch.dtype = torch.float16):
        self.options = settings or SmoothQuantSettings()
        if self.options.weights not in ("rtn", "gptq"):
            raise ValueError(f"weights must be 'rtn' or 'gptq', not {self.options.weights!r}")
        self.scale_dtype = scale_dtype
        self.info: dict[str, dict] = {}

    def smooth_block(self, block: nn.Module, block_name: str, inputs: torch.Tensor,
                     kwargs: dict[str, Any], plan: dict[str, QuantScheme], arch: ArchSpec) -> None:
        """Find and fold the scales of every smoothing pair with a planned Linear."""
        rel = {n[len(block_name) + 1 :] for n in plan}
        pairs, skipped = resolve_pairs(block, arch)
        pairs = [p for p in pairs if any(n in rel for n in p.linear_names)]
        if not pairs:
            return
        stats = pair_stats(block, block_name, inputs, kwargs, pairs)
        for p, st in zip(pairs, stats):
            s = smoothquant_scales(st.absmax, weight_absmax(p.linears), self.options.alpha)
            fold_scales(p, s)
            for n in p.linear_names:
                if n in rel:
                    self.info.setdefault(f"{block_name}.{n}", {}).update(
                        {"sq_alpha": self.options.alpha, "sq_scale_max": float(s.max()),
                         "sq_scale_min": float(s.min())})
        if skipped:
            for n in plan:
                self.info.setdefault(n, {})["smoothing_skipped"] = skipped

    def process_block(
        self,
        block: nn.Module,
        block_name: str,
        inputs: torch.Tensor,
        kwargs: dict[str, Any],
        plan: dict[str, QuantScheme],
        arch: ArchSpec,
    ) -> dict[str, QuantResult]:
        self.info = {}
        t0 = time.perf_counter()
        self.smooth_block(block, block_name, inputs, kwargs, plan, arch)
        if self.options.weights == "gptq":
            from .block_methods import GPTQMethod

            gptq = GPTQMethod(self.options.gptq, self.scale_dtype)
            results = gptq.process_block(block, block_name, inputs, kwargs, plan, arch)
            for n, extra in gptq.info.items():
                self.info.setdefault(n, {}).update(extra)
        else:
            results = {
                n: rtn(block.get_submodule(n[len(block_name) + 1 :]).weight.detach(), s, self.scale_dtype)
                for n, s in plan.items()
            }
        for n in results:
            self.info.setdefault(n, {})["seconds"] = time.perf_counter() - t0
        return results


def method_from_recipe(recipe: Recipe) -> SmoothQuantMethod:
    """SmoothQuant with ``recipe.smoothquant.alpha``; weights by RTN."""
    return SmoothQuantMethod(SmoothQuantSettings(alpha=recipe.smoothquant.alpha))


__all__ = ["SmoothQuantMethod", "SmoothQuantSettings", "method_from_recipe", "smoothquant_scales",
           "weight_absmax"]
