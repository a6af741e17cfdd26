"""Pure verification: greedy rules, and rejection sampling that keeps the target's law.

The statistical tests draw tens of thousands of verifications at once (verify is vectorized
over rows) on a vocabulary of 8 with fixed target and draft distributions, and compare the
emitted tokens with the exact target distribution (chi-square, p > 1e-3, fixed seeds).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from quantspec.errors import QuantspecError
from quantspec.specdec.sampling import SamplingConfig, probs_from_logits
from quantspec.specdec.verify import verify_greedy, verify_sampling

V = 8
N = 30_000


def _dist(logits) -> torch.Tensor:
    return torch.softmax(torch.tensor(logits, dtype=torch.float32), dim=-1)


def _markov(seed: int, sharp: float) -> torch.Tensor:
    """[V, V]: row a = distribution of the next token after token a."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * sharp, dim=-1)


P_TABLE = _markov(1, 1.5)
DRAFTS = {
    "close": torch.softmax(P_TABLE.log() + 0.3 * torch.randn(V, V, generator=torch.Generator().manual_seed(2)), -1),
    "far": _markov(3, 2.0),
    "same": P_TABLE.clone(),
}
# a draft whose head scores part of the vocabulary (specdec.draft_vocab): zero mass on 5, 6, 7
_scored = torch.tensor([1.0] * 5 + [0.0] * 3)
DRAFTS["pruned"] = DRAFTS["close"] * _scored / (DRAFTS["close"] * _scored).sum(-1, keepdim=True)


def _chi2_ok(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """p-value; cells of zero expected probability must be empty."""
    observed = observed.to(torch.float64)
    keep = expected_p > 0
    assert observed[~keep].sum() == 0, "a token of zero target probability was emitted"
    expected = expected_p[keep].to(torch.float64)
    expected = expected / expected.sum() * observed.sum()
    observed = observed[keep]
    small = expected < 5  # pool rare cells so that the chi-square approximation holds
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    return chisquare(observed.numpy(), expected.numpy()).pvalue


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one thread is faster, and fair to other jobs on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _step(last: torch.Tensor, q_table: torch.Tensor, k: int, gen: torch.Generator, det: bool):
    """One verification per row from context token ``last`` [B] with Markov tables."""
    toks, qs, ctx = [], [], last
    for _ in range(k):
        q = q_table[ctx]
        x = q.argmax(-1) if det else torch.multinomial(q, 1, generator=gen).squeeze(-1)
        toks.append(x)
        qs.append(q)
        ctx = x
    drafts = torch.stack(toks, 1)
    contexts = torch.cat([last.unsqueeze(1), drafts], 1)  # p_i is conditioned on the prefix
    p = P_TABLE[contexts]  # [B, k + 1, V]
    q = None if det else torch.stack(qs, 1)
    n, nxt = verify_sampling(drafts, q, p, generator=gen)
    return drafts, n, nxt


def _first_emitted(drafts, n, nxt):
    return torch.where(n >= 1, drafts[:, 0], nxt)


def _two_tokens(q_table, k, seed, det=False):
    """First two emitted tokens of N independent generations that start from token 0."""
    gen = torch.Generator().manual_seed(seed)
    drafts, n, nxt = _step(torch.zeros(N, dtype=torch.int64), q_table, k, gen, det)
    first = _first_emitted(drafts, n, nxt)
    if k >= 2:
        second = torch.where(n >= 2, drafts[:, 1 if k > 1 else 0], nxt)
    else:
        second = nxt.clone()
    need = n == 0  # only one token came out of step 1: step 2 gives the second
    if need.any():
        d2, n2, nxt2 = _step(first[need], q_table, k, gen, det)
        second[need] = _first_emitted(d2, n2, nxt2)
    return first, second


@pytest.mark.parametrize("draft", ["close", "far", "same", "pruned"])
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_keeps_target_distribution(draft, k):
    first, second = _two_tokens(DRAFTS[draft], k, seed=10 + k)
    assert _chi2_ok(torch.bincount(first, minlength=V), P_TABLE[0]) > 1e-3
    a = int(torch.bincount(first, minlength=V).argmax())  # the second token given a first token
    assert _chi2_ok(torch.bincount(second[first == a], minlength=V), P_TABLE[a]) > 1e-3
    joint = P_TABLE[0].unsqueeze(1) * P_TABLE  # P(first, second)
    assert _chi2_ok(torch.bincount(first * V + second, minlength=V * V), joint.flatten()) > 1e-3


def test_deterministic_proposer_keeps_target_distribution():
    first, second = _two_tokens(DRAFTS["far"], 3, seed=5, det=True)
    assert _chi2_ok(torch.bincount(first, minlength=V), P_TABLE[0]) > 1e-3
    joint = P_TABLE[0].unsqueeze(1) * P_TABLE
    assert _chi2_ok(torch.bincount(first * V + second, minlength=V * V), joint.flatten()) > 1e-3


def test_chi_square_detects_a_wrong_rule():
    """The statistical test can fail: accepting every draft gives the draft's law, not p."""
    gen = torch.Generator().manual_seed(0)
    q = DRAFTS["far"][0].expand(N, V)
    x = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    assert _chi2_ok(torch.bincount(x, minlength=V), P_TABLE[0]) < 1e-6


def test_identical_draft_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    drafts, n, _ = _step(torch.zeros(2000, dtype=torch.int64), DRAFTS["same"], 4, gen, det=False)
    assert bool((n == 4).all())


def test_lengths_limit_acceptance_and_bonus_comes_from_p():
    """Rows with fewer real drafts: positions past the length count as rejected."""
    p = torch.zeros(3, 4, V)
    p[:, :, 5] = 1.0  # the target always says 5
    drafts = torch.full((3, 3), 5)
    n, nxt = verify_sampling(drafts, None, p, lengths=torch.tensor([3, 1, 0]))
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [5, 5, 5]
    n, nxt = verify_greedy(drafts, p, lengths=torch.tensor([3, 1, 0]))
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [5, 5, 5]


def test_greedy_accepts_matching_prefix_then_target_token():
    logits = torch.zeros(2, 4, V)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    logits.scatter_(2, best.unsqueeze(-1), 5.0)
    drafts = torch.tensor([[1, 2, 7], [1, 2, 3]])
    n, nxt = verify_greedy(drafts, logits)
    assert n.tolist() == [2, 3]
    assert nxt.tolist() == [3, 4]  # the correction, and the bonus token
    n, nxt = verify_greedy(torch.zeros(2, 0, dtype=torch.int64), logits[:, :1])
    assert n.tolist() == [0, 0] and nxt.tolist() == [1, 1]


def test_probs_from_logits_top_k_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top2 = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    nucleus = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert torch.allclose(nucleus, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    assert torch.equal(probs_from_logits(logits, SamplingConfig()), torch.tensor([[1.0, 0, 0, 0]]))
    hot = probs_from_logits(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_sampling_config_rejects_bad_values(kw):
    with pytest.raises(QuantspecError):
        SamplingConfig(**kw)
