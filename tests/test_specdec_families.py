"""Speculative decoding on families whose caches or positions are not plain KV columns.

Greedy output equals ``generate``'s, batched rows included, where the cache must roll back past
a sliding window (Gemma 3, after the window is full), holds recurrent states (OLMo-hybrid's
linear attention) or the positions come from column indices (MPT's ALiBi); a model whose
forward cannot decode over a rolled-back cache is refused in one line. Every case here crashed
or returned other tokens before (benchmarks/results/specdec-sweep-all.md has all families).
"""

from __future__ import annotations

import pytest
import torch
from helpers import auto_tiny, tiny_model
from test_specdec_loop import left_pad

from quantspec.errors import QuantspecError
from quantspec.specdec import speculative_generate
from quantspec.specdec.eagle.head import EagleConfig, check_target
from quantspec.specdec.proposers import NGram
from quantspec.specdec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 300, (12,), generator=g), torch.randint(3, 300, (5,), generator=g)
    return [torch.cat([a, a[:4]]), torch.cat([b, b[:3]])]  # repeats: the n-gram draft proposes and gets rejected


def _greedy(model, row: torch.Tensor, new: int) -> list[int]:
    out = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.int64), do_sample=False,
                         max_new_tokens=new)
    return out[0, row.numel():].tolist()


@pytest.mark.parametrize("fast_verify", [True, False])
@pytest.mark.parametrize("family", ["gemma3_text", "olmo_hybrid", "mpt"])
def test_rollback_past_windows_recurrent_states_and_alibi_columns(family, fast_verify):
    """Before: Gemma 3 and OLMo-hybrid raised in ``crop`` (transformers' sliding-window and linear
    attention layers keep no past unless told to), MPT's batch returned other tokens (holes in
    the rectangular cache moved its ALiBi distances)."""
    model = tiny_model(family, sliding_window=8) if family == "gemma3_text" else auto_tiny(family)
    rows, new = _rows(), 30
    refs = [_greedy(model, r, new) for r in rows]
    ids, mask = left_pad(rows)
    out, stats = speculative_generate(model, NGram(max_n=2), ids, attention_mask=mask, max_new_tokens=new, k=3,
                                      fast_verify=fast_verify)
    for b, ref in enumerate(refs):
        assert out[b, ids.shape[1]:ids.shape[1] + len(ref)].tolist() == ref, b
    assert stats.proposed > stats.accepted  # drafts were rejected: the caches rolled back
    assert stats.verifications >= 2 * (new // 4)  # the two rows' calls, each decoded alone, counted together


@pytest.mark.parametrize("family,says", [("rwkv", "kept nothing in the KV cache"),
                                         ("xlm", "refuses incremental decoding")])
def test_models_that_cannot_roll_back_are_refused_in_one_line(family, says):
    """Before: RWKV (its state outside the cache) returned other tokens from the first one; XLM
    raised a bare AssertionError."""
    model = auto_tiny(family)
    with pytest.raises(QuantspecError, match=says) as err:
        speculative_generate(model, NGram(), _rows()[0], max_new_tokens=8, k=3)
    assert "\n" not in str(err.value) and "without a draft" in str(err.value)


def test_eagle_heads_refuse_targets_they_cannot_read_and_default_missing_fields():
    """Factorized embeddings (ELECTRA: 128 wide beside 64-wide hidden states) are refused before
    any training; a config whose RMSNorm epsilon and rotary base are None (Cohere 2) takes the
    head's defaults. Before: a shape error mid-training, and a TypeError."""
    with pytest.raises(QuantspecError, match="embeddings are 128 wide and its hidden states 64"):
        check_target(auto_tiny("electra", is_decoder=True))
    config = auto_tiny("cohere2_moe").config
    head = EagleConfig.for_target(config, 16)
    assert head.rms_eps == config.layer_norm_eps and head.rope_theta > 0


def test_stats_of_rows_decoded_alone_add_up():
    a, b = SpecStats(), SpecStats()
    a.record([2, 0], [3, 3])
    b.record([3], [3])
    a.new_tokens, b.new_tokens, a.wall_s, b.wall_s = 5, 4, 1.0, 0.5
    both = SpecStats.merged([a, b])
    assert (both.verifications, both.proposed, both.accepted, both.new_tokens) == (3, 9, 5, 9)
    assert both.hist == {2: 1, 0: 1, 3: 1} and both.wall_s == 1.5 and both.by_depth()[0]["offered"] == 3


@pytest.mark.parametrize("fast_verify", [True, False])
def test_trees_keep_the_indexer_keys_of_sparse_attention(fast_verify):
    """DeepSeek-V3.2 / GLM-MoE-DSA caches hold an indexer key per column beside keys and values;
    a tree's kept path moves them too. Before: the next forward failed on mismatched lengths."""
    from quantspec.specdec.factory import make_proposer

    model = auto_tiny("glm_moe_dsa", num_key_value_heads=4)  # MLA: as many KV heads as query heads
    row, new = _rows()[0], 16
    ref = _greedy(model, row, new)
    out, stats = speculative_generate(model, make_proposer("self:w4g32", model, vocab=0), row, max_new_tokens=new,
                                      k=3, tree="dynamic", fast_verify=fast_verify)
    assert out[0, row.numel():row.numel() + len(ref)].tolist() == ref and stats.verifications < new


def test_a_draft_longer_than_the_recorded_past_is_refused_before_it_runs():
    from quantspec.specdec.factory import make_proposer

    model = tiny_model("gemma3_text", sliding_window=8)
    with pytest.raises(QuantspecError, match="rolls back at most 64 tokens per forward, and this one feeds 71"):
        speculative_generate(model, make_proposer("self:w4g32", model, vocab=0), _rows()[0], max_new_tokens=90, k=70)


def test_a_kv_quantized_checkpoint_rolls_back_past_its_window(tmp_path):
    """The checkpoint's FP8 KV cache (``new_cache``: a QuantKVCache) records and crops as the plain one."""
    from helpers import make_tiny_model

    import quantspec
    from quantspec.core.kv_config import KVCacheConfig
    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.recipe import CalibrationConfig, Recipe
    from quantspec.runtime.kv import cache_kwarg
    from quantspec.runtime.kv_quant import new_cache

    folder = make_tiny_model(tmp_path, "gemma3_text", sliding_window=8)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["Quantization maps weights to a small grid."] * 300))
    recipe = Recipe(name="t", method="rtn", format="compressed-tensors", scheme=QuantScheme(4, 32, True),
                    calibration=CalibrationConfig(data=str(text), samples=4, seqlen=64),
                    kv_cache=KVCacheConfig("fp8", "tensor", samples=4))
    model = quantspec.load_quantized(quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False,
                                                        device="cpu").out, backend="reference")
    row, new = _rows()[0], 30
    ref = model.generate(row[None], attention_mask=torch.ones(1, row.numel(), dtype=torch.int64), do_sample=False,
                         max_new_tokens=new, **{cache_kwarg(model): new_cache(model)})[0, row.numel():].tolist()
    out, stats = speculative_generate(model, NGram(max_n=2), row, max_new_tokens=new, k=3)
    assert out[0, row.numel():].tolist() == ref and stats.proposed > stats.accepted
