"""Token trees for speculative decoding: the candidates of one step as declared data, their
shapes, and how a draft grows them.

A step may draft a tree instead of a chain (SpecInfer, Miao et al. 2023, arXiv:2305.09781;
Medusa; EAGLE, Li et al. 2024, and EAGLE-2's dynamic trees, arXiv:2406.16858): continuations
share their prefixes, the target scores every node in one forward (each node attends to the
committed text and its own ancestors, ``Decoder.forward_tree``) and the longest path it accepts
is kept (``verify.verify_tree_greedy`` / ``verify_tree_sampling``).

``TokenTree`` (one row): ``tokens`` int64 [n]; ``parents`` int64 [n], -1 for a child of the
pending token (the last committed one, the root), else an earlier node (topological order:
parents before children, siblings in the order verification tries them); ``probs`` fp32 [n, V]
or None: the draft distribution q each node was sampled from, siblings without replacement in
order (their parent's q), or None for children chosen deterministically (the draft's top-k).
Example, root r: tokens [a, b, c], parents [-1, -1, 0] is r -> a -> c and r -> b.

Shapes (``TreeSpec``): *static*, a fixed set of index paths (Medusa/EAGLE "choices", child r
of a node = the r-th most likely token of its parent, or under sampling the r-th drawn without
replacement from the parent's q); *dynamic* (EAGLE-2), grown depth by depth: the ``top_k`` nodes
of highest cumulative draft log-probability in the last level are expanded, ``top_k`` children
each, and the ``total`` nodes of highest cumulative log-probability are kept.

``grow_tree`` builds either from the draft's logits at the root and an ``expand`` callable that
returns the draft's logits of a batch of nodes, so any draft (a draft model through its decoder,
a feature-level head) grows trees the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import QuantspecError
from ..runtime.protocol import ancestor_mask, tree_depths
from .sampling import SamplingConfig, probs_from_logits

TREE_KINDS = ("static", "dynamic")

Expand = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
"""``expand(tokens, parents)``: row b's new nodes ``tokens[b]`` (int64 [m_b], may be empty)
with ``parents[b]`` (int64 [m_b]: -1 for a child of the root, else the index of a node passed
in an earlier call of the same growth, counted in the order passed); returns the draft's logits
[B, M, V] of every new node, row b's in its last m_b positions (``Decoder.forward_tree``)."""


@dataclass
class TokenTree:
    """One row's tree (see the module docstring for the fields)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.shape != self.parents.shape:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} "
                             "must be two vectors of one length")
        if self.probs is not None and self.probs.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"probs {tuple(self.probs.shape)} needs one row per node")
        tree_depths(self.parents)  # parents before children

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def depths(self) -> list[int]:
        """Each node's draft position: 1 for a child of the root."""
        return [d + 1 for d in tree_depths(self.parents)]

    def depth(self) -> int:
        """The longest path's length in nodes (0 for an empty tree)."""
        return max(self.depths(), default=0)

    def ancestors(self) -> torch.Tensor:
        """bool [n, n]: node i sees node j iff j is i or an ancestor of i."""
        return ancestor_mask(self.parents)

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        par, out = self.parents.tolist(), []
        while node >= 0:
            out.append(node)
            node = par[node]
        return out[::-1]

    def children(self) -> list[list[int]]:
        """``children()[p + 1]``: the children of node p in order (``[0]``: the root's)."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out


@dataclass(frozen=True)
class TreeSpec:
    """How a proposer shapes its tree each step.

    kind: "static" or "dynamic". total: nodes of the tree. top_k: children per expanded node
    (dynamic: also the nodes expanded per level). depth: the longest path. choices: an explicit
    static shape (index paths such as ``((0,), (1,), (0, 0))``); total, top_k and depth are then
    read from it. A static spec without choices uses ``static_choices(total, top_k, depth)``.
    """

    kind: str = "dynamic"
    total: int = 16
    top_k: int = 4
    depth: int = 4
    choices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in TREE_KINDS:
            raise QuantspecError(f"tree kind {self.kind!r} is unknown.", f"use one of {', '.join(TREE_KINDS)}.")
        for name in ("total", "top_k", "depth"):
            if getattr(self, name) < 1:
                raise QuantspecError(f"tree {name}={getattr(self, name)} is below 1.",
                                     f"give the tree a {name} of 1 or more.")
        if self.choices is not None:
            choices = tuple(sorted({tuple(int(r) for r in c) for c in self.choices}, key=lambda c: (len(c), c)))
            _check_choices(choices)
            object.__setattr__(self, "choices", choices)
            object.__setattr__(self, "total", len(choices))
            object.__setattr__(self, "top_k", 1 + max(r for c in choices for r in c))
            object.__setattr__(self, "depth", max(len(c) for c in choices))

    def shape(self) -> tuple[tuple[int, ...], ...]:
        """A static tree's index paths, by depth then lexicographically (parents first)."""
        return self.choices if self.choices is not None else static_choices(self.total, self.top_k, self.depth)

    def limited(self, depth: int) -> TreeSpec:
        """The same spec with paths of at most ``depth`` nodes (``depth`` >= 1)."""
        if depth >= self.depth:
            return self
        if self.kind == "static":
            return TreeSpec("static", choices=tuple(c for c in self.shape() if len(c) <= depth))
        return TreeSpec(self.kind, self.total, self.top_k, depth)

    def max_nodes(self, depth: int | None = None) -> int:
        """The most nodes a tree of this spec holds with paths of at most ``depth`` (default: its
        own depth): a static shape's count; a dynamic tree's ``total``, or fewer where ``top_k``
        children per node cannot reach it in ``depth`` levels."""
        spec = self if depth is None else self.limited(depth)
        if spec.kind == "static":
            return len(spec.shape())
        return min(spec.total, sum(spec.top_k**d for d in range(1, spec.depth + 1)))

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "total": self.total, "top_k": self.top_k, "depth": self.depth}
        if self.kind == "static":
            out["choices"] = [list(c) for c in self.shape()]
        return out


