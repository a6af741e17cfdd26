"""The speculative generation loop: propose, verify with one target call, crop, repeat.

Per step and row b: the target's KV cache holds the committed text except its last token
(the *pending* token). One target forward over ``[pending, d_1..d_k]`` gives the k + 1
distributions verification needs; row b keeps ``n_b`` drafts plus one target token, and the
cache drops the ``k - n_b`` rejected drafts (so the new target token becomes the pending one).
Rows accept different counts: the cache stays rectangular with masked holes (see kv.py), so
batch > 1 gives each row exactly what it would get alone; a model whose cache cannot hold holes
(``Decoder.rows_alone``: sliding windows, recurrent layers, no position ids) decodes each row
alone. Finished rows (EOS or max_new_tokens) stop growing and their step is dropped whole.

With ``tree`` the proposer drafts a token tree per row instead (``tree.py``); one target
``forward_tree`` over ``[pending, nodes...]`` scores every node, the tree verification keeps
the longest accepted path plus one target token, and both caches keep only that path
(``keep_path``), so rejected nodes never stay in either cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import QuantspecError
from ..kernels.dense import few_row_linears
from ..runtime.decoder import fast_decoder
from ..runtime.kv import KVDecoder
from .adaptive import AdaptiveK, FixedK
from .proposers import Proposal, Proposer
from .sampling import SamplingConfig, probs_from_logits
from .stats import SpecStats
from .tree import TokenTree, TreeSpec
from .verify import (
    verify_greedy_tokens,
    verify_sampling,
    verify_tree_greedy_tokens,
    verify_tree_sampling,
)


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real prompt tokens (padding removed, left or right)."""
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
    if attention_mask is None:
        rows = list(input_ids)
    else:
        rows = [ids[m.bool()] for ids, m in zip(input_ids, attention_mask)]
    if any(r.numel() == 0 for r in rows):
        raise QuantspecError("a prompt of the batch is empty.", "give every row at least one token.")
    return rows


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_ids(target, eos_token_id=None) -> set[int]:
    """The token ids that end a generation: ``eos_token_id``, or the target's generation config's."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    return set(_token_ids(eos_token_id))


def _pad_id(target, pad_token_id, stops: set[int]) -> int:
    if pad_token_id is None:
        pad_token_id = getattr(getattr(target, "generation_config", None), "pad_token_id", None)
    ids = _token_ids(pad_token_id)
    return ids[0] if ids else (min(stops) if stops else 0)


def fast_verify_default(target: torch.nn.Module) -> bool:
    """Verify through quantspec's runtime by default only for fp32 targets: in bf16 it left the
    target's own greedy output on 5 of 8 prompts at near-ties (Qwen2.5-Coder-0.5B, logit gaps
    <= 0.125; the runtime alone, k = 0, on the same 5), transformers' forward on 4
    (benchmarks/results/specdec-cpu.md)."""
    return next(target.parameters()).dtype == torch.float32


def speculative_generate(
    target: torch.nn.Module,
    proposer: Proposer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    k: int = 4,
    adaptive: bool = False,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | list[int] | None = None,
    seed: int | None = None,
    pad_token_id: int | None = None,
    k_max: int = 16,
    fast_verify: bool | None = None,
    tree: TreeSpec | str | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Generate with speculative decoding (Leviathan et al. 2023).

    input_ids: int64 [B, P] (or [P]), left-padded when rows differ, with ``attention_mask``.
    k: draft length (the start value when ``adaptive``; see adaptive.py for the rule, capped at
    ``k_max``). sampling: greedy by default, which returns exactly the target's own greedy
    output; otherwise rejection sampling keeps exactly the target's distribution.
    eos_token_id: None uses the target's generation_config. seed: seeds the generator of all
    sampling (draft and verification). Returns ``(ids [B, P + T], stats)`` like
    ``generate``: the input followed by the new tokens, rows that stop early padded with
    ``pad_token_id``.
    fast_verify: the target verifies through quantspec's runtime: the StaticDecoder for a
    declared family (``runtime.fast_decoder``; logits equal transformers' within fp32 rounding),
    and dense Linears through the few-row products of ``kernels.dense`` where this CPU has them
    (torch's CPU matmul costs 2-3x more for the k + 1 rows of a verification than for one).
    False: transformers' own forward and matmuls. None (default): on for fp32 targets; off for
    bf16/fp16 ones, whose greedy ties the runtime's fused ops (rounded once) break differently
    from transformers' more often (see ``fast_verify_default``).
    tree: draft token trees (``proposer.propose_tree``) instead of chains: a ``TreeSpec``, or
    "static" / "dynamic" for that kind's default shape with paths of up to ``k`` nodes. Greedy
    output and the sampled law stay exactly the target's; stats count each tree's nodes as
    proposed and its accepted path as accepted.
    """
    sampling = sampling or SamplingConfig()
    if k < 0 or (adaptive and k < 1):
        raise QuantspecError(f"draft length k={k} is invalid.", "use k >= 1 (k = 0 is plain decoding).")
    if isinstance(tree, str):
        tree = TreeSpec(tree, depth=k)
    if tree is not None and adaptive:
        raise QuantspecError("adaptive draft length applies to chains, not token trees.",
                             "drop --adaptive, or drop --tree.")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    prompts = _prompts(input_ids, attention_mask)
    device = next(target.parameters()).device
    stops = stop_ids(target, eos_token_id)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    control = AdaptiveK(k, k_max=max(k, k_max)) if adaptive else FixedK(k)
    stats = SpecStats()
    seqs = [p.to(device) for p in prompts]
    new: list[list[int]] = [[] for _ in seqs]
    done = [max_new_tokens <= 0] * len(seqs)
    if fast_verify is None:
        fast_verify = fast_verify_default(target)
    # built per call, the target's quantized layers unfused: its own forward stays as it was
    decoder = fast_decoder(target, fuse=False) if fast_verify else KVDecoder(target)
    if len(seqs) > 1 and decoder.rows_alone():  # each row alone: what it gets in a batch that can share
        outs, parts = [], []
        for row in prompts:
            out, part = speculative_generate(target, proposer, row, max_new_tokens=max_new_tokens, k=k,
                                             adaptive=adaptive, sampling=sampling, eos_token_id=eos_token_id,
                                             seed=seed, pad_token_id=pad_token_id, k_max=k_max,
                                             fast_verify=fast_verify, tree=tree)
            outs.append(out[0, row.numel():].tolist())
            parts.append(part)
        return _assemble(input_ids, outs, _pad_id(target, pad_token_id, stops)), SpecStats.merged(parts)
    # transformers' forward (an undeclared family) gets the few-row products by patching its
    # Linears for the call; the StaticDecoder routes its own through them
    fast = few_row_linears(target) if isinstance(decoder, KVDecoder) and fast_verify \
        else contextlib.nullcontext()
    if tree is not None:
        _check_tree_fits(decoder, max(s.numel() for s in seqs), max_new_tokens, tree)
        if why := proposer.tree_refusal():
            raise QuantspecError(f"{why}.", "use chains (drop --tree).")
    proposer.reset()
    start = time.perf_counter()
    feeds = proposer.needs_features
    with torch.inference_mode(), fast:
        if any(s.numel() > 1 for s in seqs):
            if feeds:  # every prompt position's features but the pending token's
                _, feats = decoder.forward_features([s[:-1] for s in seqs])
                proposer.observe([f[f.shape[0] - (s.numel() - 1):] for f, s in zip(feats, seqs)])
            else:
                decoder.forward([s[:-1] for s in seqs], keep=1)
            stats.cache_copies += proposer.adopt_prompt(decoder, seqs)
        while not all(done):
            room = max(max_new_tokens - len(new[b]) for b in range(len(seqs)) if not done[b]) - 1
            ctx = (decoder, proposer, seqs, done, sampling, generator, feeds, stats)
            step = _chain_step(*ctx, min(control.k, room)) if tree is None else _tree_step(*ctx, tree, room)
            active = [b for b in range(len(seqs)) if not done[b]]
            committed = [0] * len(seqs)
            for b in active:
                emitted = _until_stop(step.accepted[b] + [step.nxt[b]], stops, max_new_tokens - len(new[b]))
                new[b].extend(emitted)
                committed[b] = len(emitted)
                done[b] = emitted[-1] in stops or len(new[b]) >= max_new_tokens
                seqs[b] = torch.cat([seqs[b], torch.tensor(emitted, device=device)])
            step.settle()
            stats.cache_copies += proposer.adopt_accepted(decoder, seqs)
            if feeds:  # the features of the pending token and of every emitted token but the last
                proposer.observe([step.feats[b][: committed[b]] for b in range(len(seqs))])
            n_acc = [len(step.accepted[b]) for b in active]
            stats.record(n_acc, [step.nodes[b] for b in active], [step.offered[b] for b in active])
            control.update(n_acc, [step.offered[b] for b in active])
    stats.wall_s = time.perf_counter() - start
    stats.new_tokens = sum(len(t) for t in new)
    return _assemble(input_ids, new, _pad_id(target, pad_token_id, stops)), stats


