"""Model sources: hub ids, local HF folders, GGUF files and built-in aliases -> dense HF models."""

from .aliases import ALIASES, DEFAULT_ALIAS
from .source import ModelInfo, dense_folder, load_dense, model_slug, resolve_device, resolve_dtype
from .source import _load_tokenizer as load_tokenizer

__all__ = ["ALIASES", "DEFAULT_ALIAS", "ModelInfo", "dense_folder", "load_dense", "model_slug", "resolve_device", "resolve_dtype", "load_tokenizer"]
