"""Self-distilled training text: what the target itself writes after a prompt.

A head drafts for the target's own continuations, so it learns best from them (Medusa-2 and
EAGLE train on the target's outputs for this reason). ``self_distilled_windows`` lets the target
continue each prompt greedily to ``seqlen`` tokens, in batches through quantspec's decoder. The
prompts are user turns of the chat template when the tokenizer has one (as ``generate --chat``
and ``bench-specdec`` send prompts): requests (``prompts.py``; ``request_prompts``) or the first
``prompt_tokens`` tokens of each text window (``window_prompts``).
A reply ends at the target's first stop (end-of-turn) token: what it would write after one is
not what it drafts for. Every window keeps its length; the tokens after the stop are filler, and
``lengths`` says where each window's text ends (training scores only the positions before it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...kernels.small_ops import argmax
from ...runtime.decoder import fast_decoder


def chat_prompt(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """int64 [P']: ``ids`` as a user turn of the chat template (``ids`` as they are without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return ids
    return request_prompts(tokenizer, [tokenizer.decode(ids, skip_special_tokens=True)])[0]


@torch.inference_mode()
def continue_greedily(model: torch.nn.Module, prompts: list[torch.Tensor], length: int,
                      stops: frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt continued by the target's greedy choice to ``length`` tokens (prompts longer
    than ``length`` are cut to it): (int64 [B, length], int64 [B] lengths). A row's length counts
    its prompt and its continuation up to and including its first token of ``stops`` (``length``
    without one); once every row has stopped, generation ends and the rest is that stop token."""
    device = next(model.parameters()).device
    rows = [p[:length].to(device) for p in prompts]
    out = [list(r.tolist()) for r in rows]
    ends = [length if r.numel() == length else 0 for r in rows]
    steps = length - min(int(r.numel()) for r in rows)
    if steps:
        decoder = fast_decoder(model)
        logits = decoder.forward(rows, keep=1)[:, -1]
    for i in range(steps):
        nxt = argmax(logits)
        for b, tok in enumerate(nxt.tolist()):
            out[b].append(tok)
            if not ends[b] and (tok in stops or len(out[b]) >= length):
                ends[b] = len(out[b])
        if all(ends):
            break
        logits = decoder.step(nxt.unsqueeze(1), keep=1)[:, -1]
    windows = [row[:e] + [row[e - 1]] * (length - e) for row, e in zip(out, ends)]
    return torch.tensor(windows, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64)


def window_prompts(tokenizer, windows: torch.Tensor, prompt_tokens: int) -> list[torch.Tensor]:
    """The first ``prompt_tokens`` tokens of each window [L] as a (chat) prompt."""
    return [chat_prompt(tokenizer, w[:prompt_tokens]) for w in windows]


def request_prompts(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Each request as a user turn of the chat template (as ``bench-specdec`` sends prompts)."""
    from ..bench import encode

    return [encode(tokenizer, t, chat=True)[0] for t in texts]


def self_distilled_windows(model: torch.nn.Module, prompts: list[torch.Tensor], length: int,
                           batch_size: int = 64, progress: bool = True,
                           folder: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [n, length], int64 [n] lengths): each prompt (int64 [P]) and the target's greedy
    reply, to its end-of-turn token (``continue_greedily`` with the target's stop tokens).

    ``folder``: each batch is written there (``distilled-NNNNN.safetensors``, NNNNN its first
    prompt's index, atomically) and a batch already there is read back, so a stopped run continues
    where it stopped (a file holding another number of rows, from another batch size, is written
    again). ``batch_size``: rows decoded together (each step reads the weights once for all of
    them, so larger batches write more tokens per second on a CPU).
    """
    from safetensors.torch import load_file
    from tqdm.auto import tqdm

    from ...checkpoint.atomic import atomic_save_file
    from ..loop import stop_ids

    stops = frozenset(stop_ids(model))
    windows, lengths = [], []
    with tqdm(total=len(prompts), desc="target writes", unit="win", disable=not progress) as bar:
        for i in range(0, len(prompts), batch_size):
            rows = len(prompts[i:i + batch_size])
            path = None if folder is None else Path(folder) / f"distilled-{i:05d}.safetensors"
            held = load_file(str(path)) if path is not None and path.is_file() else None
            if held is not None and held["windows"].shape == (rows, length):
                w, n = held["windows"], held["lengths"]
            else:
                w, n = continue_greedily(model, prompts[i:i + batch_size], length, stops)
                if path is not None:
                    atomic_save_file({"windows": w.contiguous(), "lengths": n.contiguous()}, path)
            windows.append(w)
            lengths.append(n)
            bar.update(w.shape[0])
    return torch.cat(windows), torch.cat(lengths)
