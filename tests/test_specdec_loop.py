"""The generation loop on tiny random models of two architectures (Llama, Qwen2).

Greedy speculative output must equal ``target.generate(do_sample=False)`` token for token, for
every proposer, fixed and adaptive k, and batch > 1 with left padding (each row equal to its
own single-sequence output). Sampling is checked end to end against the exact distribution.
"""

from __future__ import annotations

import copy

import pytest
import torch
from scipy.stats import chisquare

from helpers import tiny_model
from quantspec.core.scheme import QuantScheme
from quantspec.specdec import (
    DraftModel,
    NGram,
    QuantizedSelf,
    SamplingConfig,
    probs_from_logits,
    speculative_generate,
)

ARCHS = ("llama", "qwen2")
NEW = 20


def tiny(arch: str, seed: int = 0, vocab: int = 256, **kw) -> torch.nn.Module:
    return tiny_model(arch, seed, vocab_size=vocab, initializer_range=0.1, **kw)


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A draft close to the target: same weights plus noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def prompts(seed: int, lengths=(11, 4, 8)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 256, (n,), generator=g) for n in lengths]
    rows[0] = torch.cat([rows[0], rows[0][:5]])  # a repeat, so that n-gram lookup finds matches
    return rows


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = r
        mask[b, width - len(r):] = 1
    return ids, mask


def reference(target, row: torch.Tensor, new: int = NEW) -> torch.Tensor:
    out = target.generate(row[None], attention_mask=torch.ones(1, len(row), dtype=torch.int64),
                          do_sample=False, max_new_tokens=new)
    return out[0, len(row):]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(ARCHS))
def setup(request):
    target = tiny(request.param)
    rows = prompts(7)
    refs = [reference(target, r) for r in rows]
    proposers = {
        "ngram": NGram(max_n=3),
        "noisy-draft": DraftModel(noisy_copy(target, 0.01)),
        "other-model": DraftModel(tiny(request.param, seed=5)),
        "self-w4g32": QuantizedSelf.from_target(target, QuantScheme(bits=4, group_size=32)),
    }
    return target, rows, refs, proposers


def _check_rows(out: torch.Tensor, width: int, refs: list[torch.Tensor]) -> None:
    for b, ref in enumerate(refs):
        got = out[b, width: width + len(ref)]
        assert torch.equal(got, ref), f"row {b}: {got.tolist()} != {ref.tolist()}"


CASES = {  # (proposer, adaptive) per architecture; the full cross product is slow on 2 cores
    "llama": [("ngram", False), ("noisy-draft", False), ("other-model", False), ("self-w4g32", False),
              ("ngram", True), ("self-w4g32", True)],
    "qwen2": [("ngram", False), ("noisy-draft", True), ("self-w4g32", False)],
}


@pytest.mark.parametrize("case", range(6))
def test_greedy_batch_equals_target_generate(setup, case):
    target, rows, refs, proposers = setup
    cases = CASES[target.config.model_type]
    if case >= len(cases):
        pytest.skip("case not run for this architecture")
    name, adaptive = cases[case]
    ids, mask = left_pad(rows)
    out, stats = speculative_generate(target, proposers[name], ids, mask, max_new_tokens=NEW,
                                      k=3, adaptive=adaptive)
    _check_rows(out, ids.shape[1], refs)
    assert stats.new_tokens == sum(len(r) for r in refs)
    assert stats.target_calls <= NEW
    assert sum(n * c for n, c in stats.hist.items()) == stats.accepted


@pytest.mark.parametrize("fast_verify", [True, False])
def test_verification_through_either_runtime(setup, fast_verify):
    """The target verifies through the StaticDecoder and few-row products (default) or through
    transformers' own forward: the same greedy output, batch and padding included."""
    target, rows, refs, proposers = setup
    ids, mask = left_pad(rows)
    out, stats = speculative_generate(target, proposers["noisy-draft"], ids, mask, max_new_tokens=NEW,
                                      k=3, fast_verify=fast_verify)
    _check_rows(out, ids.shape[1], refs)
    assert 0 < stats.target_s < stats.wall_s and 0 < stats.draft_s < stats.wall_s


