"""Token trees on tiny random models: the tree layout, the decoders' tree forward and
compaction (StaticDecoder for declared families, KVDecoder for transformers' forward),
greedy tree generation equal to ``generate``, the sampled law by chi-square, acceptance
against chains, the features handed to feature-level proposers, and the CLI's refusals.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_model
from test_specdec_loop import _chi2, left_pad, noisy_copy, tiny

from quantspec.cli.main import main
from quantspec.errors import QuantspecError
from quantspec.runtime.decoder import StaticDecoder
from quantspec.runtime.kv import KVDecoder
from quantspec.specdec import (
    DraftModel,
    NGram,
    SamplingConfig,
    probs_from_logits,
    speculative_generate,
)
from quantspec.specdec.tree import TokenTree, TreeSpec, grow_tree, static_choices
from quantspec.specdec.verify import verify_tree_greedy, verify_tree_sampling

NEW = 20
DECODERS = [("llama", StaticDecoder), ("qwen2", StaticDecoder), ("llama", KVDecoder), ("gpt2", KVDecoder),
            ("opt", KVDecoder)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls on a shared CPU


def _tree(parents, tokens=None, probs=None) -> TokenTree:
    par = torch.tensor(parents, dtype=torch.int64)
    tok = torch.arange(10, 10 + len(parents)) if tokens is None else torch.tensor(tokens)
    return TokenTree(tok, par, probs)


def test_layout_of_a_known_tree():
    # root -> 0 -> {2 -> 4, 3}; root -> 1 -> 5
    t = _tree([-1, -1, 0, 0, 2, 1])
    assert t.depths() == [1, 1, 2, 2, 3, 2] and t.depth() == 3
    want = torch.zeros(6, 6, dtype=torch.bool)
    for i, seen in enumerate([[0], [1], [0, 2], [0, 3], [0, 2, 4], [1, 5]]):
        want[i, seen] = True
    assert torch.equal(t.ancestors(), want)
    assert t.path(4) == [0, 2, 4] and t.path(5) == [1, 5] and t.path(1) == [1]
    assert t.children() == [[0, 1], [2, 3], [5], [4], [], [], []]
    with pytest.raises(ValueError):
        _tree([-1, 2, 0])  # a parent after its child
    with pytest.raises(ValueError):
        _tree([-1, 0, 0, 5])


def test_tree_shapes():
    shape = static_choices(10, 3, 4)
    assert len(shape) == 10 and shape[0] == (0,) and (0, 0, 0, 0) in shape
    assert all(c[:-1] in shape for c in shape if len(c) > 1)  # closed under prefixes
    assert all(c[:-1] + (c[-1] - 1,) in shape for c in shape if c[-1] > 0)  # and lower siblings
    assert list(shape) == sorted(shape, key=lambda c: (len(c), c))
    spec = TreeSpec("static", choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert (spec.total, spec.top_k, spec.depth) == (6, 2, 3)
    assert spec.limited(2).shape() == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert TreeSpec("dynamic", depth=5).limited(2).depth == 2
    for bad in [{"kind": "beam"}, {"total": 0}, {"top_k": 0}, {"depth": 0},
                {"kind": "static", "choices": [[0], [1, 0]]}, {"kind": "static", "choices": [[-1]]}]:
        with pytest.raises(QuantspecError):
            TreeSpec(**bad)


def test_grown_trees_follow_their_shape():
    """A fake draft whose logits favour token (parent token + 1) by rank: static trees are the
    index paths over that order; dynamic trees keep the most likely nodes."""
    vocab = 12

    def logits_after(tok: int) -> torch.Tensor:
        return -torch.tensor([float((t - tok - 1) % vocab) for t in range(vocab)])

    fed: list[list[int]] = []

    def expand(tokens, parents):
        fed.append([len(t) for t in tokens])
        return torch.stack([torch.stack([logits_after(int(x)) for x in t]) for t in tokens])

    root = logits_after(0).unsqueeze(0)
    spec = TreeSpec("static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    g = grow_tree(spec, root, expand, SamplingConfig())
    t = g.trees[0]
    assert t.tokens.tolist() == [1, 2, 2, 3, 3] and t.parents.tolist() == [-1, -1, 0, 0, 2]
    assert fed == [[1], [1]] and g.calls == 2 and g.fed[0].tolist() == [0, -1, 1, -1, -1]
    fed.clear()
    g = grow_tree(TreeSpec("dynamic", total=5, top_k=2, depth=3), root, expand, SamplingConfig())
    t = g.trees[0]
    assert t.size == 5 and t.depth() <= 3 and g.calls == 2 and fed == [[2], [2]]
    assert t.tokens[t.path(int(torch.tensor(t.depths()).argmax()))].tolist()[:2] == [1, 2]


def _prompts(seed: int = 3, lengths=(7, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g) for n in lengths]


# row 0: two calls, the second's parents pointing into the first; row 1: nothing in the second
TREE_CALLS = [
    ([[11, 12, 13, 14, 15, 16], [17, 18]], [[-1, 0, 0, 1, 2, -1], [3, 4]]),
    ([[21, 22, 23], []], [[-1, 0, -1], []]),
]
PATHS = [  # each node's path of tokens, in feeding order
    [[11], [11, 12], [11, 13], [11, 12, 14], [11, 13, 15], [16], [11, 12, 14, 17], [11, 13, 15, 18]],
    [[21], [21, 22], [23]],
]


@torch.no_grad()
def _reference(model, prefix: torch.Tensor, path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(torch.cat([prefix, torch.tensor(path)])[None], output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return float((a - b).abs().max()) <= rel * float(b.abs().max()) + 1e-6


@pytest.mark.parametrize("arch,decoder", DECODERS, ids=[f"{a}-{d.__name__}" for a, d in DECODERS])
def test_tree_forward_equals_each_path_alone(arch, decoder):
    """Batch 2, ragged prompts, a tree fed in two calls: every node's logits and features are
    those of a plain forward of its root-to-node path; then keep_path leaves the cache as if it
    had only seen the kept paths (the next logits equal), without the rejected nodes' columns."""
    model = tiny(arch)
    dec = decoder(model)
    prompts = _prompts()
    with torch.inference_mode():
        dec.forward(prompts)
        got = [[], []]
        for call in range(2):
            chunks = [torch.tensor(TREE_CALLS[b][0][call], dtype=torch.int64) for b in range(2)]
            parents = [torch.tensor(TREE_CALLS[b][1][call], dtype=torch.int64) for b in range(2)]
            logits, feats = dec.forward_tree_features(chunks, parents)
            for b in range(2):
                n = len(chunks[b])
                got[b] += list(zip(logits[b, logits.shape[1] - n:], feats[b, feats.shape[1] - n:]))
    for b in range(2):
        for (lg, ft), path in zip(got[b], PATHS[b]):
            ref_lg, ref_ft = _reference(model, prompts[b], path)
            assert _close(lg, ref_lg) and _close(ft, ref_ft, 1e-4), (b, path)
    keep = [[0, 2, 4, 7], [1, 2]]  # 11 -> 13 -> 15 -> 18, and a path that is not a chain from the top
    with pytest.raises(ValueError):
        dec.keep_path(keep)
    keep = [[0, 2, 4, 7], []]
    with torch.inference_mode():
        dec.keep_path(keep)
        assert dec.lengths == [len(prompts[0]) + 4, len(prompts[1])]
        nxt = dec.forward([torch.tensor([5]), torch.tensor([6, 7])])
    for b, (extra, path) in enumerate([([5], [11, 13, 15, 18]), ([6, 7], [])]):
        ref, _ = _reference(model, prompts[b], path + extra)
        assert _close(nxt[b, -1], ref), b
    width = dec.mask.shape[1] if decoder is KVDecoder else dec.width
    assert width == len(prompts[0]) + 4 + 2  # the committed text, the kept path, the new tokens


