"""Proposers: where the k candidate tokens of each speculative step come from.

The interface (``Proposer``) is small:

* ``propose(sequences, k, sampling, generator) -> Proposal``: ``sequences[b]`` is row b's
  whole committed text so far (prompt + accepted tokens, int64 [L_b], no padding).
* ``accept(n_accepted)``: how many of the last proposal's drafts each row kept; a stateful
  proposer crops its own state (KV cache) to that prefix.
* ``reset()``: forget everything (a new batch).
* ``observe(features)``: the target's features of newly committed tokens, for proposers that
  declare ``needs_features`` (feature-level drafts, ``specdec/eagle``).
* ``adopt_prompt(target, sequences)``: the target's decoder right after the prompt's prefill;
  a draft over a quantized copy of the target (``shares_cache``) copies its cache from there
  instead of prefilling. ``adopt_accepted(target, sequences)``: the same after each step, for
  the keys and values of the tokens that step committed.
* ``propose_tree(sequences, spec, sampling, generator) -> TreeProposal`` and
  ``accept_tree(paths)``: the same for token trees (``tree.py``); proposers that cannot grow
  trees refuse by default.

``DraftModel`` runs any causal LM that shares the target's tokenizer with its own KV cache
(trees through its decoder's ``forward_tree``, the accepted path kept by ``keep_path``);
``NGram`` is prompt lookup (no model). ``QuantizedSelf`` (selfdraft.py) is a DraftModel over
the target quantized by this library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantspecError
from ..runtime.decoder import fast_decoder
from ..runtime.protocol import Decoder
from .draft_vocab import PrunedHead
from .sampling import SamplingConfig, probs_from_logits, sample
from .tree import TokenTree, TreeSpec, grow_tree


@dataclass
class Proposal:
    """tokens: int64 [B, k'] (k' <= k). probs: fp32 [B, k', V], the distribution q each draft
    was sampled from, or None for a deterministic proposer (q one-hot) and for greedy drafts.
    lengths: int64 [B], how many of the k' drafts of each row are real (None: all).
    model_calls: forward passes of a draft model spent on this proposal.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    model_calls: int = 0


@dataclass
class TreeProposal:
    """trees: one ``TokenTree`` per row (its ``probs``: the q each node was drawn from, or None
    for deterministic children). model_calls: forward passes of a draft model spent on them."""

    trees: list[TokenTree]
    model_calls: int = 0


class Proposer:
    """The base of every proposer: ``propose`` is required; the hooks have no-op defaults.

    ``needs_features``: the proposer drafts from the target's features (the final-normed hidden
    states its LM head reads, e.g. an EAGLE head); the loop then verifies through
    ``Decoder.forward_features`` and hands each row's new ones to ``observe``.
    """

    name: str = "proposer"
    needs_features: bool = False
    grows_trees: bool = False  # propose_tree is implemented (draft models, EAGLE heads)
    report: dict | None = None  # how the draft was built (quantized layers, vocabulary), for the JSON results

    def propose(
        self,
        sequences: list[torch.Tensor],
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        raise NotImplementedError

    def accept(self, n_accepted: list[int]) -> None:
        """Each row kept the first ``n_accepted[b]`` drafts of the last proposal."""

    def propose_tree(
        self,
        sequences: list[torch.Tensor],
        spec: TreeSpec,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> TreeProposal:
        """A tree of candidates per row, shaped by ``spec``, after each row's committed text."""
        raise QuantspecError(f"the {self.name} draft does not grow token trees.",
                             "drop --tree (chains work with every draft), or use a draft model.")

    def accept_tree(self, paths: list[list[int]]) -> None:
        """Each row kept the nodes ``paths[b]`` (from the root's child down) of its last tree."""

    def tree_refusal(self) -> str | None:
        """Why this draft cannot grow token trees (one line, known before anything runs), or None."""
        return None if self.grows_trees else f"the {self.name} draft does not grow token trees"

    def observe(self, features: list[torch.Tensor]) -> None:
        """The target's features [n_b, H] of row b's committed tokens not handed over before,
        in order: after the prompt's prefill (every prompt token but the last) and after each
        verification (the pending token and the accepted drafts). Only if ``needs_features``."""

    def reset(self) -> None:
        """Forget everything (a new batch)."""

    def adopt_prompt(self, target: Decoder, sequences: list[torch.Tensor]) -> bool:
        """``target`` has just prefilled every row of ``sequences`` but its last token (a new
        batch): a draft that can take the target's cache instead of prefilling does so here.
        Returns whether it did (the default: no)."""
        return False

    def adopt_accepted(self, target: Decoder, sequences: list[torch.Tensor]) -> bool:
        """After each step, both caches cropped to the accepted tokens (``accept``): ``target``
        holds every committed token of ``sequences`` but the last; a draft that took the prompt's
        cache (``adopt_prompt``) replaces its keys and values of this step's tokens by the target's.
        Returns whether it did (the default: no)."""
        return False

    def teacher_forced_logits(self, sequence: torch.Tensor, n: int,
                              features: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher forcing (``specdec.agreement``): the draft's first-draft logits [n, V] for
        each of the last n tokens of ``sequence`` (int64 [L]) given only the tokens before it;
        ``features``: the target's features [L, H] of ``sequence`` (when ``needs_features``).
        Forgets any state before and after."""
        raise QuantspecError(f"the {self.name} draft has no logits to agree with the target.",
                             "measure agreement with a draft model, self: or eagle: draft.")


class DraftModel(Proposer):
    """A smaller causal LM as the draft, with its own KV cache (never recomputed).

    Invariant between calls: the cache holds a prefix of each row's committed text (never
    its last token) plus, right after ``propose``, the drafts it fed; ``accept`` drops the
    rejected ones. Compatibility with the target is checked by ``make_proposer``
    (``check_same_vocab``), not here.

    pruned: the model's output head when it scores part of the vocabulary
    (``draft_vocab.PrunedHead``); the committed text's tokens are added to it as they come.
    """

    grows_trees = True

    def __init__(self, model: torch.nn.Module, name: str = "draft", pruned: PrunedHead | None = None,
                 shares_cache: bool = False):
        """shares_cache: the model is a quantized copy of the target (same blocks, same keys
        and values up to rounding), so the draft starts from the target's cache of the prompt
        (``adopt_prompt``) and takes its keys and values of each step's committed tokens
        (``adopt_accepted``): no prefill of its own, and the keys and values of everything
        committed exact."""
        self.model = model.eval()
        self.name = name
        self.pruned = pruned
        self.shares_cache = shares_cache
        self._decoder = fast_decoder(self.model)
        self._fed_drafts = 0
        self._fed_nodes: list[torch.Tensor] | None = None  # per row, each tree node's index in the cache's tree
        self._shared: int | None = None  # leading columns that hold the target's cache (None: not sharing)

    def reset(self) -> None:
        self._decoder.reset()
        self._fed_drafts = 0
        self._fed_nodes: list[torch.Tensor] | None = None
        self._shared = None
        if self.pruned is not None:
            self.pruned.reset_tokens()

    def adopt_prompt(self, target: Decoder, sequences: list[torch.Tensor]) -> bool:
        self._shared = None
        if not self.shares_cache or self._decoder.copy_prefix_from(target) is not None:
            return False  # the draft prefills the prompt itself on its first propose
        self._fed_drafts = 0
        self._fed_nodes = None
        self._shared = self._decoder.columns
        if self.pruned is not None:
            self.pruned.reset_tokens()
            self.pruned.add_tokens(torch.cat([s[:-1] for s in sequences]))
        return True

    def adopt_accepted(self, target: Decoder, sequences: list[torch.Tensor]) -> bool:
        """The draft's cache holds the columns before ``_shared`` as the target's and its own
        keys and values of the pending token and the accepted drafts after them: those become
        the target's (the draft then conditions on exact keys and values of everything
        committed). Both decoders write only at or past their ``columns``, so the columns before
        the fewest either had since the last copy are still equal (``_cropped``). A refusal
        ends the sharing for the batch. The only committed tokens this adds that the draft never
        fed are accepted drafts, which its pruned head proposed, so it scores them already."""
        if self._shared is None:
            return False
        why = self._decoder.copy_prefix_from(target, start=min(self._shared, target.columns))
        self._shared = None if why else self._decoder.columns
        return why is None

    def _cropped(self) -> None:
        """After the draft's cache dropped columns: they and any written later are its own."""
        if self._shared is not None:
            self._shared = min(self._shared, self._decoder.columns)

    def _catch_up(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each row's committed tokens that the cache does not hold yet (at least one)."""
        dec = self._decoder
        if len(dec.lengths) != len(sequences):  # a new batch: the cache, and the tokens it brought in
            dec.reset()
            self._shared = None
            if self.pruned is not None:
                self.pruned.reset_tokens()
            chunks = list(sequences)
        else:
            excess = [max(0, held - (len(s) - 1)) for held, s in zip(dec.lengths, sequences)]
            if any(excess):
                dec.drop_last(excess)  # a done row's: the target holds tokens past its stop
                self._cropped()
            chunks = [s[held:] for held, s in zip(dec.lengths, sequences)]
        if self.pruned is not None:
            self.pruned.add_tokens(torch.cat(chunks))
        return chunks

    @torch.inference_mode()
    def propose(self, sequences, k, sampling, generator=None) -> Proposal:
        chunks = self._catch_up(sequences)
        tokens, probs = [], []
        for i in range(k):
            if i:
                chunks = list(tokens[-1].unsqueeze(1))
            if sampling.greedy:  # the argmax only (a dense fp32 head: screened, output_head)
                tokens.append(self._decoder.forward_argmax(chunks, keep=1)[0][:, -1])
            else:
                q = probs_from_logits(self._decoder.forward(chunks, keep=1)[:, -1], sampling)
                probs.append(q)
                tokens.append(sample(q, generator))
        self._fed_drafts = k - 1
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            probs=torch.stack(probs, dim=1) if probs else None,
            model_calls=k,
        )

    @torch.inference_mode()
    def propose_tree(self, sequences, spec, sampling, generator=None) -> TreeProposal:
        """Grows each row's tree through the draft's own decoder: the catch-up forward gives the
        root's logits, then one ``forward_tree`` per level (the nodes of the last level are never
        fed). The fed nodes stay in the cache until ``accept_tree`` keeps the accepted ones."""
        dec = self._decoder
        root = dec.forward(self._catch_up(sequences), keep=1)[:, -1]
        grown = grow_tree(spec, root, dec.forward_tree, sampling, generator)
        self._fed_nodes = grown.fed
        return TreeProposal(trees=grown.trees, model_calls=1 + grown.calls)

    def accept_tree(self, paths: list[list[int]]) -> None:
        if self._fed_nodes is None:
            return
        fed = [f.tolist() for f in self._fed_nodes]
        # an unfed node has no fed descendants: the fed part of a path is a prefix of it
        self._decoder.keep_path([[fed[b][n] for n in path if fed[b][n] >= 0] for b, path in enumerate(paths)])
        self._cropped()
        self._fed_nodes = None

    def tree_refusal(self) -> str | None:
        why = self._decoder.tree_refusal()
        return f"the draft {self.name}: {why}" if why else None

    @torch.inference_mode()
    def teacher_forced_logits(self, sequence: torch.Tensor, n: int,
                              features: torch.Tensor | None = None) -> torch.Tensor:
        """One forward through the runtime it drafts with (n < L); a pruned head also scores the
        tokens before the last n (in the loop it would score those committed before each)."""
        self.reset()
        try:
            if self.pruned is not None:
                self.pruned.add_tokens(sequence[: len(sequence) - n])
            return self._decoder.forward([sequence[:-1].to(self._decoder.device)], keep=n)[0]
        finally:
            self.reset()

    def accept(self, n_accepted: list[int]) -> None:
        if not self._fed_drafts:  # nothing fed since the last call (e.g. a step with k = 0)
            return
        kept = [min(n, self._fed_drafts) for n in n_accepted]
        self._decoder.drop_last([self._fed_drafts - n for n in kept])
        self._cropped()
        self._fed_drafts = 0


class NGram(Proposer):
    """Prompt lookup decoding: find the most recent earlier occurrence of the last n tokens
    (n from max_n down to min_n) in the row's own text and propose the tokens that followed it.

    Deterministic (q one-hot). Rows without a match propose nothing (length 0), and the step
    is then a plain target step for them.
    """

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """The k tokens that followed the most recent match of seq's suffix (int64 [k]), or none."""
        length = int(seq.numel())
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every n-gram that is not the suffix itself
            hits = (windows == seq[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                follow = seq[start:]
                # A continuation shorter than k overlaps the suffix: keep copying it (LZ77
                # style), which is what repeating the matched text would produce.
                return follow[torch.arange(k, device=seq.device) % follow.numel()]
        return seq[:0]

    def propose(self, sequences, k, sampling, generator=None) -> Proposal:
        found = [self.lookup(s, k) for s in sequences]
        width = max(int(f.numel()) for f in found)
        device = sequences[0].device
        tokens = torch.zeros(len(found), width, dtype=torch.int64, device=device)
        for b, f in enumerate(found):
            tokens[b, : f.numel()] = f
        lengths = torch.tensor([int(f.numel()) for f in found], dtype=torch.int64, device=device)
        return Proposal(tokens=tokens, probs=None, lengths=lengths, model_calls=0)
