"""AWQ's scale search (Lin et al. 2023, arXiv 2306.00978): candidate per-channel scales and
the search that picks one under a loss. Pure tensor functions.

Candidates: ``s = 1`` (plain RTN) first, the paper's ``s = x_mean^alpha`` for ``alpha = i /
grid``, and the "duo" scales of AutoAWQ and llm-compressor ``s = x_mean^alpha /
w_mean^(1-alpha)`` (``weight_group_mean``); each normalised by ``sqrt(max(s) * min(s))``.
RTN is a candidate, so the chosen scale never does worse than RTN on the loss's sample.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...core.scheme import QuantScheme
from .clip import grouped


def scale_from_alpha(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """AWQ's candidate scale for exponent ``alpha``: [K] -> [K], geometric mean of max/min 1.

    ``x_mean^alpha``; with ``w_mean`` (``weight_group_mean``, "duo scaling" as AutoAWQ and
    llm-compressor do by default) ``x_mean^alpha / w_mean^(1 - alpha)``: channels whose weights
    are small within their groups get larger scales too.
    """
    s = x_mean.to(torch.float32).pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.to(torch.float32).pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_group_mean(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Mean over the output rows of ``weights`` ([N_i, K] each) of |w| / (max |w| of its
    quantization group): [K], how large each input channel's weights are on their grids."""
    total, rows = None, 0
    for w in weights:
        k = w.shape[1]
        g = grouped(w.detach(), scheme).abs()
        g = g / (g.amax(dim=2, keepdim=True) + 1e-6)
        part = g.reshape(w.shape[0], -1)[:, :k].sum(dim=0)
        total = part if total is None else total + part
        rows += w.shape[0]
    return total / rows



def _coarse_to_fine(n: int) -> list[int]:
    """0 first (the identity, evaluated in full), then 1..n-1 halving the stride: the middle,
    the quarters, ... so that spread-out candidates come before their neighbours."""
    order, seen = [0], {0}
    stride = 1 << max(n - 1, 1).bit_length()
    while stride >= 1:
        for i in range(1 + stride // 2 if stride > 1 else 1, n, stride):
            if i not in seen:
                order.append(i)
                seen.add(i)
        stride //= 2
    return order + [i for i in range(n) if i not in seen]


def search_scale(
    x_mean: torch.Tensor,
    loss: Callable[[torch.Tensor], float],
    grid: int = 20,
    w_mean: torch.Tensor | None = None,
    plain: bool = True,
    bounded: bool = False,
) -> tuple[torch.Tensor, dict]:
    """Best candidate scale under ``loss(s)``; returns (s, info).

    ``bounded``: ``loss(s, bound)`` gets the best loss so far and may stop early, returning any
    value above ``bound``, once its result is known to exceed it (a sum of non-negative terms
    already past the bound): the same choice as the full search, in less time.

    Candidates: all ones (plain RTN) first; with ``plain``, the paper's
    ``scale_from_alpha(x_mean, i / grid)`` for 0 < i < grid; with ``w_mean`` (duo scaling),
    ``scale_from_alpha(x_mean, a, w_mean)`` for ``grid`` exponents ``a`` evenly spaced over
    [0, 1]. ``info``: the chosen ``alpha`` (None for the identity), whether it is a ``duo``
    scale, its loss and the identity's (``loss_rtn``).
    """
    ones = torch.ones_like(x_mean, dtype=torch.float32)
    cands: list[tuple[float | None, bool, torch.Tensor]] = [(None, False, ones)]
    if plain:
        cands += [(i / grid, False, scale_from_alpha(x_mean, i / grid)) for i in range(1, grid)]
    if w_mean is not None:
        steps = max(grid - 1, 1)
        cands += [(i / steps, True, scale_from_alpha(x_mean, i / steps, w_mean)) for i in range(grid)]
    if bounded:  # coarse to fine, so that a good bound is found early; the choice is the same
        losses, best = [float("nan")] * len(cands), float("inf")
        for i in _coarse_to_fine(len(cands)):
            losses[i] = loss(cands[i][2], best)
            if losses[i] < best:  # False for NaN
                best = losses[i]
    else:
        losses = [loss(s) for *_, s in cands]
    finite = [i for i, v in enumerate(losses) if v == v]  # NaN != NaN
    if not finite:  # every loss was NaN: keep the identity
        return ones, {"alpha": None, "duo": False, "loss": float("nan"), "loss_rtn": float("nan")}
    best = min(finite, key=lambda i: losses[i])
    alpha, duo, s = cands[best]
    return s, {"alpha": alpha, "duo": duo, "loss": losses[best], "loss_rtn": losses[0]}

