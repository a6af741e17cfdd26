"""Tiny offline models and tokenizers for tests (no downloads, no assets).

``make_tiny_tokenizer()`` trains a byte-level BPE (any text encodes, no unknown tokens) on a
few sentences; ``tiny_model(arch, seed, **overrides)`` is a 2-layer random causal LM of that
family (``tiny_config``: the one place the tests' tiny sizes are written), and
``make_tiny_model(tmp_path, arch)`` saves one with the tokenizer, in a folder
``load_dense``/``from_pretrained`` can read.
``missing_asset(reason)`` is what a test does when something it needs is absent;
``act_order_result(w, scheme)`` a GPTQ-style act-order QuantResult without calibration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import torch

TINY_VOCAB = 320  # 256 byte symbols + merges + 3 specials
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
# mixture-of-experts families whose experts quantspec quantizes (models/experts.py LAYOUTS)
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss",
             "granitemoe")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantization maps weights to a small grid of integers with a scale per group.",
    "Speculative decoding proposes tokens with a draft model and verifies them with the target.",
    "Perplexity is the exponential of the mean negative log-likelihood per token.",
    "Once upon a time there was a little model that wanted to be fast and small.",
    "def forward(self, x):\n    return self.linear(x) + 1\n",
] * 4


def missing_asset(reason: str) -> NoReturn:
    """Skip the calling test with ``reason`` (a real model, data, an engine venv, a compiler is
    absent), or fail it when the environment sets QUANTSPEC_REQUIRE_ASSETS=1 (CI that must
    exercise them)."""
    import pytest  # here: benchmarks import this module without pytest

    if os.environ.get("QUANTSPEC_REQUIRE_ASSETS", "").strip() in {"1", "true", "yes"}:
        pytest.fail(f"required asset missing (QUANTSPEC_REQUIRE_ASSETS=1): {reason}", pytrace=False)
    pytest.skip(reason)


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB):
    """A PreTrainedTokenizerFast (byte-level BPE) with bos "<s>", eos "</s>", pad "<pad>".

    Deterministic: the same merges on every call. len(tokenizer) <= vocab_size.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=4096)


def tiny_config(arch: str = "llama", vocab_size: int = TINY_VOCAB, **overrides):
    """A transformers config for a 2-layer model: hidden 64, intermediate 128, 4 heads (2 KV).
    MoE families: 8 experts of intermediate 32, top-2 (DeepSeek/GLM: one shared expert, the
    first block dense; DeepSeek's MLA attention with all 4 KV heads).

    Families with no declaration (``UNDECLARED``: OPT, GPT-J, GPT-2, GPT-NeoX, Falcon, Phi,
    Cohere, Bloom) get the same hidden size, layers and heads in their own field names.

    All Linear input sizes (64, 128, 32) are divisible by 32. ``overrides`` replace any field.
    """
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    gemma = {"head_dim": 16, "sliding_window": 64, "query_pre_attn_scalar": 16}
    per_arch = {
        "llama": ("LlamaConfig", {}),
        "qwen2": ("Qwen2Config", {}),
        "qwen3": ("Qwen3Config", {"head_dim": 16}),
        "mistral": ("MistralConfig", {"sliding_window": None}),
        "gemma2": ("Gemma2Config", gemma),
        "gemma3_text": ("Gemma3TextConfig", gemma),
        "phi3": ("Phi3Config", {}),
        **_moe_configs(),
    }
    if arch in UNDECLARED:  # their own field names: only the sizes every config reads
        cls_name, extra = UNDECLARED[arch]
        common = {k: common[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                         "num_attention_heads", "pad_token_id", "bos_token_id",
                                         "eos_token_id")}
    elif arch in per_arch:
        cls_name, extra = per_arch[arch]
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from "
                         f"{ARCHS + tuple(_moe_configs()) + tuple(UNDECLARED)}")
    kwargs = {**common, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


# families quantspec has no declaration for (quant/arch_infer.py infers them): config class and
# the fields of their own names (FFN width 128, 2 KV heads where the family has them); tied
# embeddings as the family's default
UNDECLARED = {
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64, "max_position_embeddings": 128}),
    "gptj": ("GPTJConfig", {"n_inner": 128, "rotary_dim": 8, "n_positions": 128}),
    "gpt2": ("GPT2Config", {"n_inner": 128, "n_positions": 128}),
    "gpt_neox": ("GPTNeoXConfig", {"intermediate_size": 128}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "phi": ("PhiConfig", {"intermediate_size": 128}),
    "cohere": ("CohereConfig", {"intermediate_size": 128, "num_key_value_heads": 2}),
    "bloom": ("BloomConfig", {}),
}


