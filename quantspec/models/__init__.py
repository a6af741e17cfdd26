"""Model sources: hub ids, local HF folders, GGUF files and built-in aliases -> dense HF models.

``models.load.load_model`` (a quantized folder or a dense spec) is imported from its module: it
sits above ``checkpoint`` (which imports this package).
"""

from .aliases import ALIASES, DEFAULT_ALIAS
from .source import ModelInfo, dense_folder, load_dense, model_slug, resolve_device, resolve_dtype
from .source import _load_tokenizer as load_tokenizer
from .paths import cache_root

__all__ = ["ALIASES", "DEFAULT_ALIAS", "ModelInfo", "dense_folder", "load_dense", "model_slug", "resolve_device", "resolve_dtype",
           "load_tokenizer", "cache_root"]
