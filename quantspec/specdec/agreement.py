"""Teacher-forced greedy agreement of a draft with its target.

The target generates greedily from each prompt (``generate(do_sample=False)``); the draft then
reads that same token sequence (teacher forcing: it never sees its own tokens) and each new
position counts as a match when the draft's argmax equals the target's next token. The rate is
matches / positions over all prompts. It bounds what a greedy draft can give (a draft of k
tokens is accepted up to its first miss) and, unlike the acceptance rate, depends neither on k
nor on timing: it is deterministic for a given machine's numerics.
"""

from __future__ import annotations

import torch

from ..kernels.small_ops import argmax
from .bench import encode
from .proposers import Proposer


def teacher_forced_matches(draft: Proposer, sequence: torch.Tensor, prompt_len: int,
                           target: torch.nn.Module | None = None) -> list[bool]:
    """sequence: int64 [L], a prompt of ``prompt_len`` tokens and the target's continuation.
    Returns, for each continuation token, whether the draft's argmax given all tokens before it
    equals it (L - prompt_len entries). A draft that reads the target's features (an EAGLE head)
    gets them from ``target``'s forward over ``sequence``; it needs a prompt of 2 tokens or more."""
    n = int(sequence.numel()) - prompt_len
    if n <= 0:
        return []
    features = None
    if draft.needs_features:
        out = target(input_ids=sequence.unsqueeze(0), output_hidden_states=True)
        features = out.hidden_states[-1][0]  # final-normed: what the LM head reads
    logits = draft.teacher_forced_logits(sequence, n, features)
    return (argmax(logits).cpu() == sequence[prompt_len:].cpu()).tolist()


@torch.inference_mode()
def greedy_agreement(target: torch.nn.Module, draft: Proposer, tokenizer, prompts: list[dict],
                     max_new_tokens: int = 128, chat: bool = True) -> dict:
    """Teacher-forced agreement on ``prompts`` (rows ``{"id", "prompt"}``): the overall rate,
    its counts, and per prompt {id, positions, matches, first_miss} (first_miss: the index of
    the first new token the draft misses, None when it misses none)."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for row in prompts:
        ids = encode(tokenizer, row["prompt"], chat).to(device)
        seq = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=pad)[0]
        hits = teacher_forced_matches(draft, seq, ids.shape[1], target)
        rows.append({"id": row.get("id"), "positions": len(hits), "matches": sum(hits),
                     "first_miss": hits.index(False) if False in hits else None})
    positions = sum(r["positions"] for r in rows)
    matches = sum(r["matches"] for r in rows)
    return {"agreement": round(matches / positions, 4) if positions else None,
            "positions": positions, "matches": matches, "max_new_tokens": max_new_tokens,
            "prompts": rows}
