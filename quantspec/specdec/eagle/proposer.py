"""``EagleProposer``: chain drafts from an EAGLE head over the target's own features.

State per row (rows are independent; a batch is a loop over them, the head being small):
the head's keys and values for the pairs ``(f_t, x_{t+1})`` it has read, t = 0..n-1, where
``f_t`` are the target's real features handed over by ``observe`` and ``x`` the committed
tokens; the features not yet read; and the head's output at its last real position (the
prediction of the next feature, from which the first draft comes).

``propose`` reads every pending feature with its next committed token (one head forward),
drafts the first token from the last output, then feeds each draft with the head's own
predicted feature for the next k - 1 drafts. ``accept`` drops those draft positions again: the
accepted drafts come back with the target's real features through ``observe``.

Token trees (``propose_tree``, EAGLE-2's dynamic trees or static shapes, ``tree.py``): the head
expands a level of nodes per forward, each node attending to the real positions and its own
ancestors; ``accept_tree`` drops them all, as ``accept`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from ...core.scheme import QuantScheme
from ...errors import QuantspecError
from ...kernels.small_ops import argmax
from ..proposers import Proposal, Proposer, TreeProposal
from ..sampling import SamplingConfig, probs_from_logits, sample
from ..selfdraft import DRAFT_HEAD
from ..tree import TokenTree, TreeSpec, grow_tree
from .draft_weights import quantize_head
from .head import EagleHead, load_head


class _Row:
    def __init__(self):
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None
        self.read = 0  # features read into ``past`` (pairs (f_t, x_{t+1}), t < read)
        self.pending: list[torch.Tensor] = []  # features [n, H] handed over, not read yet
        self.last: torch.Tensor | None = None  # head output [H] at position read - 1
        self.drafted = 0  # draft positions appended to ``past`` after ``read``
        self.node_out: list[torch.Tensor] = []  # tree growth: the head's output at each fed node
        self.node_anc: list[set[int]] = []  # ... and its fed ancestors (itself included)


class EagleProposer(Proposer):
    """Drafts with ``head`` from the target's features; ``embed`` is the target's input
    embedding (the head reads the embeddings of the tokens the target committed)."""

    needs_features = True
    grows_trees = True

    def __init__(self, head: EagleHead, embed: nn.Module, name: str = "eagle", report: dict | None = None):
        self.head = head.eval()
        self.embed = embed
        self.name = name
        self.report = report
        self.rows: list[_Row] = []

    def reset(self) -> None:
        self.rows = []

    def observe(self, features: list[torch.Tensor]) -> None:
        if len(self.rows) != len(features):
            self.rows = [_Row() for _ in features]
        for row, f in zip(self.rows, features):
            if f.numel():
                row.pending.append(f)

    def _step(self, row: _Row, feats: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (feats[i], tokens[i]) at positions start.. ; returns the head's outputs [n, H]."""
        dtype = self.head.lm_head.dtype
        emb = self.embed(tokens.unsqueeze(0)).to(dtype)
        pos = torch.arange(start, start + tokens.numel(), device=tokens.device).unsqueeze(0)
        out, row.past = self.head(feats.to(dtype).unsqueeze(0), emb, pos, row.past)
        return out[0]

    def _catch_up(self, row: _Row, seq: torch.Tensor) -> None:
        if not row.pending:
            return
        feats = torch.cat(row.pending)
        row.pending = []
        n = feats.shape[0]
        tokens = seq[row.read + 1: row.read + 1 + n]
        if tokens.numel() != n:
            raise RuntimeError(f"EAGLE head got {row.read + n} features for {seq.numel()} committed tokens")
        out = self._step(row, feats, tokens, row.read)
        row.read += n
        row.last = out[-1]

    def _choose(self, feat: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[int, torch.Tensor | None]:
        """A draft token (target id) from the head's output [H], and q over the target's
        vocabulary (None when greedy)."""
        if sampling.greedy:
            return int(self.head.token_ids[int(argmax(self.head.logits(feat.unsqueeze(0)))[0])]), None
        q = probs_from_logits(self._full_logits(feat.unsqueeze(0)), sampling)[0]
        return int(sample(q.unsqueeze(0), generator)[0]), q

    @torch.inference_mode()
    def propose(self, sequences, k, sampling, generator=None) -> Proposal:
        if len(self.rows) != len(sequences):
            self.rows = [_Row() for _ in sequences]
        device = sequences[0].device
        tokens = torch.zeros(len(sequences), k, dtype=torch.int64, device=device)
        probs = None if sampling.greedy else torch.zeros(len(sequences), k, self.head.config.vocab_size,
                                                          dtype=torch.float32, device=device)
        lengths = torch.zeros(len(sequences), dtype=torch.int64, device=device)
        calls = 0
        for b, (row, seq) in enumerate(zip(self.rows, sequences)):
            self._catch_up(row, seq)
            if row.last is None:  # no feature yet (a one-token prompt): nothing to draft from
                continue
            calls += 1
            feat = row.last
            for i in range(k):
                tok, q = self._choose(feat, sampling, generator)
                tokens[b, i] = tok
                if q is not None:
                    probs[b, i] = q
                if i + 1 < k:
                    feat = self._step(row, feat.unsqueeze(0), torch.tensor([tok], device=device),
                                      row.read + i)[-1]
            row.drafted = k - 1
            lengths[b] = k
        return Proposal(tokens=tokens, probs=probs, lengths=lengths, model_calls=calls * k)

    def accept(self, n_accepted: list[int]) -> None:
        """Drop every draft position: the accepted drafts come back with the target's real
        features through ``observe``."""
        for row in self.rows:
            if row.drafted and row.past is not None:
                keep = row.past[0].shape[2] - row.drafted
                row.past = (row.past[0][:, :, :keep], row.past[1][:, :, :keep])
            row.drafted = 0
            row.node_out, row.node_anc = [], []

    def accept_tree(self, paths: list[list[int]]) -> None:
        self.accept([len(p) for p in paths])

    @torch.inference_mode()
    def teacher_forced_logits(self, sequence: torch.Tensor, n: int,
                              features: torch.Tensor | None = None) -> torch.Tensor:
        """The head reads the pairs (f_t, x_{t+1}) of the target's features and the tokens; its
        output at t predicts token t + 2, so token p's logits come from output p - 2 (n <= L - 2)."""
        if features is None:
            raise ValueError("an EAGLE head's teacher forcing reads the target's features")
        length = int(sequence.numel())
        if not 0 < n <= length - 2:
            raise ValueError(f"teacher forcing of {n} tokens needs at least 2 tokens before them, got {length}")
        self.reset()
        row = _Row()
        out = self._step(row, features[: length - 2], sequence[1: length - 1], 0)
        return self._full_logits(out[length - 2 - n:])

    def _full_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """[n, H] -> logits [n, V] over the target's vocabulary (-inf outside the draft's)."""
        out = torch.full((feats.shape[0], self.head.config.vocab_size), float("-inf"), dtype=torch.float32,
                         device=feats.device)
        out[:, self.head.token_ids] = self.head.logits(feats).to(torch.float32)
        return out

    def _expand_row(self, row: _Row, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed tree nodes (``tree.Expand``'s contract for one row): node i reads its parent's
        output (the last real output for a child of the root) and its own token, at position
        ``read + depth - 1``, attending to the real positions and its fed ancestors. Returns the
        draft's logits [m, V] of each."""
        m = int(tokens.numel())
        if m == 0:
            return torch.zeros(0, self.head.config.vocab_size, device=tokens.device)
        first = len(row.node_out)
        par = [int(p) for p in parents]
        feats = torch.stack([row.last if p < 0 else row.node_out[p] for p in par])
        depth = [1 if p < 0 else len(row.node_anc[p]) + 1 for p in par]
        anc = [({first + i} | (row.node_anc[p] if p >= 0 else set())) for i, p in enumerate(par)]
        held = row.past[0].shape[2]
        mask = torch.zeros(m, held + m, dtype=torch.bool, device=tokens.device)
        mask[:, :row.read] = True
        for i, a in enumerate(anc):
            for j in a:
                mask[i, row.read + j] = True
        dtype = self.head.lm_head.dtype
        emb = self.embed(tokens.unsqueeze(0)).to(dtype)
        pos = torch.tensor([row.read + d - 1 for d in depth], device=tokens.device).unsqueeze(0)
        out, row.past = self.head(feats.to(dtype).unsqueeze(0), emb, pos, row.past, mask=mask)
        row.node_out += list(out[0])
        row.node_anc += anc
        row.drafted += m
        return self._full_logits(out[0])

    @torch.inference_mode()
    def propose_tree(self, sequences, spec: TreeSpec, sampling, generator=None) -> TreeProposal:
        """Each row's tree grown from the head (EAGLE-2): one head forward per level over the
        level's nodes with a tree mask; rows without a feature yet propose an empty tree."""
        if len(self.rows) != len(sequences):
            self.rows = [_Row() for _ in sequences]
        self.accept([0] * len(self.rows))  # nothing of an earlier proposal stays
        for row, seq in zip(self.rows, sequences):
            self._catch_up(row, seq)
        live = [b for b, row in enumerate(self.rows) if row.last is not None]
        device = sequences[0].device
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        trees = [TokenTree(empty, empty)] * len(sequences)
        if not live:
            return TreeProposal(trees=trees, model_calls=0)
        root = self._full_logits(torch.stack([self.rows[b].last for b in live]))

        def expand(tokens, parents):
            outs = [self._expand_row(self.rows[b], t, p) for b, t, p in zip(live, tokens, parents)]
            width = max(o.shape[0] for o in outs)
            logits = torch.full((len(outs), width, self.head.config.vocab_size), float("-inf"), device=device)
            for i, o in enumerate(outs):
                if o.shape[0]:
                    logits[i, width - o.shape[0]:] = o
            return logits

        grown = grow_tree(spec, root, expand, sampling, generator)
        for b, t in zip(live, grown.trees):
            trees[b] = t
        return TreeProposal(trees=trees, model_calls=len(live) * (1 + grown.calls))


def eagle_proposer(folder: str, target: nn.Module, weights: QuantScheme | None = DRAFT_HEAD) -> EagleProposer:
    """The ``eagle:FOLDER`` draft of ``target``: the head's widths and vocabulary must be the
    target's (a head trained for another model is refused). ``weights``: the scheme its layer and
    LM-head rows run in (``draft_weights.quantize_head``; default 8 bits per channel), None: as
    trained. The proposer's ``report`` says what each of them runs in."""
    param = next(target.parameters())
    dtype = param.dtype if param.dtype != torch.bfloat16 or not param.is_cpu else torch.float32
    head = load_head(folder, dtype=dtype, device=param.device)
    embed = target.get_input_embeddings()
    vocab, hidden = embed.weight.shape
    c = head.config
    if (c.vocab_size, c.hidden_size) != (int(vocab), int(hidden)):
        raise QuantspecError(
            f"EAGLE head {folder} was trained for a target with vocabulary {c.vocab_size} and width "
            f"{c.hidden_size}; this target has {int(vocab)} and {int(hidden)}.",
            "train a head for this target with `quantspec train-draft`.")
    report = {"weights": quantize_head(head, weights) if weights is not None else "dense"}
    return EagleProposer(head, embed, name=f"eagle:{folder}", report=report)
