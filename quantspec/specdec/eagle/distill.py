"""Self-distilled training text: what the target itself writes after a prompt.

A head drafts for the target's own continuations, so it learns best from them (Medusa-2 and
EAGLE train on the target's outputs for this reason). ``self_distilled_windows`` turns the first
``prompt_tokens`` tokens of each text window into a prompt (a user turn of the chat template
when the tokenizer has one, as ``generate --chat`` and ``bench-specdec`` send prompts) and lets
the target continue it greedily to ``seqlen`` tokens, in batches through quantspec's decoder.
The continuation is not stopped at an end-of-turn token: what the target writes after it is
its text too, and every window keeps the same length.
"""

from __future__ import annotations

import torch

from ...kernels.small_ops import argmax
from ...runtime.decoder import fast_decoder


def chat_prompt(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """int64 [P']: ``ids`` as a user turn of the chat template (``ids`` as they are without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(chat, return_tensors="pt", add_special_tokens=False).input_ids[0]


@torch.inference_mode()
def continue_greedily(model: torch.nn.Module, prompts: list[torch.Tensor], length: int) -> torch.Tensor:
    """Each prompt continued by the target's greedy choice to ``length`` tokens: int64 [B, length]
    (prompts longer than ``length`` are cut to it)."""
    device = next(model.parameters()).device
    rows = [p[:length].to(device) for p in prompts]
    steps = length - min(int(r.numel()) for r in rows)
    if steps == 0:
        return torch.stack(rows).cpu()
    decoder = fast_decoder(model)
    logits = decoder.forward(rows, keep=1)[:, -1]
    out = [list(r.tolist()) for r in rows]
    for i in range(steps):
        nxt = argmax(logits)
        for b, tok in enumerate(nxt.tolist()):
            out[b].append(tok)
        if i + 1 < steps:
            logits = decoder.step(nxt.unsqueeze(1), keep=1)[:, -1]
    return torch.tensor([row[:length] for row in out], dtype=torch.int64)


def self_distilled_windows(model: torch.nn.Module, tokenizer, windows: torch.Tensor, prompt_tokens: int,
                           batch_size: int = 16, progress: bool = True) -> torch.Tensor:
    """int64 [n, L]: for each window [L], its first ``prompt_tokens`` tokens as a (chat) prompt
    and the target's greedy continuation to L tokens."""
    from tqdm.auto import tqdm

    n, length = windows.shape
    prompts = [chat_prompt(tokenizer, w[:prompt_tokens]) for w in windows]
    out = []
    with tqdm(total=n, desc="target writes", unit="win", disable=not progress) as bar:
        for i in range(0, n, batch_size):
            out.append(continue_greedily(model, prompts[i:i + batch_size], length))
            bar.update(out[-1].shape[0])
    return torch.cat(out)