def check_tree(target, prompt_len: int, max_new_tokens: int, tree: TreeSpec, fast_verify: bool | None = None) -> None:
    """``speculative_generate``'s refusal of a tree run on ``target``, before a draft is built
    (a self-draft's quantization, a draft model's load): the decoder it would verify through,
    without fusing, planning or screening anything."""
    if fast_verify is None:
        fast_verify = fast_verify_default(target)
    decoder = fast_decoder(target, fuse=False, plan=False, screen=False) if fast_verify else KVDecoder(target)
    _check_tree_fits(decoder, prompt_len, max_new_tokens, tree)


def _check_tree_fits(decoder, prompt_len: int, max_new_tokens: int, tree: TreeSpec) -> None:
    """Refuse, before anything runs, a tree run whose columns could pass the decoder's limit
    (``tree_columns``: a sliding window). A step with ``g`` tokens generated holds ``prompt_len
    + g - 1`` columns and feeds the pending token and a tree of paths up to ``room = max_new_tokens
    - g - 1`` nodes (``_tree_step``), so the run needs ``prompt_len + max_new_tokens - 1`` columns
    plus the most, over the rooms, of a tree's nodes beyond its room."""
    why = decoder.tree_refusal()
    if why:
        raise QuantspecError(f"{why}.", "use chains (drop --tree).")
    limit = decoder.tree_columns()
    if limit is None:
        return
    rooms = range(1, min(tree.depth, max_new_tokens - 1) + 1)
    need = prompt_len + max_new_tokens - 1 + max([tree.max_nodes(r) - r for r in rooms] + [0])
    if need > limit:
        raise QuantspecError(f"a token tree run of {prompt_len} prompt tokens, {max_new_tokens} new tokens and trees "
                             f"of up to {tree.max_nodes()} nodes reaches {need} positions, past this model's "
                             f"sliding window of {limit}, which token trees do not support.",
                             "use chains (drop --tree), or fewer new tokens or tree nodes.")


