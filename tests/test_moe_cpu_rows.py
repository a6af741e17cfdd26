"""The cpu backend's one-op MoE path for a few rows (``kernels.cpu_moe``, op
``quantspec_cpu::moe_token`` with T > 1 tokens): a batch of decoding sequences, a speculative
verification or a short prefill runs each MoE block as one op call up to ``MAX_ROWS`` rows, with
the per-expert path's output (each expert's tokens as one M-row product of the same kernels, the
same roundings, each token's sum in ascending expert order as that path's index_add_), for SiLU
experts and GPT-OSS's clamped SwiGLU with biases, rows and panel layouts, 4- and 8-bit; more rows
keep the per-expert path; decoders that run several tokens at once decode the same tokens.

Tolerances: ``moe_cpu_helpers`` (fp32 1e-5, bf16 4e-3 of the largest output). Observed on 320
calls per case (T = 2, 3, 8, 16; the four routings; 10 seeds; both blocks) of the tiny Qwen3-MoE,
Mixtral and GPT-OSS, rows and panels, W4 g32 / W8 g32: fp32 at most 4.7e-7 (about 50-65%
bit-equal), bf16 bit-equal throughout.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from moe_cpu_helpers import LAYOUTS, LIMIT, Counted, both, close, gpt_oss_biases, quantized

from quantspec.core.scheme import QuantScheme
from quantspec.kernels.cpu_ext import load_cpu_ext
from quantspec.kernels.cpu_moe import MAX_ROWS
from quantspec.models.experts import experts_modules

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(load_cpu_ext() is None, reason="the cpu extension is not built here"),
]
ROWS = (2, 3, 8, 16, MAX_ROWS)
ROUTINGS = ("random", "shared", "spread", "interleaved")
W8 = QuantScheme(8, 32, False)
# (dtype, scheme): 8-bit in fp32, where the tolerance is tightest
KINDS = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, W8)]


def _routing(kind: str, rows: int, n_experts: int, k: int, seed: int) -> torch.Tensor:
    """top-k ids [rows, k]. random: k distinct experts per token, every third token with a dropped
    slot (-1 or E); shared: every token the same experts (each expert's tokens one run of rows);
    spread: token t experts k*t .. k*t + k - 1 modulo E (disjoint while they last); interleaved:
    even and odd tokens on two expert sets (an expert's tokens not consecutive)."""
    t = torch.arange(rows)[:, None]
    j = torch.arange(k)[None, :]
    if kind == "shared":
        return j.expand(rows, k).clone()
    if kind == "spread":
        return (k * t + j) % n_experts
    if kind == "interleaved":
        return t % 2 + 2 * j
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(rows)])
    ids[1::3, -1] = torch.tensor([-1, n_experts])[torch.arange(len(ids[1::3])) % 2]
    return ids


def _inputs(experts, rows: int, kind: str, seed: int, dtype):
    """(x [rows, H], ids [rows, k], weights [rows, k]) of ``kind`` routing for ``experts``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, experts[0].linears()[0].in_features, generator=g).to(dtype)
    ids = _routing(kind, rows, len(experts), 2, seed)
    weights = torch.rand(rows, 2, generator=g).to(dtype)
    return x, ids, weights


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", range(len(KINDS)), ids=["fp32-w4", "bf16-w4", "fp32-w8"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_rows_equal_the_per_expert_path(arch, kind, layout, monkeypatch):
    """T = 2, 3, 8, 16 and MAX_ROWS tokens through a block (routings sharing experts or not, with
    dropped slots) are one op call each, equal to the per-expert path's output; MAX_ROWS + 1 go
    per expert (the op is not called)."""
    dtype, scheme = KINDS[kind]
    extra = {"edit": gpt_oss_biases, "swiglu_limit": LIMIT} if arch == "gpt_oss" else {}
    model, report = quantized(arch, dtype, layout, monkeypatch, **({"scheme": scheme} if scheme else {}), **extra)
    blocks = experts_modules(model)
    assert report["cpu_token_experts"] == list(blocks) and len(blocks) == 2
    for i, experts in enumerate(blocks.values()):
        calls = []
        experts.token_runner = Counted(experts.token_runner, calls)
        for rows in ROWS:
            for r, routing in enumerate(ROUTINGS):
                close(*both(experts, *_inputs(experts, rows, routing, 100 * i + 10 * rows + r, dtype)), dtype)
        assert calls == [rows for rows in ROWS for _ in ROUTINGS]
        x, ids, weights = _inputs(experts, MAX_ROWS + 1, "random", i, dtype)
        with torch.no_grad():
            assert torch.isfinite(experts(x, ids, weights)).all()
        assert len(calls) == len(ROWS) * len(ROUTINGS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_split_across_threads_and_experts(layout, monkeypatch):
    """Larger experts on 2 threads (shares that end inside a group of an expert's tokens; 8-bit
    weights and group 64 too): T = 2, 5, 16 tokens, experts shared by non-consecutive tokens,
    still the per-expert path's output."""
    torch.set_num_threads(2)
    for scheme in (QuantScheme(4, 128, True), QuantScheme(8, 64, False)):
        model, _ = quantized("qwen3_moe", torch.float32, layout, monkeypatch, scheme=scheme, hidden_size=512,
                             moe_intermediate_size=256, num_experts_per_tok=3, num_hidden_layers=1)
        (experts,) = experts_modules(model).values()
        calls = []
        experts.token_runner = Counted(experts.token_runner, calls)
        for rows in (2, 5, 16):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            ids = torch.stack([torch.tensor([5, 0, 7]) if t % 2 else torch.tensor([2, 6, 0]) for t in range(rows)])
            weights = torch.rand(rows, 3, generator=torch.Generator().manual_seed(rows))
            close(*both(experts, x, ids, weights), torch.float32)
        assert calls == [2, 5, 16]


