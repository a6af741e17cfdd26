"""A self-draft starts from the target's cache of the prompt (``Decoder.copy_prefix_from``,
``DraftModel.adopt_prompt``): no prefill of its own.

Copying a cache between decoders of the same model must change nothing (the next logits the same
bits as the source's own); decoders whose blocks differ refuse with the reason; in the loop, the
self-draft holds exactly the target's keys and values of the prompt, greedy output stays the
target's, and its pruned head still scores the prompt's tokens.
"""

from __future__ import annotations

import helpers
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.runtime.decoder import StaticDecoder
from quantspec.runtime.kv import KVDecoder
from quantspec.specdec import speculative_generate
from quantspec.specdec.proposers import DraftModel
from quantspec.specdec.selfdraft import QuantizedSelf


def test_copy_from_the_same_model_changes_nothing():
    model = helpers.tiny_model("qwen2")
    src, dst = StaticDecoder(model), StaticDecoder(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (19,), generator=gen)
    with torch.inference_mode():
        src.forward([prompt])
        assert dst.copy_prefix_from(src) is None
        assert dst.lengths == src.lengths == [19] and dst.width == 19
        for n in (1, 4, 1):
            ids = torch.randint(3, 300, (n,), generator=gen)
            assert torch.equal(dst.forward([ids]), src.forward([ids]))


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
        rows = StaticDecoder(model)
        rows.forward([torch.arange(3, 8), torch.arange(3, 6)])  # ragged rows: holes
        assert "holes" in dst.copy_prefix_from(rows)
    assert dst.lengths == [7]


def test_self_draft_adopts_the_targets_prompt_cache(monkeypatch):
    target = helpers.tiny_model("llama")
    prop = QuantizedSelf.from_target(target, QuantScheme(bits=4, group_size=32),
                                     token_ids=torch.arange(0, 40))
    prompt = torch.randint(3, 300, (1, 21), generator=torch.Generator().manual_seed(1))
    want = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    seen = {}
    adopt = DraftModel.adopt_prompt

    def spy(self, decoder, sequences):
        adopt(self, decoder, sequences)
        seen["target"] = [k[:, :, :20].clone() for k in decoder._k]
        seen["draft"] = [k[:, :, :20].clone() for k in self._decoder._k]
        seen["scored"] = bool(self.pruned.scored[prompt[0, :-1]].all())

    monkeypatch.setattr(DraftModel, "adopt_prompt", spy)
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
        draft.adopt_prompt(dec, [prompt[0]])
    assert draft._decoder.lengths == []
