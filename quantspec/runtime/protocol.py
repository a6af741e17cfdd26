"""``Decoder``: the one interface of quantspec's decoders, incremental forward passes of a causal LM
over a batch of B rows with a KV cache the decoder owns.

Implementations: ``runtime.decoder.StaticDecoder`` (the static-cache forward of a declared
family), ``runtime.kv.KVDecoder`` (transformers' forward with per-row rollback; speculative
decoding drafts and verifies through it or the static one) and ``runtime.kv.PlainDecoder``
(transformers' forward with nothing added, every row in step: the speed bench's baseline).
Callers (``specdec``, ``eval.speed``) hold a ``Decoder`` and use only what is declared here.

Token trees (speculative decoding's tree verification): ``forward_tree`` feeds nodes that each
attend to the committed cache and to their own ancestors only, at position committed length +
depth; ``keep_path`` keeps one root-to-node path of them as committed tokens and forgets the
rest, moving the kept columns next to the committed ones so the cache never grows by rejected
nodes. A tree is the layout of ``parents`` (int64 [n], topological order: node i's parent is -1,
the token before the tree, or a node j < i); ``tree_depths`` and ``ancestor_mask`` read it, and
``TreeRegion`` is the bookkeeping both implementations share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..kernels.small_ops import argmax


class Decoder(ABC):
    """Incremental forward passes over a batch of rows.

    ``lengths[b]``: the tokens row b holds in the cache (empty before the first ``forward``).
    """

    lengths: list[int]

    @property
    def columns(self) -> int:
        """Cache columns in use (committed tokens, the holes between them, a held tree's nodes);
        a forward writes only at or past them. The default: rows without holes."""
        return max(self.lengths, default=0)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the model's weights and the cache are."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every row; the next ``forward`` starts a new batch."""

    @abstractmethod
    def forward(self, chunks: list[torch.Tensor], keep: int = 0) -> torch.Tensor:
        """Feed ``chunks[b]`` (int64 [T_b]) to row b after what it holds; returns logits
        [B, T, V], T = max T_b, row b's in its last T_b positions (``keep`` > 0: the last
        ``keep`` positions only). A batch of another size than the cache holds starts afresh."""

    def forward_features(self, chunks: list[torch.Tensor], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the features they were computed from: the final-normed
        hidden states [B, T, H] the LM head reads, for the same positions (feature-level drafts
        such as EAGLE heads draft from them). Decoders that cannot expose them raise."""
        raise NotImplementedError(f"{type(self).__name__} does not expose the target's features")

    def forward_argmax(self, chunks: list[torch.Tensor], keep: int = 0, features: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The argmax of ``forward``'s logits (int64 [B, T] laid out as they are; the first
        maximum, a NaN as torch.argmax orders it), and with ``features`` the features of
        ``forward_features`` (else None): all that greedy decoding reads of the logits, which a
        decoder may get without computing every one (``StaticDecoder``: ``kernels.output_head``).
        """
        if features:
            logits, feats = self.forward_features(chunks, keep)
            return argmax(logits), feats
        return argmax(self.forward(chunks, keep)), None

    def step(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Every row takes the T tokens of its row of ``ids`` (int64 [B, T]): the logits of
        ``forward(list(ids), keep)``, which this is unless overridden (``PlainDecoder`` hands
        ``ids`` to the model whole)."""
        return self.forward(list(ids), keep)

    @abstractmethod
    def drop_last(self, counts: list[int]) -> None:
        """Forget the last ``counts[b]`` tokens of each row (rejected drafts)."""

    def forward_tree(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]) -> torch.Tensor:
        """Feed row b the tree nodes ``chunks[b]`` (int64 [T_b]) with ``parents[b]`` (int64
        [T_b]): node indices in the row's tree since the last ``keep_path`` (the nodes of earlier
        ``forward_tree`` calls first, then this chunk's, in order), -1 for a child of the last
        committed token. Each node sees the committed tokens and its ancestors, at position
        ``lengths[b]`` + its depth (0 for a child of -1). Returns logits [B, T, V] laid out as
        ``forward``'s. ``lengths`` does not count tree nodes; until ``keep_path``, ``forward``
        and ``drop_last`` refuse to run."""
        raise NotImplementedError(f"{type(self).__name__} does not run token trees")

    def forward_tree_features(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_tree``'s logits and features (see ``forward_features``)."""
        raise NotImplementedError(f"{type(self).__name__} does not run token trees")

    def forward_tree_argmax(self, chunks: list[torch.Tensor], parents: list[torch.Tensor],
                            features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_argmax`` for ``forward_tree`` (and ``forward_tree_features``)."""
        if features:
            logits, feats = self.forward_tree_features(chunks, parents)
            return argmax(logits), feats
        return argmax(self.forward_tree(chunks, parents)), None

    def copy_prefix_from(self, other: "Decoder", start: int = 0) -> str | None:
        """Hold what ``other`` holds: its rows' committed tokens, their keys and values copied
        from ``other``'s cache instead of computed (a draft over a quantized copy of ``other``'s
        model skips its own prefill). ``start`` > 0: keep this decoder's first ``start`` columns
        (the caller knows they hold the same tokens in the same columns) and copy the rest. None
        when done; else why not (one line, nothing changed). The default: this decoder copies
        no caches."""
        return f"{type(self).__name__} does not copy caches"

    def tree_columns(self) -> int | None:
        """The most cache columns (committed ones and a tree's nodes) a token tree may reach,
        known before anything runs: a sliding window's length, None for no limit (the default)."""
        return None

    def tree_refusal(self) -> str | None:
        """Why this decoder cannot run token trees over its model at all (one line, known
        before anything runs), or None (the default: it can)."""
        return None

    def rows_alone(self) -> str | None:
        """Why the rows of a batch must be decoded one at a time over this decoder's model: its
        cache or positions cannot hold one row's dropped tokens as masked holes while another row
        goes on (one line, known before anything runs), or None (the default: rows share a batch)."""
        return None

    def keep_path(self, paths: list[Sequence[int]]) -> None:
        """End the tree: row b keeps the nodes ``paths[b]`` (a chain from a child of -1 down,
        possibly empty) as committed tokens, moved to the columns right after its committed
        ones; every other node is forgotten. No tree held: every path must be empty."""
        raise NotImplementedError(f"{type(self).__name__} does not run token trees")


def tree_depths(parents: Sequence[int] | torch.Tensor) -> list[int]:
    """Each node's depth (0: a child of -1) from ``parents`` in topological order; a ValueError
    when a parent does not come before its child."""
    depths: list[int] = []
    for i, p in enumerate(int(p) for p in parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not -1 or an earlier node")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ancestor_mask(parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """bool [n, n]: row i is True at j iff j is i or an ancestor of i (what node i attends to
    among the tree's nodes)."""
    tree_depths(parents)  # validates the order
    par = [int(p) for p in parents]
    mask = torch.eye(len(par), dtype=torch.bool)
    for i, p in enumerate(par):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def kept_columns(tree: "TreeRegion | None", paths, device) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """What ``keep_path`` moves: None when no tree is held (a ValueError if a path is asked
    for), else (the first tree column ``start``, int64 [B, n] the kept path's columns per row
    padded with ``start``, bool [B, n] which of them are real), n the longest path."""
    if tree is None:
        if any(len(p) for p in paths):
            raise ValueError("no token tree is held")
        return None
    cols = tree.path_columns(paths)
    n = max(len(c) for c in cols)
    idx = torch.full((len(cols), n), tree.start, dtype=torch.int64, device=device)
    for b, c in enumerate(cols):
        idx[b, : len(c)] = torch.tensor(c, dtype=torch.int64)
    real = torch.arange(n, device=device).unsqueeze(0) < torch.tensor([len(c) for c in cols], device=device).unsqueeze(1)
    return tree.start, idx, real


class TreeRegion:
    """The tree nodes a decoder holds after its committed columns, per row of a batch.

    Cache columns ``[start, end)`` hold the nodes of every ``forward_tree`` since the last
    ``keep_path``, each call's row b right-aligned in its ``t`` columns (the columns before
    them are padding). Columns here are absolute cache columns.
    """

    def __init__(self, start: int, batch: int):
        self.start = self.end = start
        self.cols: list[list[int]] = [[] for _ in range(batch)]
        self.parents: list[list[int]] = [[] for _ in range(batch)]
        self.depths: list[list[int]] = [[] for _ in range(batch)]
        self._seen: list[list[list[int]]] = [[] for _ in range(batch)]  # columns each node sees

    def add(self, parents: list[torch.Tensor], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the nodes of one ``forward_tree`` (row b's ``parents[b]`` in the last
        len(parents[b]) of ``t`` new columns). Returns the depth of each new column (int64
        [B, t], 0 for padding) and which region columns each new column attends to (bool
        [B, t, end + t - start]; a padding column sees itself only)."""
        width = self.end + t - self.start
        depth = torch.zeros(len(parents), t, dtype=torch.int64)
        sees = torch.zeros(len(parents), t, width, dtype=torch.bool)
        for b, par in enumerate(parents):
            pad = t - len(par)
            for j in range(pad):
                sees[b, j, self.end - self.start + j] = True
            for j, p in enumerate(int(p) for p in par):
                node = len(self.parents[b])
                if not -1 <= p < node:
                    raise ValueError(f"row {b}: node {node}'s parent {p} is not -1 or an earlier node")
                col = self.end + pad + j
                seen = (self._seen[b][p] if p >= 0 else []) + [col - self.start]
                self.cols[b].append(col)
                self.parents[b].append(p)
                self.depths[b].append(0 if p < 0 else self.depths[b][p] + 1)
                self._seen[b].append(seen)
                sees[b, pad + j, seen] = True
                depth[b, pad + j] = self.depths[b][-1]
        self.end += t
        return depth, sees

    def path_columns(self, paths: list[Sequence[int]]) -> list[list[int]]:
        """The cache columns of each row's kept path, checked to be a chain from a child of -1."""
        if len(paths) != len(self.cols):
            raise ValueError(f"{len(paths)} paths for a batch of {len(self.cols)} rows")
        out = []
        for b, path in enumerate(paths):
            prev = -1
            for node in (int(n) for n in path):
                if not 0 <= node < len(self.parents[b]) or self.parents[b][node] != prev:
                    raise ValueError(f"row {b}: {list(path)} is not a path from the tree's top")
                prev = node
            out.append([self.cols[b][int(n)] for n in path])
        return out
