"""A self-draft starts from the target's cache of the prompt (``Decoder.copy_prefix_from``,
``DraftModel.adopt_prompt``): no prefill of its own; after each step it takes the target's keys
and values of the tokens the step committed (``copy_prefix_from(start=...)``,
``DraftModel.adopt_accepted``).

Copying a cache between decoders of the same model must change nothing (the next logits the same
bits as the source's own); a copy from a start keeps the columns before it; decoders whose blocks
differ refuse with the reason; in the loop, the self-draft holds exactly the target's keys and
values of the prompt and of every committed token, greedy output stays the target's, and its
pruned head still scores the prompt's tokens.
"""

from __future__ import annotations

import helpers
import pytest
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.runtime.decoder import StaticDecoder
from quantspec.runtime.kv import KVDecoder
from quantspec.specdec import speculative_generate
from quantspec.specdec.proposers import DraftModel
from quantspec.specdec.selfdraft import QuantizedSelf


def _after(monkeypatch, hook: str, record) -> None:
    """Call ``record(draft, target_decoder, sequences)`` after each ``DraftModel.<hook>``."""
    real = getattr(DraftModel, hook)

    def spy(self, decoder, sequences):
        done = real(self, decoder, sequences)
        record(self, decoder, sequences)
        return done

    monkeypatch.setattr(DraftModel, hook, spy)


@pytest.mark.parametrize("sizes", [(19,), (19, 11)])  # (19, 11): ragged rows, the second padded
def test_copy_from_the_same_model_changes_nothing(sizes):
    model = helpers.tiny_model("qwen2")
    src, dst = StaticDecoder(model), StaticDecoder(model)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        src.forward([torch.randint(3, 300, (n,), generator=gen) for n in sizes])
        assert dst.copy_prefix_from(src) is None
        assert dst.lengths == src.lengths == list(sizes) and dst.width == 19
        for n in (1, 4, 1):
            ids = [torch.randint(3, 300, (n,), generator=gen) for _ in sizes]
            assert torch.equal(dst.forward(ids), src.forward(ids))


def test_refusals_leave_the_decoder_as_it_was():
    model = helpers.tiny_model("llama")
    other = helpers.tiny_model("llama", num_hidden_layers=3)
    dst = StaticDecoder(model)
    with torch.inference_mode():
        dst.forward([torch.arange(3, 10)])
        src = StaticDecoder(other)
        src.forward([torch.arange(3, 12)])
        assert "blocks" in dst.copy_prefix_from(src)
        assert "StaticDecoder" in dst.copy_prefix_from(KVDecoder(model))
        assert "nothing" in dst.copy_prefix_from(StaticDecoder(model))
    assert dst.lengths == [7]


def test_self_draft_adopts_the_targets_prompt_cache(monkeypatch):
    target = helpers.tiny_model("llama")
    prop = QuantizedSelf.from_target(target, QuantScheme(bits=4, group_size=32),
                                     token_ids=torch.arange(0, 40))
    prompt = torch.randint(3, 300, (1, 21), generator=torch.Generator().manual_seed(1))
    want = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    seen = {}

    def record(self, decoder, sequences):
        seen["target"] = [k[:, :, :20].clone() for k in decoder._k]
        seen["draft"] = [k[:, :, :20].clone() for k in self._decoder._k]
        seen["scored"] = bool(self.pruned.scored[prompt[0, :-1]].all())

    _after(monkeypatch, "adopt_prompt", record)
    out, stats = speculative_generate(target, prop, prompt, max_new_tokens=12, k=3)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(seen["draft"], seen["target"]))
    assert seen["scored"]  # the prompt's tokens join the pruned head, as its own prefill adds them
    assert stats.accepted > 0


def test_another_model_keeps_its_own_prefill():
    target = helpers.tiny_model("llama")
    draft = DraftModel(helpers.tiny_model("llama", seed=5))  # same shapes, other weights: no sharing
    prompt = torch.randint(3, 300, (1, 15), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        dec = StaticDecoder(target)
        dec.forward([prompt[0, :-1]])
        draft.reset()
        assert not draft.adopt_prompt(dec, [prompt[0]])
    assert draft._decoder.lengths == []


def test_copy_from_a_start_keeps_the_columns_before_it():
    target = helpers.tiny_model("llama")
    draft = QuantizedSelf.from_target(target, QuantScheme(bits=4, group_size=32)).model
    src, dst = StaticDecoder(target), StaticDecoder(draft)
    gen = torch.Generator().manual_seed(3)
    prompt, more = torch.randint(3, 300, (12,), generator=gen), torch.randint(3, 300, (5,), generator=gen)
    with torch.inference_mode():
        src.forward([prompt])
        dst.forward([prompt])  # its own keys and values: not the target's
        own = [k[:, :, :12].clone() for k in dst._k + dst._v]
        assert not all(torch.equal(a, b[:, :, :12]) for a, b in zip(own, src._k + src._v))
        src.forward([more])
        assert "first 13 columns" in dst.copy_prefix_from(src, start=13)  # it holds 12
        assert dst.width == 12
        assert dst.copy_prefix_from(src, start=12) is None
    assert dst.lengths == [17] and dst.width == 17
    for mine, kept, theirs in zip(dst._k + dst._v, own, src._k + src._v):
        assert torch.equal(mine[:, :, :12], kept)
        assert torch.equal(mine[:, :, 12:17], theirs[:, :, 12:17])


@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_self_draft_takes_the_targets_keys_and_values_of_every_step(monkeypatch, tree):
    target = helpers.tiny_model("llama")
    prop = QuantizedSelf.from_target(target, QuantScheme(bits=4, group_size=32),
                                     token_ids=torch.arange(0, 40))
    prompt = torch.randint(3, 300, (1, 13), generator=torch.Generator().manual_seed(4))
    want = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24)
    steps = []

    def record(self, decoder, sequences):
        mine, theirs = self._decoder, decoder
        steps.append(mine.lengths == theirs.lengths == [len(sequences[0]) - 1] and all(
            torch.equal(a[:, :, : mine.width], b[:, :, : mine.width])
            for a, b in zip(mine._k + mine._v, theirs._k + theirs._v)))

    _after(monkeypatch, "adopt_accepted", record)
    out, stats = speculative_generate(target, prop, prompt, max_new_tokens=24, k=3, tree=tree)
    assert torch.equal(out, want)
    assert len(steps) == stats.target_calls and all(steps[:-1])  # the last step may stop early
    assert stats.cache_copies == 1 + stats.target_calls  # the prompt's and every step's
    assert stats.accepted > 0