@pytest.mark.parametrize("arch,decoder", DECODERS[:1] + DECODERS[3:4], ids=["llama-StaticDecoder", "gpt2-KVDecoder"])
def test_compaction_at_batch_one_leaves_no_holes(arch, decoder):
    model = tiny(arch)
    dec = decoder(model)
    prompt = _prompts()[0]
    with torch.inference_mode():
        dec.forward([prompt])
        dec.forward_tree([torch.tensor([11, 12, 13, 14])], [torch.tensor([-1, -1, 1, 2])])
        dec.keep_path([[1, 2]])
        assert dec.lengths == [len(prompt) + 2]
        if decoder is StaticDecoder:
            assert dec.mask is None and dec.width == len(prompt) + 2
        else:
            assert dec.cache.get_seq_length() == len(prompt) + 2 and bool(dec.mask.all())
        lg = dec.forward([torch.tensor([9])])[0, -1]
    assert _close(lg, _reference(model, prompt, [12, 13, 9])[0])


def reference(target, row: torch.Tensor, new: int = NEW) -> torch.Tensor:
    out = target.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.int64),
                          do_sample=False, max_new_tokens=new)
    return out[0, len(row):]


GREEDY = [("llama", True), ("qwen2", True), ("llama", False), ("gpt2", True)]  # fast_verify False: KVDecoder