def test_k_zero_is_plain_decoding(setup):
    target, rows, refs, proposers = setup
    out, stats = speculative_generate(target, proposers["self-w4g32"], rows[1][None],
                                      max_new_tokens=NEW, k=0)
    assert torch.equal(out[0, len(rows[1]):], refs[1])
    assert stats.draft_calls == 0 and stats.target_calls == NEW  # one token per target call


def test_single_rows_and_acceptance(setup):
    """Batch 1, each prompt: exact output; the quantized self-draft saves target calls."""
    target, rows, refs, proposers = setup
    total = None
    for row, ref in zip(rows, refs):
        out, stats = speculative_generate(target, proposers["self-w4g32"], row[None],
                                          max_new_tokens=NEW, k=4)
        assert torch.equal(out[0, len(row): len(row) + NEW], ref)
        total = stats if total is None else total.merge(stats)
    assert total.acceptance_rate > 0.2  # a random tiny model quantized to 4 bits: a fair draft
    assert total.target_calls < total.new_tokens  # fewer target calls than tokens


def test_target_as_its_own_draft_accepts_all(setup):
    target, rows, refs, _ = setup
    out, stats = speculative_generate(target, DraftModel(target), rows[0][None], max_new_tokens=NEW, k=4)
    assert torch.equal(out[0, len(rows[0]):], refs[0])
    assert stats.acceptance_rate == 1.0
    assert stats.target_calls == -(-NEW // 5)  # k + 1 tokens per call
    assert stats.draft_calls == 4 * (stats.target_calls - 1) + (NEW - 5 * (stats.target_calls - 1) - 1)


def test_stops_at_eos_and_max_new_tokens(setup):
    target, rows, refs, proposers = setup
    row, ref = rows[1], refs[1]
    stop = int(ref[5])  # make the 6th generated token a stop token
    cut = int((ref == stop).nonzero()[0]) + 1
    ids, mask = left_pad([row, rows[2]])
    out, stats = speculative_generate(target, proposers["noisy-draft"], ids, mask,
                                      max_new_tokens=NEW, k=3, eos_token_id=stop, pad_token_id=0)
    w = ids.shape[1]
    assert torch.equal(out[0, w: w + cut], ref[:cut])
    assert bool((out[0, w + cut:] == 0).all())
    out, _ = speculative_generate(target, proposers["ngram"], row[None], max_new_tokens=3, k=8)
    assert torch.equal(out[0, len(row):], ref[:3])


def test_kv_cache_is_cropped_not_grown(setup):
    """After generation the target cache holds the text (minus the pending token) plus holes
    only where rows differ; with batch 1 there are no holes at all."""
    from quantspec.runtime.kv import KVDecoder

    target, rows, _, _ = setup
    dec = KVDecoder(target)
    row = rows[0]
    dec.forward([row[:-1]])
    dec.forward([torch.cat([row[-1:], torch.tensor([5, 6, 7])])])
    dec.drop_last([2])
    assert dec.cache.get_seq_length() == len(row) + 1 == dec.mask.shape[1]
    logits = dec.forward([torch.tensor([9])])[:, -1]
    full = target(torch.cat([row, torch.tensor([5, 9])])[None]).logits[:, -1]
    assert torch.allclose(logits, full, atol=1e-4)


def _exact_two_token_laws(target, prompt, sampling):
    """The target's exact law of the first new token and the marginal of the second."""
    with torch.no_grad():
        p1 = probs_from_logits(target(prompt[None]).logits[0, -1], sampling)
        vocab = p1.shape[0]
        batch = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2 = probs_from_logits(target(batch).logits[:, -1], sampling)
    return p1, p1 @ p2


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 1e-9
    assert counts[~keep].sum() == 0
    exp = probs[keep].double() / probs[keep].double().sum() * counts.sum()
    obs = counts[keep].double()
    small = exp < 5  # pool rare cells so that the chi-square approximation holds
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
        obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.8, top_k=8, top_p=0.9)])
