"""Data sources: named datasets, the built-in fallback corpus and local files -> text and tokens."""

from .calibration import calibration_samples
from .sources import TextSource, load_text
from .tokens import cached_token_ids, tokenizer_fingerprint

__all__ = ["TextSource", "load_text", "calibration_samples", "cached_token_ids", "tokenizer_fingerprint"]
