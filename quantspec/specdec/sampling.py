"""Sampling settings shared by the draft and the target.

Speculative sampling preserves the target's distribution only when the draft's proposal
distribution ``q`` and the target's ``p`` are both computed from logits by the *same*
transformation, so both go through :func:`probs_from_logits` (temperature, then top-k, then
top-p, the order of Hugging Face's logits processors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import QuantspecError


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax; top_k and top_p are then unused).

    top_k: keep the k most likely tokens (0 = all). top_p: keep the smallest set of most likely
    tokens whose probability reaches top_p (1.0 = all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN fails both
            raise QuantspecError(
                f"temperature={self.temperature} is not a finite value >= 0.", "use 0 (greedy) or a positive value."
            )
        if self.top_k < 0:
            raise QuantspecError(f"top_k={self.top_k} is negative.", "use 0 (off) or a positive count.")
        if not 0.0 < self.top_p <= 1.0:
            raise QuantspecError(f"top_p={self.top_p} is outside (0, 1].", "use a value in (0, 1].")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def probs_from_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k and top-p.

    Greedy settings give the one-hot distribution of the argmax.
    """
    logits = logits.to(torch.float32)
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop_sorted = before >= sampling.top_p  # the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per distribution: probs [..., V] -> int64 [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])