def _check_choices(choices: tuple[tuple[int, ...], ...]) -> None:
    have = set(choices)
    if not choices or any(not c for c in choices):
        raise QuantspecError("a static tree needs non-empty index paths.", "give e.g. [[0], [1], [0, 0]].")
    for c in choices:
        if min(c) < 0:
            raise QuantspecError(f"tree path {list(c)} has a negative rank.", "ranks count from 0.")
        if len(c) > 1 and c[:-1] not in have:
            raise QuantspecError(f"tree path {list(c)} has no parent {list(c[:-1])}.",
                                 "list every prefix of every path.")


def static_choices(total: int, top_k: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """A static shape of ``total`` nodes: the paths of highest prior weight among ranks < top_k
    and lengths <= depth, a path weighing the product of 0.6 * 0.3**rank over its nodes (the
    most likely child is kept most often, so the tree is deep along rank 0 and bushy near the
    root). Closed under prefixes and lower sibling ranks; sorted by depth, then lexicographically."""
    weight = [0.6 * 0.3**r for r in range(top_k)]
    heap = [(-weight[r], (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < total:
        w, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r in range(top_k):
                heapq.heappush(heap, (w * weight[r], path + (r,)))
    return tuple(sorted(out, key=lambda c: (len(c), c)))


@dataclass
class GrownTrees:
    """What ``grow_tree`` returns: one tree per row; ``fed[b]`` int64 [n_b], the index of each
    node in the order ``expand`` received row b's nodes (-1: never passed, e.g. the leaves),
    which is how a stateful draft finds an accepted path in its own cache; ``calls``: expand
    calls made."""

    trees: list[TokenTree]
    fed: list[torch.Tensor]
    calls: int


class _Row:
    """The nodes of one row while it grows (lists, in creation order)."""

    def __init__(self):
        self.tok: list[int] = []
        self.par: list[int] = []
        self.score: list[float] = []
        self.depth: list[int] = []
        self.fed: list[int] = []
        self.q: list[torch.Tensor | None] = []
        self.key: list[tuple[int, ...]] = []
        self.n_fed = 0

    def add(self, tok: int, par: int, score: float, q: torch.Tensor | None, key: tuple[int, ...] = ()) -> int:
        self.tok.append(tok)
        self.par.append(par)
        self.score.append(score)
        self.depth.append(1 if par < 0 else self.depth[par] + 1)
        self.fed.append(-1)
        self.q.append(q)
        self.key.append(key)
        return len(self.tok) - 1

    def tree(self, keep: list[int], device) -> tuple[TokenTree, torch.Tensor]:
        """The tree of the nodes ``keep`` (ancestor-closed, any order), by depth then creation."""
        keep = sorted(keep, key=lambda i: (self.depth[i], i))
        new = {old: i for i, old in enumerate(keep)}
        tokens = torch.tensor([self.tok[i] for i in keep], dtype=torch.int64, device=device)
        parents = torch.tensor([new[self.par[i]] if self.par[i] >= 0 else -1 for i in keep],
                               dtype=torch.int64, device=device)
        qs = [self.q[i] for i in keep]
        probs = torch.stack(qs) if keep and qs[0] is not None else None
        fed = torch.tensor([self.fed[i] for i in keep], dtype=torch.int64)
        return TokenTree(tokens, parents, probs), fed


def _children(logits: torch.Tensor, m: int, sampling: SamplingConfig, sampled: bool,
              generator: torch.Generator | None) -> tuple[list[int], list[float], torch.Tensor | None]:
    """Up to ``m`` children of a node whose draft logits are ``logits`` [V]: tokens, their draft
    log-probabilities, and q (fp32 [V]) when drawn from it without replacement (``sampled``,
    Gumbel top-k: the order of sequential draws) instead of taken as the top m."""
    if sampling.greedy:
        logq = torch.log_softmax(logits.float(), dim=-1)
        q = None
    else:
        q = probs_from_logits(logits, sampling)
        logq = q.log()
        m = min(m, int((q > 0).sum()))
    keys = logq
    if sampled and q is not None:
        u = torch.rand(logq.shape, generator=generator, device=logq.device).clamp_(min=1e-20)
        keys = logq - torch.log(-torch.log(u))
    top = torch.topk(keys, m).indices
    return top.tolist(), logq[top].tolist(), q if sampled else None


def _feed(rows: list[_Row], nodes: list[list[int]], expand: Expand, device) -> list[torch.Tensor]:
    """Pass each row's ``nodes`` to ``expand``; returns their logits, row b's [m_b, V]."""
    tokens = [torch.tensor([r.tok[i] for i in ns], dtype=torch.int64, device=device) for r, ns in zip(rows, nodes)]
    parents = [torch.tensor([r.fed[r.par[i]] if r.par[i] >= 0 else -1 for i in ns], dtype=torch.int64,
                            device=device) for r, ns in zip(rows, nodes)]
    logits = expand(tokens, parents)
    out = []
    for b, (r, ns) in enumerate(zip(rows, nodes)):
        for i in ns:
            r.fed[i] = r.n_fed
            r.n_fed += 1
        out.append(logits[b, logits.shape[1] - len(ns):])
    return out


def grow_tree(spec: TreeSpec, root_logits: torch.Tensor, expand: Expand, sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> GrownTrees:
    """One tree per row of ``root_logits`` [B, V] (the draft's logits after each row's pending
    token), shaped by ``spec``; the draft's logits of deeper nodes come from ``expand``, one call
    per level (depth - 1 calls at most). Static trees under sampling draw children without
    replacement and carry their q; every other tree's children are deterministic (probs None)."""
    rows = [_Row() for _ in range(root_logits.shape[0])]
    grow = _grow_static if spec.kind == "static" else _grow_dynamic
    calls, keep = grow(spec, rows, root_logits, expand, sampling, generator)
    built = [r.tree(k, root_logits.device) for r, k in zip(rows, keep)]
    return GrownTrees([t for t, _ in built], [f for _, f in built], calls)


def _grow_static(spec, rows, root_logits, expand, sampling, generator):
    shape = spec.shape()
    need: dict[tuple[int, ...], int] = {}  # parent path -> children it needs
    for c in shape:
        need[c[:-1]] = max(need.get(c[:-1], 0), c[-1] + 1)
    sampled = not sampling.greedy
    found = [{(): (-1, root_logits[b])} for b in range(len(rows))]  # path -> (node, its logits)
    calls = 0
    for d in range(1, spec.depth + 1):
        for b, r in enumerate(rows):
            kids: dict[tuple[int, ...], tuple] = {}
            for c in (c for c in shape if len(c) == d):
                if c[:-1] not in found[b]:
                    continue
                if c[:-1] not in kids:
                    node, logits = found[b][c[:-1]]
                    kids[c[:-1]] = _children(logits, need[c[:-1]], sampling, sampled, generator)
                toks, logq, q = kids[c[:-1]]
                if c[-1] < len(toks):
                    node = r.add(toks[c[-1]], found[b][c[:-1]][0], logq[c[-1]], q, c)
                    found[b][c] = (node, None)
        nodes = [[i for i, k in enumerate(r.key) if len(k) == d and k in need] for r in rows]
        if d < spec.depth and any(nodes):
            for b, (r, logits) in enumerate(zip(rows, _feed(rows, nodes, expand, root_logits.device))):
                for i, lg in zip(nodes[b], logits):
                    found[b][r.key[i]] = (i, lg)
            calls += 1
    return calls, [list(range(len(r.tok))) for r in rows]


def _grow_dynamic(spec, rows, root_logits, expand, sampling, generator):
    level = []
    for b, r in enumerate(rows):
        toks, logq, _ = _children(root_logits[b], spec.top_k, sampling, False, generator)
        level.append([r.add(t, -1, s, None) for t, s in zip(toks, logq)])
    calls = 0
    for _ in range(1, spec.depth):
        beams = [sorted(ns, key=lambda i, r=r: (-r.score[i], i))[: spec.top_k] for r, ns in zip(rows, level)]
        if not any(beams):
            break
        logits = _feed(rows, beams, expand, root_logits.device)
        calls += 1
        level = []
        for r, ns, lgs in zip(rows, beams, logits):
            new = []
            for i, lg in zip(ns, lgs):
                toks, logq, _ = _children(lg, spec.top_k, sampling, False, generator)
                new += [r.add(t, i, r.score[i] + s, None) for t, s in zip(toks, logq)]
            level.append(new)
    # a child never outscores its parent and comes after it: the best ``total`` keep their ancestors
    keep = [sorted(range(len(r.tok)), key=lambda i, r=r: (-r.score[i], i))[: spec.total] for r in rows]
    return calls, keep
