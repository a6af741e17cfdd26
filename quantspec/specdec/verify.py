"""Verification of draft tokens against the target: pure functions, no model, no state.

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"
(arXiv:2211.17192). For one sequence with drafts ``x_1..x_k``, draft distributions
``q_1..q_k`` and the target's distributions ``p_1..p_{k+1}`` (``p_i`` computed on the prefix
that ends just before ``x_i``):

* greedy: accept while ``x_i == argmax p_i``; then append ``argmax p_{n+1}`` (the correction,
  or a bonus token when all k were accepted). The result is exactly the target's own greedy
  output.
* sampling: accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
  rejection sample the replacement from ``norm(max(0, p_i - q_i))``; when all k are accepted
  sample a bonus token from ``p_{k+1}``. Each emitted token is distributed exactly as the
  target's.

Shapes: B sequences, k draft positions, V vocabulary. ``lengths`` [B] (optional) says how many
of the k drafts of each row are real (a proposer may have fewer than k for some rows); the
positions past it count as rejected and the next token then comes from ``p`` itself.
A deterministic proposer has ``q`` one-hot: pass ``draft_probs=None``.

Trees (``tree.TokenTree``, one row; ``target_*`` [n + 1, V]: row 0 the target's distribution
after the pending token, row i + 1 after node i, from one ``Decoder.forward_tree``):

* greedy: from the root, descend to the child whose token is the target's argmax while there is
  one; then append the argmax at the last node reached. Exactly the target's greedy output.
* sampling (recursive rejection sampling: SpecInfer; Jeon et al. 2024, arXiv:2402.14160, for
  siblings drawn without replacement): at node v with residual law p (first p_v), try v's
  children c_1, c_2, ... in order. Child c_i came from q_i: the parent's q with the siblings
  already tried removed and renormalized (without replacement), or one-hot on c_i for
  deterministic children (``probs`` None). Accept c_i with probability min(1, p(c_i) / q_i(c_i))
  and descend; else p <- norm(max(0, p - q_i)) (one-hot: p loses c_i). When every child is
  rejected, sample from p. Each try takes exactly p's mass of what it can emit, so the emitted
  token is distributed as p_v and, by induction down the path, the emitted text as the target's.
"""

from __future__ import annotations

import torch

from ..kernels.small_ops import argmax
from .sampling import sample
from .tree import TokenTree


def _valid(draft_tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """bool [B, k]: which draft positions are real."""
    b, k = draft_tokens.shape
    if lengths is None:
        return torch.ones(b, k, dtype=torch.bool, device=draft_tokens.device)
    pos = torch.arange(k, device=draft_tokens.device)
    return pos.unsqueeze(0) < lengths.to(draft_tokens.device).unsqueeze(1)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the number of leading True values of each row of a bool [B, k] mask."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    draft_tokens: int64 [B, k]. target_logits: [B, k + 1, V]. lengths: int64 [B] or None.
    Returns ``(n_accepted [B] int64, next_token [B] int64)``: the target's argmax after the
    accepted prefix.
    """
    return verify_greedy_tokens(draft_tokens, argmax(target_logits), lengths)


def verify_greedy_tokens(
    draft_tokens: torch.Tensor,
    best: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_greedy`` from the target's argmax tokens ``best`` (int64 [B, k + 1]) instead of
    its logits (``runtime.protocol.Decoder.forward_argmax``)."""
    k = draft_tokens.shape[1]
    match = (draft_tokens == best[:, :k]) & _valid(draft_tokens, lengths)
    n = _leading_true(match)
    nxt = best.gather(1, n.unsqueeze(1)).squeeze(1)
    return n, nxt


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    lengths: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification.

    draft_tokens: int64 [B, k]. draft_probs: fp32 [B, k, V] (the q each draft was sampled
    from) or None for a deterministic proposer (q one-hot). target_probs: fp32 [B, k + 1, V]
    after the same temperature/top-k/top-p as the draft. Randomness only from ``generator``.
    Returns ``(n_accepted [B], next_token [B])``.
    """
    b, k = draft_tokens.shape
    idx = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, idx).squeeze(-1)
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device, dtype=torch.float32)
    accept = (u * q_x < p_x) & _valid(draft_tokens, lengths)  # u < p/q, q > 0 for drafted x
    n = _leading_true(accept)
    rows = torch.arange(b, device=draft_tokens.device)
    p_next = target_probs[rows, n]  # [B, V]
    rejected = n < (k if lengths is None else lengths.to(n.device))
    if bool(rejected.any()):
        n_clamped = n.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q_next = torch.zeros_like(p_next)
            q_next[rows, draft_tokens[rows, n_clamped]] = 1.0
        else:
            q_next = draft_probs[rows, n_clamped]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # mass 0 happens only when p == q up to rounding: then p itself is the right law.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected.unsqueeze(1), residual, p_next)
    return n, sample(p_next, generator)


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification of one tree: ``(path, next_token)``, the accepted nodes from the
    root down (indices into the tree) and the target's argmax after the last of them.
    target_logits: [n + 1, V] (see the module docstring)."""
    return verify_tree_greedy_tokens(tree, argmax(target_logits).tolist())


def verify_tree_greedy_tokens(tree: TokenTree, best: list[int]) -> tuple[list[int], int]:
    """``verify_tree_greedy`` from the target's argmax token after the pending token and after
    each node (``best``, n + 1 of them) instead of its logits."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    path, node = [], -1
    while True:
        want = best[node + 1]
        node = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if node is None:
            return path, want
        path.append(node)


def verify_tree_sampling(
    tree: TokenTree,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Recursive rejection sampling of one tree: ``(path, next_token)`` as the greedy one.

    target_probs: fp32 [n + 1, V] after the same temperature/top-k/top-p as the draft's q.
    ``tree.probs`` [n, V]: each node's q (siblings drawn without replacement, in order), or None
    for deterministic children. Randomness only from ``generator``."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    path, node = [], -1
    while True:
        p, tried, nxt = target_probs[node + 1].float(), [], None
        for c in kids[node + 1]:
            x = tokens[c]
            if tree.probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = tree.probs[c].float().clone()
                q[tried] = 0.0
                q = q / q.sum().clamp(min=1e-30)
            u = torch.rand((), generator=generator, device=p.device, dtype=torch.float32)
            if u * q[x] < p[x]:
                nxt = c
                break
            residual = (p - q).clamp(min=0)
            mass = residual.sum()
            # mass 0 only when p == q up to rounding (then rejection had probability 0)
            p = residual / mass if mass > 0 else p
            tried.append(x)
        if nxt is None:
            return path, int(sample(p, generator))
        path.append(nxt)
        node = nxt