def test_each_token_sums_in_the_per_expert_paths_order(monkeypatch):
    """The fp32 sum of a token's weighted expert outputs follows the per-expert path's order: one
    token's in slot order (``_one_token``), several tokens' by ascending expert (its index_add_
    per expert). A token naming expert 2 twice with weights 1 and -1 around expert 5's weight
    2^-30: ascending experts cancel expert 2 first and keep 2^-30 * y5; slot order loses most of
    2^-30 * y5 to y2's rounding, then cancels to (nearly) 0."""
    model, _ = quantized("qwen3_moe", torch.float32, "auto", monkeypatch)
    experts = next(iter(experts_modules(model).values()))
    calls = []
    experts.token_runner = Counted(experts.token_runner, calls)
    x = torch.randn(2, experts[0].linears()[0].in_features, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[2, 5, 2], [1, 4, 6]])
    weights = torch.tensor([[1.0, 2.0**-30, -1.0], [0.5, 0.3, 0.2]])
    for rows in (1, 2):
        fast, ref = both(experts, x[:rows], ids[:rows], weights[:rows])
        close(fast[:1], ref[:1], torch.float32)  # token 0 alone: its tolerance
        close(fast, ref, torch.float32)
    assert calls == [1, 2]


def _steps(prompts: list[torch.Tensor], seed: int) -> list[list[torch.Tensor]]:
    """Decoder calls of a batch of rows, inputs fixed in advance: the prompts (one prefill), two
    batch-decode steps of one token per row, a verification-like chunk of 4 tokens per row."""
    g = torch.Generator().manual_seed(seed)
    steps = [prompts]
    steps += [[torch.randint(3, 200, (1,), generator=g) for _ in prompts] for _ in range(2)]
    steps.append([torch.randint(3, 200, (4,), generator=g) for _ in prompts])
    return steps


def _run(decoder, steps) -> list[torch.Tensor]:
    """The logits [B, t, V] (fp32) of each call in ``steps``, from a reset decoder."""
    decoder.reset()
    with torch.no_grad():
        return [decoder.forward(chunks).float() for chunks in steps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_decoder_batches_run_as_one_op(arch, dtype, monkeypatch):
    """A batch of 2 sequences through a decoder (Qwen3-MoE: the static decoder; GPT-OSS: the
    KVDecoder over transformers): the prefill, batch-decode steps (2 rows) and a 4-token
    verification chunk per row (8 rows) each reach a block as one op call, and every call's
    logits equal the per-expert path's."""
    from quantspec.runtime.decoder import StaticDecoder
    from quantspec.runtime.kv import KVDecoder

    extra = {"edit": gpt_oss_biases, "swiglu_limit": LIMIT} if arch == "gpt_oss" else {}
    model, _ = quantized(arch, dtype, "auto", monkeypatch, **extra)
    blocks = experts_modules(model)
    decoder = StaticDecoder(model) if arch == "qwen3_moe" else KVDecoder(model)
    g = torch.Generator().manual_seed(3)
    steps = _steps([torch.randint(3, 200, (n,), generator=g) for n in (6, 3)], seed=4)
    calls = []
    runners = {n: e.token_runner for n, e in blocks.items()}
    for experts in blocks.values():
        experts.token_runner = Counted(experts.token_runner, calls)
    fast = _run(decoder, steps)
    assert {2, 8} <= set(calls) and all(1 < c <= MAX_ROWS for c in calls)
    for experts in blocks.values():
        experts.token_runner = None
    ref = _run(decoder, steps)
    for n, e in blocks.items():
        e.token_runner = runners[n]
    for f, r in zip(fast, ref):
        close(f.to(dtype), r.to(dtype), dtype)


def test_speculative_decoding_gives_the_target_greedy(monkeypatch):
    """Speculative decoding of a batch of 2 prompts (k = 3: each verification sends up to 8 rows
    through a block, as one op call) gives exactly the target's greedy tokens from the per-expert
    path (transformers' generate)."""
    from quantspec.specdec import DraftModel, speculative_generate

    model, _ = quantized("qwen3_moe", torch.float32, "auto", monkeypatch, initializer_range=0.1)
    blocks = experts_modules(model)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g) for n in (7, 4)]
    runners = {n: e.token_runner for n, e in blocks.items()}
    for experts in blocks.values():
        experts.token_runner = None
    with torch.no_grad():
        refs = [model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                               do_sample=False, max_new_tokens=8)[0, len(p):] for p in prompts]
    calls = []
    for n, experts in blocks.items():
        experts.token_runner = Counted(runners[n], calls)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    draft = DraftModel(tiny_model("qwen3_moe", initializer_range=0.1))
    out, _ = speculative_generate(model, draft, ids, mask, max_new_tokens=8, k=3)
    assert 2 * (3 + 1) in calls  # a verification of both rows: k + 1 tokens each
    for b, ref in enumerate(refs):
        assert torch.equal(out[b, width: width + len(ref)], ref)