@pytest.fixture(scope="module", params=GREEDY, ids=[f"{a}-{'fast' if f else 'hf'}" for a, f in GREEDY])
def greedy_setup(request):
    arch, fast = request.param
    target = tiny(arch)
    rows = _prompts(7, (9, 5))
    return target, fast, rows, [reference(target, r) for r in rows], DraftModel(noisy_copy(target, 0.01))


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_greedy_tree_generation_equals_generate(greedy_setup, kind):
    target, fast, rows, refs, draft = greedy_setup
    out, stats = speculative_generate(target, draft, rows[0][None], max_new_tokens=NEW, k=4, tree=kind,
                                      fast_verify=fast)
    assert torch.equal(out[0, len(rows[0]): len(rows[0]) + len(refs[0])], refs[0])
    assert stats.accepted > 0 and stats.target_calls < NEW
    assert stats.proposed > stats.accepted  # every node counts as proposed
    ids, mask = left_pad(rows)
    out, stats = speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, k=4, tree=kind,
                                      fast_verify=fast)
    for b, ref in enumerate(refs):
        assert torch.equal(out[b, ids.shape[1]: ids.shape[1] + len(ref)], ref), b
    assert sum(n * c for n, c in stats.hist.items()) == stats.accepted


class _Pruning(DraftModel):
    """A draft whose row b keeps only the first n - 5b nodes of its tree (a topological prefix is
    a tree): rows verify trees of different sizes in one forward."""

    def propose_tree(self, sequences, spec, sampling, generator=None):
        prop = super().propose_tree(sequences, spec, sampling, generator)
        for b, t in enumerate(prop.trees):
            n = max(1, t.size - 5 * b)
            prop.trees[b] = TokenTree(t.tokens[:n], t.parents[:n], None if t.probs is None else t.probs[:n])
        return prop