def test_rows_with_holes_keep_sharing_and_the_output_stays_the_targets(monkeypatch):
    target = helpers.tiny_model("llama")
    prop = QuantizedSelf.from_target(target, QuantScheme(bits=3, group_size=32))
    gen = torch.Generator().manual_seed(6)
    rows = [torch.randint(3, 300, (n,), generator=gen) for n in (11, 8)]
    ids, mask = torch.zeros(2, 11, dtype=torch.int64), torch.zeros(2, 11, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, 11 - len(r):], mask[b, 11 - len(r):] = r, 1
    want = [target.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.int64), do_sample=False,
                            max_new_tokens=16)[0, len(r):] for r in rows]
    steps = []

    def record(self, decoder, sequences):
        mine, theirs = self._decoder, decoder
        steps.append((mine.lengths == theirs.lengths, theirs.mask is not None and torch.equal(mine.mask, theirs.mask),
                      all(torch.equal(a[:, :, : mine.width], b[:, :, : mine.width])
                          for a, b in zip(mine._k + mine._v, theirs._k + theirs._v))))

    _after(monkeypatch, "adopt_accepted", record)
    out, stats = speculative_generate(target, prop, ids, mask, max_new_tokens=16, k=3)
    for b in range(2):
        assert torch.equal(out[b, 11: 11 + len(want[b])], want[b]), b
    assert len(steps) == stats.target_calls > 1 and all(all(s) for s in steps)
    assert stats.cache_copies == 1 + stats.target_calls


@pytest.mark.parametrize("arch,dtype", [("phi", torch.float32), ("gpt_neox", torch.bfloat16), ("bloom", torch.float32)])
def test_undeclared_families_share_through_transformers_cache(monkeypatch, arch, dtype):
    """Families the static decoder does not declare run through ``KVDecoder``: its copy takes the
    target's tensors by reference, cast to the draft's dtype (a bf16 draft of an fp32 target)."""
    target = helpers.tiny_model(arch)
    prop = QuantizedSelf.from_target(target, QuantScheme(bits=4, group_size=32), dtype=dtype)
    prompt = torch.randint(3, 300, (1, 13), generator=torch.Generator().manual_seed(4))
    want = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20)
    steps = []

    def record(self, decoder, sequences):
        mine, theirs = self._decoder, decoder
        assert isinstance(mine, KVDecoder) and isinstance(theirs, KVDecoder)
        steps.append(mine.lengths == theirs.lengths and torch.equal(mine.mask, theirs.mask) and all(
            a.keys.dtype == dtype and torch.equal(a.keys, b.keys.to(dtype)) and torch.equal(a.values, b.values.to(dtype))
            for a, b in zip(mine.cache.layers, theirs.cache.layers)))

    _after(monkeypatch, "adopt_accepted", record)
    out, stats = speculative_generate(target, prop, prompt, max_new_tokens=20, k=3)
    assert torch.equal(out, want)
    assert all(steps) and stats.cache_copies == 1 + stats.target_calls == 1 + len(steps)


def test_transformers_cache_refusals_leave_the_decoder_as_it_was():
    model = helpers.tiny_model("phi")
    dst = KVDecoder(model)
    with torch.inference_mode():
        dst.forward([torch.arange(3, 10)])
        other = KVDecoder(helpers.tiny_model("phi", num_hidden_layers=3))
        other.forward([torch.arange(3, 12)])
        assert "layers, heads" in dst.copy_prefix_from(other)
        static = StaticDecoder(helpers.tiny_model("llama"))
        static.forward([torch.arange(3, 12)])
        assert "not a KVDecoder" in dst.copy_prefix_from(static)
        sliding = KVDecoder(helpers.tiny_model("mistral", sliding_window=4))
        sliding.forward([torch.arange(3, 12)])
        assert "sliding-window" in KVDecoder(helpers.tiny_model("mistral", sliding_window=4)).copy_prefix_from(sliding)
    assert dst.lengths == [7] and dst.columns == 7
