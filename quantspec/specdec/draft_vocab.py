"""A draft's output head over part of the vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's d2t).

A draft is read once per draft token, and a small model's output head is a large share of what it
reads: Qwen2.5-0.5B's 151936 x 896 head is 136 MB at 8 bits beside its 4-bit body's ~185 MB. A
draft that scores only the tokens it is likely to propose reads less. ``PrunedHead`` scores a
fixed set (the most frequent tokens of local prose and code, ``frequent_tokens``) plus the tokens
of the text being continued (its prompt and what was committed since: a rare word of the prompt
is likely to come back). Every other token gets logit -inf: the draft never proposes it, which
costs acceptance, never correctness (the target verifies every draft; rejection sampling stays
exact with a draft distribution that is zero there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import QuantspecError

# The default --draft-vocab, chosen on the validation prompts (docs/decisions/draft-vocab.md): on
# Qwen2.5-Coder-0.5B (151936 tokens) its W4 self-draft kept 4.18 of 4.19 tokens per call and ran
# 2.29x / 2.50x the target at k = 4 / 6 against the whole head's 2.10x / 2.27x; 16384 and 32768
# lost more acceptance. SmolLM2-135M (49152 tokens) is below it: pruned, it gained nothing there.
DEFAULT_DRAFT_VOCAB = 65536

# Prose and code, equally weighted: the bundled C4 calibration documents and the interpreter's
# standard library (both available offline, with no download).
FREQUENCY_SOURCES = ("c4-bundled", "python-stdlib")


def frequent_tokens(streams: Sequence[torch.Tensor], size: int, vocab: int,
                    always: Sequence[int] = ()) -> torch.Tensor:
    """int64 [min(size, vocab)], ascending: the ids of ``always`` and the most frequent tokens of
    ``streams`` (int64 tensors of token ids; each stream's frequencies weigh equally, ties go to
    the lower id)."""
    score = torch.zeros(vocab, dtype=torch.float64)
    for s in streams:
        s = s.reshape(-1)
        if s.numel():
            score += torch.bincount(s, minlength=vocab)[:vocab].to(torch.float64) / s.numel()
    if always:
        score[torch.as_tensor(list(always), dtype=torch.int64)] = float("inf")
    order = torch.sort(score, descending=True, stable=True).indices  # stable: lower id first on ties
    return order[: min(size, vocab)].sort().values


def corpus_frequent_tokens(tokenizer, size: int, vocab: int, always: Sequence[int] = ()) -> torch.Tensor:
    """``frequent_tokens`` over ``FREQUENCY_SOURCES`` as ``tokenizer`` splits them (token ids
    cached on disk after the first call, ``data.tokens.cached_token_ids``)."""
    from ..data.sources import load_text
    from ..data.tokens import cached_token_ids

    streams = [cached_token_ids(tokenizer, load_text(name)) for name in FREQUENCY_SOURCES]
    return frequent_tokens(streams, size, vocab, always)


class PrunedHead(nn.Module):
    """``logits = head(x)`` over the full vocabulary, computed for some tokens only.

    inner: a Linear (dense or quantized) with one output per id of ``token_ids``. source: the
    full dense head (an nn.Linear [V, H], typically the target's own), whose rows are copied for
    the tokens ``add_tokens`` brings in; ``reset_tokens`` drops them again.
    """

    def __init__(self, inner: nn.Module, token_ids: torch.Tensor, vocab: int,
                 source: nn.Linear | None = None):
        super().__init__()
        from ..kernels.dense import fast_linear

        token_ids = token_ids.to(torch.int64).reshape(-1)
        if token_ids.numel() == 0 or int(token_ids.max()) >= vocab or int(token_ids.min()) < 0:
            raise ValueError(f"token ids must be a non-empty subset of range({vocab})")
        self.inner = inner
        self._call = fast_linear(inner)
        self.register_buffer("token_ids", token_ids, persistent=False)
        self.out_features = int(vocab)
        self.in_features = int(inner.in_features)
        # plain tensors, not parameters: the target's head must not become part of the draft
        self._source = None if source is None else (source.weight.detach(),
                                                    None if source.bias is None else source.bias.detach())
        self.reset_tokens()

    def reset_tokens(self) -> None:
        """Score ``token_ids`` only (forget what ``add_tokens`` brought in)."""
        self.scored = torch.zeros(self.out_features, dtype=torch.bool, device=self.token_ids.device)
        self.scored[self.token_ids] = True
        self.extra_ids = self.token_ids[:0]
        self.extra: nn.Linear | None = None

    def add_tokens(self, ids: torch.Tensor) -> int:
        """Also score the tokens of ``ids`` (any shape) from now on; returns how many were new.
        Needs ``source``; without it, nothing is added."""
        if self._source is None or ids.numel() == 0:
            return 0
        ids = ids.reshape(-1).to(self.scored.device)
        new = ids[~self.scored[ids]].unique()
        if new.numel() == 0:
            return 0
        self.scored[new] = True
        self.extra_ids = torch.cat([self.extra_ids, new])
        self.extra = _rows(*self._source, self.extra_ids).to(self.token_ids.device)
        return int(new.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self._call(x)
        out = part.new_full((*part.shape[:-1], self.out_features), float("-inf"))
        out.index_copy_(-1, self.token_ids, part)
        if self.extra is not None:
            out.index_copy_(-1, self.extra_ids, self.extra(x.to(self.extra.weight.dtype)).to(out.dtype))
        return out


def head_rows(head: nn.Module, token_ids: torch.Tensor) -> nn.Linear:
    """A dense nn.Linear holding the rows ``token_ids`` of the dense Linear ``head`` (copies)."""
    if type(head) is not nn.Linear:
        raise QuantspecError(f"the draft's output head is a {type(head).__name__}, not a dense Linear.",
                             "use a draft whose checkpoint keeps the output head dense, or drop --draft-vocab.")
    return _rows(head.weight.detach(), None if head.bias is None else head.bias.detach(), token_ids)


def _rows(weight: torch.Tensor, bias: torch.Tensor | None, token_ids: torch.Tensor) -> nn.Linear:
    idx = token_ids.to(weight.device)
    part = nn.Linear(weight.shape[1], idx.numel(), bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        part.weight.copy_(weight[idx])
        if bias is not None:
            part.bias.copy_(bias[idx])
    return part.requires_grad_(False)


def output_head(model: nn.Module) -> str:
    """The module name of ``model``'s output head, or QuantspecError when it declares none."""
    from ..quant.arch import head_name

    name = head_name(model)
    if name is None:
        raise QuantspecError("this draft declares no output head to prune.", "drop --draft-vocab.")
    return name


def prune_head(model: nn.Module, token_ids: torch.Tensor) -> None:
    """Replace ``model``'s dense output head by its rows ``token_ids`` (a dense nn.Linear, to be
    quantized, then wrapped by ``wrap_head``)."""
    name = output_head(model)
    model.set_submodule(name, head_rows(model.get_submodule(name), token_ids))


def wrap_head(model: nn.Module, token_ids: torch.Tensor, vocab: int, source: nn.Module | None) -> PrunedHead:
    """Wrap ``model``'s head (the rows ``token_ids``, after ``prune_head``) in a PrunedHead of
    ``vocab`` logits; ``source``: the full head, whose rows ``add_tokens`` reads when it is a
    dense nn.Linear (a quantized one adds nothing)."""
    name = output_head(model)
    source = source if type(source) is nn.Linear else None
    pruned = PrunedHead(model.get_submodule(name), token_ids, vocab, source=source)
    model.set_submodule(name, pruned)
    return pruned
