"""Model sources: hub ids, local HF folders, GGUF files and built-in aliases -> dense HF models."""

from .aliases import ALIASES, DEFAULT_ALIAS
from .source import ModelInfo, dense_folder, load_dense, model_slug, resolve_device, resolve_dtype
from .source import _load_tokenizer as load_tokenizer
from .load import load_model, model_label
from .paths import cache_root

__all__ = ["ALIASES", "DEFAULT_ALIAS", "ModelInfo", "dense_folder", "load_dense", "model_slug", "resolve_device", "resolve_dtype",
           "load_tokenizer", "load_model", "model_label", "cache_root"]