@dataclass
class _Step:
    """One target call's outcome per row (done rows: nothing accepted). accepted: the kept
    drafts' tokens; nxt: the target's token after them; offered: draft positions offered (a
    chain's length, a tree's depth); nodes: draft tokens offered; feats: the target's features
    [m, H] of the pending token and the accepted drafts, in order (feature-level proposers);
    settle: crops both caches to the accepted drafts."""

    accepted: list[list[int]]
    nxt: list[int]
    offered: list[int]
    nodes: list[int]
    feats: list[torch.Tensor] | None
    settle: Callable[[], None]


def _chain_step(decoder, proposer, seqs, done, sampling, generator, feeds, stats, kk) -> _Step:
    """Propose a chain of ``kk`` drafts per row, verify it in one target forward."""
    rows, device = len(seqs), seqs[0].device
    if kk > 0:
        t0 = time.perf_counter()
        prop = proposer.propose(seqs, kk, sampling, generator)
        stats.draft_s += time.perf_counter() - t0
        stats.draft_calls += prop.model_calls
    else:
        prop = Proposal(tokens=torch.zeros(rows, 0, dtype=torch.int64, device=device))
    width = prop.tokens.shape[1]
    offered = [width] * rows if prop.lengths is None else prop.lengths.tolist()
    chunks = [torch.cat([s[-1:], d.to(device)]) for s, d in zip(seqs, prop.tokens)]
    t0 = time.perf_counter()
    feats = None
    if sampling.greedy:  # the argmax is all greedy verification reads of the logits
        best, feats = decoder.forward_argmax(chunks, keep=width + 1, features=feeds)
    elif feeds:
        logits, feats = decoder.forward_features(chunks, keep=width + 1)
    else:
        logits = decoder.forward(chunks, keep=width + 1)
    stats.target_s += time.perf_counter() - t0
    stats.target_calls += 1
    stats.k_used.append(width)
    if sampling.greedy:
        n_acc, nxt = verify_greedy_tokens(prop.tokens, best, prop.lengths)
    else:
        n_acc, nxt = verify_sampling(prop.tokens, prop.probs, probs_from_logits(logits, sampling),
                                     prop.lengths, generator)
    n_acc, nxt = n_acc.tolist(), nxt.tolist()
    kept = [0 if done[b] else n_acc[b] for b in range(rows)]
    drops = [width + 1 if done[b] else width - n_acc[b] for b in range(rows)]

    def settle() -> None:
        decoder.drop_last(drops)
        proposer.accept(kept)

    return _Step([prop.tokens[b, : kept[b]].tolist() for b in range(rows)], nxt, offered, offered,
                 None if feats is None else list(feats), settle)


