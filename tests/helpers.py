"""Tiny offline models and tokenizers for tests (no downloads, no assets).

``make_tiny_tokenizer()`` trains a byte-level BPE (any text encodes, no unknown tokens) on a
few sentences; ``tiny_model(arch, seed, **overrides)`` is a 2-layer random causal LM of that
family (``tiny_config``: the one place the tests' tiny sizes are written), and
``make_tiny_model(tmp_path, arch)`` saves one with the tokenizer, in a folder
``load_dense``/``from_pretrained`` can read.
``missing_asset(reason)`` is what a test does when something it needs is absent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import torch

TINY_VOCAB = 320  # 256 byte symbols + merges + 3 specials
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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

    All Linear input sizes (64, 128) are divisible by 32. ``overrides`` replace any field.
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
    }
    if arch not in per_arch:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    cls_name, extra = per_arch[arch]
    kwargs = {**common, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


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


def make_tiny_model(tmp_path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save ``tiny_model(arch, seed, **overrides)`` (fp32 safetensors) + tokenizer to
    ``tmp_path/tiny-<arch>``; returns the folder."""
    tokenizer = make_tiny_tokenizer()
    model = tiny_model(arch, seed, **overrides)
    folder = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