def test_rows_that_stop_early_and_one_token_prompts(greedy_setup):
    """Rows verify trees of different sizes; a row ending at a stop token feeds nothing in later
    tree forwards while the other goes on; prompts of one token start the tree forward on an
    empty cache."""
    target, fast, rows, refs, draft = greedy_setup
    draft = _Pruning(draft.model)
    stop = int(refs[1][5])
    cut = int((refs[1] == stop).nonzero()[0]) + 1
    ids, mask = left_pad([rows[1], rows[0]])
    out, _ = speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, k=3, tree="static",
                                  eos_token_id=stop, pad_token_id=0, fast_verify=fast)
    w = ids.shape[1]
    assert torch.equal(out[0, w: w + cut], refs[1][:cut]) and bool((out[0, w + cut:] == 0).all())
    other = reference(target, rows[0]).tolist()
    other = other[: other.index(stop) + 1] if stop in other else other
    assert out[1, w: w + len(other)].tolist() == other
    ones = torch.tensor([[rows[0][0]], [rows[1][0]]])
    out, _ = speculative_generate(target, draft, ones, max_new_tokens=6, k=3, tree="dynamic", fast_verify=fast)
    for b in range(2):
        ref = reference(target, ones[b], 6)
        assert torch.equal(out[b, 1: 1 + len(ref)], ref), b


