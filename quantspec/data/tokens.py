"""Tokenize a whole text once and cache the ids on disk.

Key: (tokenizer fingerprint, text label, sha256 of the text), so a changed tokenizer or file
never reuses stale ids. Files: ``$QUANTSPEC_CACHE/tokens/<key>.pt`` (int32 ids, 1-D), written
to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import torch

from ..checkpoint.atomic import atomic_write_bytes
from ..models.paths import cache_root
from .sources import TextSource

CACHE_MIN_CHARS = 100_000  # shorter texts tokenize in milliseconds: not worth a cache file


def tokenizer_fingerprint(tokenizer) -> str:
    """A sha256 (16 hex) of what decides the tokenization: vocab/merges/normalizers and specials."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {"bos": tokenizer.bos_token, "eos": tokenizer.eos_token,
                "add_bos": getattr(tokenizer, "add_bos_token", None)}
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def encode_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids (int64, 1-D) of ``text`` with the tokenizer's default special tokens (BOS if any)."""
    ids = tokenizer(text, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def cached_token_ids(tokenizer, source: TextSource, cache_dir: Path | None = None,
                     min_chars: int | None = None) -> torch.Tensor:
    """Token ids (int64, 1-D) of ``source.text``, from the disk cache when present.

    Texts shorter than ``min_chars`` (default CACHE_MIN_CHARS) are tokenized every time (fast,
    and keeps one-off files out of the cache).
    """
    if len(source.text) < (CACHE_MIN_CHARS if min_chars is None else min_chars):
        return encode_text(tokenizer, source.text)
    text_hash = hashlib.sha256(source.text.encode("utf-8")).hexdigest()[:16]
    slug = re.sub(r"[^a-z0-9]+", "-", source.label.lower()).strip("-")[:40]
    folder = (cache_dir or cache_root()) / "tokens"
    path = folder / f"{slug}-{tokenizer_fingerprint(tokenizer)}-{text_hash}.pt"
    if path.is_file():
        try:
            return torch.load(path, weights_only=True).long()
        except Exception:
            path.unlink(missing_ok=True)  # truncated or foreign file: rebuild it
    ids = encode_text(tokenizer, source.text)
    _write_atomic(path, ids.to(torch.int32))
    return ids


def _write_atomic(path: Path, ids: torch.Tensor) -> None:
    """torch.save to a temporary sibling, then rename; a read-only cache is silently skipped."""
    buffer = io.BytesIO()
    torch.save(ids, buffer)
    try:
        atomic_write_bytes(path, buffer.getvalue(), mode=0o644)
    except OSError:
        pass  # costs only the re-tokenization next time
