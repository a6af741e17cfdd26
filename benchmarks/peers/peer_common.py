"""What every peer runner shares (imported in each tool's own venv: torch only)."""

import math

import torch


def perplexity(model, windows: torch.Tensor, extra=None) -> float:
    """exp(mean next-token NLL) over the eval windows [w, L], each scored on its L - 1 tokens;
    ``extra()``: more forward arguments for each window (e.g. a fresh KV cache)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w[None], **(extra() if extra else {})).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += w.numel() - 1
    return math.exp(nll / count)