def test_a_tree_of_the_target_itself_accepts_every_path():
    """The target as its own draft: every verification accepts a path as deep as its tree (a
    dynamic tree of a flat random model is shallow: its deep nodes score below the shallow ones)."""
    target = tiny("llama")
    row = _prompts()[0]
    for kind, sampling in [("static", SamplingConfig()), ("dynamic", SamplingConfig()),
                           ("static", SamplingConfig(temperature=1.0))]:
        out, stats = speculative_generate(target, DraftModel(target), row[None], max_new_tokens=NEW, k=4,
                                          tree=kind, sampling=sampling, seed=0, eos_token_id=[])
        assert stats.accepted_at == stats.offered_at, kind  # every path as deep as its tree
        if kind == "static":  # the static shape holds a path of 4: 4 + the target's token per call
            assert stats.target_calls == -(-NEW // 5)
            assert stats.mean_accepted == (NEW - stats.target_calls) / stats.target_calls
        if sampling.greedy:
            ref = reference(target, row)
            assert torch.equal(out[0, len(row): len(row) + len(ref)], ref)


def test_trees_accept_longer_paths_than_chains():
    """A draft near the target (its weights plus noise): over a few prompts, a tree of the same
    draft accepts more per target call than its chain of the same depth."""
    target = tiny("llama")
    draft = DraftModel(noisy_copy(target, 0.01))
    rows = _prompts(3, (8, 8, 8, 8))
    accepted = {}
    for tree in (None, "static", "dynamic"):
        calls = acc = 0
        for row in rows:
            _, s = speculative_generate(target, draft, row[None], max_new_tokens=32, k=4, tree=tree,
                                        eos_token_id=[])
            calls, acc = calls + s.verifications, acc + s.accepted
        accepted[tree] = acc / calls
    assert accepted["static"] > 1.3 * accepted[None] and accepted["dynamic"] > 1.3 * accepted[None], accepted


def _exact_laws(target, prompt, sampling, vocab):
    """The target's exact laws of the first three new tokens (marginals)."""
    with torch.no_grad():
        p1 = probs_from_logits(target(prompt[None]).logits[0, -1], sampling)
        two = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2 = probs_from_logits(target(two).logits[:, -1], sampling)
        three = torch.cat([prompt.expand(vocab * vocab, -1), torch.arange(vocab).repeat_interleave(vocab)[:, None],
                           torch.arange(vocab).repeat(vocab)[:, None]], 1)
        p3 = probs_from_logits(target(three).logits[:, -1], sampling).reshape(vocab, vocab, vocab)
    joint = p1[:, None] * p2
    return p1, joint.sum(0), (joint[:, :, None] * p3).sum((0, 1))


@pytest.mark.parametrize("kind,sampling", [
    ("static", SamplingConfig(temperature=1.0)),  # children drawn without replacement, with q
    ("dynamic", SamplingConfig(temperature=0.8, top_k=8, top_p=0.9)),  # deterministic top-k children
])
def test_sampled_trees_keep_the_target_distribution(kind, sampling):
    """3,000 rows of one prompt, vocabulary 16, a draft far from the target, trees of depth 2
    then 1: the first three tokens' laws are the target's (chi-square)."""
    vocab = 16
    target = tiny("llama", seed=3, vocab=vocab)
    target.config.eos_token_id = None
    target.generation_config.eos_token_id = None
    draft = DraftModel(tiny("llama", seed=4, vocab=vocab))
    prompt = torch.tensor([3, 7, 5, 9])
    spec = TreeSpec(kind, total=8, top_k=3, depth=3)
    out, stats = speculative_generate(target, draft, prompt.expand(3000, -1), max_new_tokens=3, k=3,
                                      sampling=sampling, seed=123, tree=spec)
    for i, p in enumerate(_exact_laws(target, prompt, sampling, vocab)):
        assert _chi2(torch.bincount(out[:, 4 + i], minlength=vocab), p) > 1e-3, i
    assert 0 < stats.mean_accepted < 2


def test_tree_verification_rules_on_fixed_laws():
    """No model: a root with three children drawn without replacement from q (far from p), or
    three fixed children (q one-hot); the first emitted token follows p (chi-square over 5,000
    draws). Greedy walks the argmax path."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(4, vocab, generator=g) * 2, -1)  # root, then nodes 0..2
    q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    for sampled in (True, False):
        first = torch.zeros(vocab)
        for _ in range(5_000):
            if sampled:  # Gumbel top-3: three draws without replacement, in order
                gumbel = -torch.log(-torch.log(torch.rand(vocab, generator=g)))
                tree = _tree([-1, -1, -1], tokens=torch.topk(q.log() + gumbel, 3).indices.tolist(),
                             probs=q.expand(3, -1))
            else:
                tree = _tree([-1, -1, -1], tokens=[1, 3, 4])
            path, nxt = verify_tree_sampling(tree, p, g)
            first[int(tree.tokens[path[0]]) if path else nxt] += 1
        assert _chi2(first, p[0]) > 1e-3, sampled
    logits = torch.full((5, vocab), -1.0)
    logits[0, 3], logits[2, 4], logits[4, 1] = 1.0, 1.0, 1.0  # root -> 3 (node 1) -> 4 (node 3) -> 1
    tree = _tree([-1, -1, 0, 1], tokens=[1, 3, 4, 4])
    assert verify_tree_greedy(tree, logits) == ([1, 3], 1)


class _Recording(DraftModel):
    """A draft that asks for the target's features and keeps what it is handed."""

    needs_features = True

    def reset(self) -> None:
        super().reset()
        self.seen: list[torch.Tensor] = []

    def observe(self, features):
        self.seen.append(features[0].clone())


@pytest.mark.parametrize("fast", [True, False])
def test_tree_hands_over_the_features_of_committed_tokens(fast):
    """The features observed over a tree generation are the target's own at every committed
    position but the last, in order (the pending token's and the accepted nodes')."""
    target = tiny("llama")
    draft = _Recording(noisy_copy(target, 0.01))
    row = _prompts()[0]
    out, _ = speculative_generate(target, draft, row[None], max_new_tokens=12, k=3, tree="static",
                                  fast_verify=fast, eos_token_id=[])
    seen = torch.cat(draft.seen)
    with torch.no_grad():
        want = target(out[:, :-1], output_hidden_states=True).hidden_states[-1][0]
    assert seen.shape == want.shape and _close(seen, want, 1e-4)


def test_a_proposer_without_trees_refuses():
    target = tiny("llama")
    with pytest.raises(QuantspecError, match="does not grow token trees"):
        speculative_generate(target, NGram(), _prompts()[0][None], max_new_tokens=4, tree="static")
    with pytest.raises(QuantspecError, match="adaptive"):
        speculative_generate(target, DraftModel(target), _prompts()[0][None], max_new_tokens=4,
                             tree="static", adaptive=True)


class _NoTreeGrowth(DraftModel):
    """A draft model that fails the test if a tree is ever asked of it."""

    def propose_tree(self, *args, **kwargs):
        raise AssertionError("the run started: the refusal must come before any draft")


def test_models_that_cannot_run_trees_are_refused_before_any_draft():
    """An ALiBi target (BLOOM: its forward takes no position ids, its positions come from the
    2-D mask) cannot place tree nodes at their depths; a draft whose own cache has
    sliding-window layers cannot grow trees. Both are refused in one line before any draft
    (before, BLOOM's forward failed inside transformers on the 4-D tree mask); chains still run."""
    bloom = tiny("bloom")
    prompt = _prompts()[0][None]
    with pytest.raises(QuantspecError, match="BloomForCausalLM's forward takes no position ids"):
        speculative_generate(bloom, _NoTreeGrowth(bloom), prompt, max_new_tokens=4, tree="static")
    out, _ = speculative_generate(bloom, DraftModel(bloom), prompt, max_new_tokens=4)
    assert torch.equal(out[0, prompt.shape[1]:], reference(bloom, prompt[0], 4))
    target, draft = tiny("llama"), tiny("gemma2")
    with pytest.raises(QuantspecError, match="the draft .*sliding-window layers"):
        speculative_generate(target, _NoTreeGrowth(draft), prompt, max_new_tokens=4, tree="static")


BAD_TREES = [
    (["--draft", "X", "--tree", "beam"], "--tree beam"),
    (["--draft", "X", "--tree", "static", "--tree-nodes", "0"], "--tree-nodes 0"),
    (["--draft", "X", "--tree", "dynamic", "--tree-topk", "-1"], "--tree-topk -1"),
    (["--draft", "X", "--tree", "static", "--k", "0"], "--k 0"),
    (["--draft", "ngram", "--tree", "static"], "n-gram"),
    (["--draft", "X", "--tree", "static", "--adaptive"], "--adaptive"),
    (["--draft", "X", "--tree-nodes", "8"], "no --tree"),
]
CLI_CASES = [(c, *bad) for c in ("generate", "bench-specdec") for bad in BAD_TREES] + [
    ("generate", ["--tree", "static"], "needs a draft"),
    ("bench-specdec", ["--draft", "X", "--tree", "static", "--no-timing", "--agreement"], "--no-timing"),
]


@pytest.mark.parametrize("command,extra,needle", CLI_CASES)
def test_cli_refuses_bad_tree_values_before_loading(command, extra, needle, capsys):
    argv = [command, "/nonexistent/model"] + (["--prompt", "hi"] if command == "generate" else [])
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and "nonexistent" not in err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0, initializer_range=0.1)