def test_sampling_end_to_end_matches_target_distribution(sampling):
    """3,000 rows of one prompt in one batch, vocabulary 16, a draft far from the target."""
    target = tiny("llama", seed=3, vocab=16)
    target.config.eos_token_id = None
    target.generation_config.eos_token_id = None
    draft = DraftModel(tiny("llama", seed=4, vocab=16))
    prompt = torch.tensor([3, 7, 5, 9])
    n = 3000
    out, stats = speculative_generate(target, draft, prompt.expand(n, -1), max_new_tokens=2, k=2,
                                      sampling=sampling, seed=123)
    first, second = out[:, 4], out[:, 5]
    p1, p2 = _exact_two_token_laws(target, prompt, sampling)
    assert _chi2(torch.bincount(first, minlength=16), p1) > 1e-3
    assert _chi2(torch.bincount(second, minlength=16), p2) > 1e-3
    assert 0 < stats.acceptance_rate < 1
    again, _ = speculative_generate(target, draft, prompt.expand(n, -1), max_new_tokens=2, k=2,
                                    sampling=sampling, seed=123)
    assert torch.equal(out, again)  # seeded: reproducible


def test_sampling_with_a_draft_taking_the_targets_cache_matches_target_distribution():
    """A draft that takes the target's keys and values (``shares_cache``: here another model of the
    same shapes, so its proposals get worse, never wrong): k = 1, so that rows rejected in the
    first step draft the second token from the copied cache (with holes: 3,000 rows)."""
    sampling = SamplingConfig(temperature=1.0)
    target = tiny("llama", seed=3, vocab=16)
    target.config.eos_token_id = None
    target.generation_config.eos_token_id = None
    draft = DraftModel(tiny("llama", seed=4, vocab=16), shares_cache=True)
    prompt = torch.tensor([3, 7, 5, 9])
    out, stats = speculative_generate(target, draft, prompt.expand(3000, -1), max_new_tokens=2, k=1,
                                      sampling=sampling, seed=7)
    p1, p2 = _exact_two_token_laws(target, prompt, sampling)
    assert _chi2(torch.bincount(out[:, 4], minlength=16), p1) > 1e-3
    assert _chi2(torch.bincount(out[:, 5], minlength=16), p2) > 1e-3
    assert draft._shared is not None and stats.target_calls == 2


def test_divergence_names_the_first_differing_token_and_its_logit_gap(setup):
    from quantspec.specdec.bench import divergence

    target, rows, refs, _ = setup
    row, ref = rows[0], refs[0]
    full = torch.cat([row, ref])[None]
    assert divergence(target, full, full, len(row)) is None
    other = full.clone()
    other[0, len(row) + 3] = (int(ref[3]) + 1) % 256
    d = divergence(target, other, full, len(row))
    with torch.no_grad():
        logits = target(full[:, : len(row) + 3]).logits[0, -1]
    assert d["at"] == 3 and d["target_token"] == int(ref[3]) and d["ours_token"] == int(other[0, len(row) + 3])
    want = float(logits[int(ref[3])] - logits[d["ours_token"]])
    assert d["logit_gap"] == pytest.approx(want, abs=1e-3) and d["logit_gap"] >= 0


def test_stats_by_depth_are_exact():
    from quantspec.specdec.stats import SpecStats

    s = SpecStats()
    # (accepted, proposed) per verification: (4,4) all kept; (1,4) first only; (0,4) none; (2,3)
    s.record([4, 1, 0, 2], [4, 4, 4, 3])
    s.new_tokens = 4 + 1 + 1 + 1 + 0 + 1 + 2 + 1
    d = {r["depth"]: r for r in s.by_depth()}
    assert [d[i]["offered"] for i in (1, 2, 3, 4)] == [4, 4, 4, 3]
    assert d[1]["accept_rate"] == 0.75 and d[1]["accept_given_previous"] == 0.75
    assert d[2]["accept_rate"] == 0.5 and d[2]["accept_given_previous"] == round(2 / 3, 4)  # of 3 that kept #1
    assert d[3]["accept_rate"] == 0.25 and d[3]["accept_given_previous"] == 0.5  # of the 2 that kept #1-#2
    assert d[4]["accept_rate"] == round(1 / 3, 4) and d[4]["accept_given_previous"] == 1.0
    merged = s.merge(s)
    rates = lambda st: [(r["accept_rate"], r["accept_given_previous"]) for r in st.by_depth()]  # noqa: E731
    assert rates(merged) == rates(s) and merged.offered_at[1] == 8
    assert s.to_dict()["mean_accepted_length"] == round(11 / 4, 4)