def _moe_configs() -> dict[str, tuple[str, dict]]:
    experts = {"num_experts_per_tok": 2}
    qwen = {**experts, "num_experts": 8, "moe_intermediate_size": 32}
    local = {**experts, "num_local_experts": 8, "intermediate_size": 32}
    shared = {**experts, "n_routed_experts": 8, "moe_intermediate_size": 32, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    mla = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
           "v_head_dim": 16}
    return {
        "qwen3_moe": ("Qwen3MoeConfig", {**qwen, "head_dim": 16, "norm_topk_prob": True}),
        "qwen2_moe": ("Qwen2MoeConfig", {**qwen, "shared_expert_intermediate_size": 64}),
        "mixtral": ("MixtralConfig", {**local, "sliding_window": None}),
        "olmoe": ("OlmoeConfig", {**experts, "num_experts": 8, "intermediate_size": 32}),
        "deepseek_v3": ("DeepseekV3Config", {**shared, **mla, "q_lora_rank": 32}),
        "deepseek_v2": ("DeepseekV2Config", {**shared, **mla, "q_lora_rank": None}),
        "glm4_moe": ("Glm4MoeConfig", {**shared, "head_dim": 16}),
        "gpt_oss": ("GptOssConfig", {**local, "head_dim": 16, "sliding_window": 64}),
        "granitemoe": ("GraniteMoeConfig", local),
        # not in MOE_ARCHS: its grouped o_a_proj (a Linear subclass with its own forward) stays dense
        "deepseek_v4": ("DeepseekV4Config", {**experts, "n_routed_experts": 8, "moe_intermediate_size": 32,
                                             "n_shared_experts": 1, "head_dim": 16, "num_key_value_heads": 1,
                                             "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
                                             "qk_rope_head_dim": 8, "sliding_window": 64, "index_n_heads": 4,
                                             "index_head_dim": 16}),
    }


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random fp32 ``arch`` causal LM (``tiny_config(arch, **overrides)``) in eval mode.

    Weights are drawn under ``seed`` without touching the global RNG: the same on every call.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


# a family's tiny model by its config class's own fields (benchmarks/arch_sweep.py FAMILIES)
COMMON = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
# every transformers causal-LM type shrunk (benchmarks/arch_sweep.py --all, specdec_sweep.py --all):
# the width fields set on every config that has them (each family names its own)
SHRINK = dict(COMMON, head_dim=16, n_embd=64, n_layer=2, n_head=4, n_inner=128, d_model=64, ffn_dim=128,
              n_positions=512, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
              num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=16, n_group=1, topk_group=1, sliding_window=64, num_kv_heads=2, multi_query_group_num=2,
              kv_channels=16, rotary_dim=8, word_embed_proj_dim=64, ffn_hidden_size=128,
              expert_intermediate_size=64)


def auto_tiny(model_type: str, **overrides):
    """A shrunk random model of a transformers causal-LM ``model_type``; raises when there is none.
    ``overrides``: fields set beside ``SHRINK``'s (on configs that have them)."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    config = cls(**{k: v for k, v in {**SHRINK, **overrides}.items() if hasattr(base, k)})
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(getattr(config, "layer_types", None), (list, tuple)) and layers:
        config.layer_types = list(config.layer_types)[:layers]
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() for p in meta.parameters())
    widest = max((m.in_features for m in meta.modules() if isinstance(m, torch.nn.Linear)), default=0)
    if size > 20e6 or widest > 8192:
        raise ValueError(f"not tiny: {size / 1e6:.1f}M parameters, a Linear with {widest} inputs")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model(input_ids=torch.randint(3, 300, (1, 16)))
    return model


def make_tiny_model(tmp_path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save ``tiny_model(arch, seed, **overrides)`` (fp32 safetensors) + tokenizer to
    ``tmp_path/tiny-<arch>``; returns the folder."""
    tokenizer = make_tiny_tokenizer()
    model = tiny_model(arch, seed, **overrides)
    folder = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def calib_text(folder: Path) -> Path:
    """A small plain-text calibration file (repeating words, any tokenizer encodes it) in
    ``folder``: ``calibration.data`` for tests that calibrate offline."""
    text = Path(folder) / "calib.txt"
    text.write_text(" ".join(f"token{i % 97} word{i % 13}" for i in range(3000)))
    return text


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors files, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def act_order_result(w: torch.Tensor, scheme, seed: int = 0):
    """A GPTQ-style act-order ``QuantResult`` of ``w`` [N, K] under ``scheme`` (a QuantScheme):
    columns quantized in a random order, groups along it."""
    from quantspec.core.scheme import QuantResult, QuantScheme
    from quantspec.quant.rtn import rtn

    k = w.shape[1]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    plain = QuantScheme(scheme.bits, scheme.group_size, scheme.symmetric)
    r = rtn(w[:, order], plain)
    codes = torch.empty_like(r.qweight)
    codes[:, order] = r.qweight
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // scheme.group_len(k)).to(torch.int32)
    return QuantResult(codes, r.scales, r.zeros, g_idx, scheme)


class Interrupt(Exception):
    """Raised by ``raise_interrupt`` (a forward pre-hook) to stop a calibration run midway."""


def raise_interrupt(*_):
    raise Interrupt