def test_cli_runs_trees_beside_chains(tiny_dir, tmp_path):
    out = tmp_path / "g.json"
    assert main(["generate", str(tiny_dir), "--prompt", "the quick brown fox", "--max-new-tokens", "8",
                 "--draft", str(tiny_dir), "--draft-dtype", "float32", "--tree", "dynamic", "--tree-nodes", "6",
                 "--k", "3", "--json", str(out)]) == 0
    g = json.loads(out.read_text())
    assert g["tree"] == {"kind": "dynamic", "total": 6, "top_k": 4, "depth": 3}
    assert g["specdec"]["acceptance_rate"] > 0 and g["new_tokens"] == 8
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "x", "prompt": "The quick brown fox"}) + "\n")
    out = tmp_path / "b.json"
    assert main(["bench-specdec", str(tiny_dir), "--draft", str(tiny_dir), "--draft-dtype", "float32",
                 "--tree", "static", "--k", "3", "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--repeats", "1", "--no-hf", "--no-chat", "--json", str(out)]) == 0
    b = json.loads(out.read_text())
    assert b["tree"]["kind"] == "static" and b["tree"]["depth"] == 3
    assert b["modes"]["ours_tree"]["greedy_matches_target"] and b["modes"]["ours"]["greedy_matches_target"]
    assert "ours_tree" in b["prompts"][0]