def _tree_step(decoder, proposer, seqs, done, sampling, generator, feeds, stats, spec, room) -> _Step:
    """Propose a tree per row (paths of at most ``room`` nodes), verify every row's
    ``[pending, nodes...]`` in one ``forward_tree``; done rows feed nothing."""
    rows, device = len(seqs), seqs[0].device
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    trees = [TokenTree(empty, empty)] * rows
    if room > 0:
        t0 = time.perf_counter()
        prop = proposer.propose_tree(seqs, spec.limited(room), sampling, generator)
        stats.draft_s += time.perf_counter() - t0
        stats.draft_calls += prop.model_calls
        trees = prop.trees
    active = [b for b in range(rows) if not done[b]]
    chunks, parents = [empty] * rows, [empty] * rows
    for b in active:
        t = trees[b]
        chunks[b] = torch.cat([seqs[b][-1:], t.tokens.to(device)])
        parents[b] = torch.cat([torch.tensor([-1]), t.parents.cpu() + 1])  # node 0: the pending token
    t0 = time.perf_counter()
    feats = best = probs = None
    if sampling.greedy:
        best, feats = decoder.forward_tree_argmax(chunks, parents, features=feeds)
    elif feeds:
        logits, feats = decoder.forward_tree_features(chunks, parents)
    else:
        logits = decoder.forward_tree(chunks, parents)
    stats.target_s += time.perf_counter() - t0
    stats.target_calls += 1
    stats.k_used.append(max(trees[b].depth() for b in active))
    if best is None:
        probs = probs_from_logits(logits, sampling)
    paths, nxt, kept_feats = [[] for _ in range(rows)], [0] * rows, [empty] * rows
    width = (best if best is not None else probs).shape[1]
    for b in active:
        lo = width - len(chunks[b])
        if best is not None:
            paths[b], nxt[b] = verify_tree_greedy_tokens(trees[b], best[b, lo:].tolist())
        else:
            paths[b], nxt[b] = verify_tree_sampling(trees[b], probs[b, lo:], generator)
        if feats is not None:
            kept_feats[b] = feats[b, [lo] + [lo + 1 + i for i in paths[b]]]

    keep = [[0] + [i + 1 for i in paths[b]] if b in active else [] for b in range(rows)]

    def settle() -> None:
        decoder.keep_path(keep)
        proposer.accept_tree(paths)

    return _Step([trees[b].tokens[paths[b]].tolist() for b in range(rows)], nxt,
                 [trees[b].depth() for b in range(rows)], [trees[b].size for b in range(rows)],
                 kept_feats if feats is not None else None, settle)


def _until_stop(tokens: list[int], stops: set[int], room: int) -> list[int]:
    """The tokens up to and including the first stop token, and at most ``room`` of them."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: i + 1]
    return tokens[:room]


def _assemble(input_ids: torch.Tensor, new: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(t) for t in new), default=0)
    out = torch.full((input_ids.shape[0], width), pad, dtype=torch.int64)
    for b, toks in enumerate(new):
        out[b, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
    return torch.cat([input_ids.cpu(), out], dim=1).to(input_ids.device)
