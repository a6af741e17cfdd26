"""Calibration samples: ``n`` token windows of ``seqlen`` tokens, deterministic in ``seed``.

Document sets (c4, .jsonl): as in the GPTQ paper's C4 sampling (Frantar et al. 2022,
datautils.get_c4), each sample is a random window of a random document with at least
``seqlen`` tokens (documents drawn without replacement here); when too few documents are that
long, the rest are random windows of all documents concatenated with "\\n\\n".
Running text (wikitext2, pydoc, .txt): random windows of the whole tokenized text.
A mixture ``a+b`` (e.g. ``c4+python-stdlib``): the samples split evenly over its sources, each
drawn as above with the same seed, in the order written.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from ..errors import QuantspecError
from .sources import TextSource, load_text
from .tokens import cached_token_ids, encode_text


MIX = "+"  # joins the sources of a mixture


def _check(n: int, seqlen: int) -> None:
    if n < 1 or seqlen < 2:
        raise QuantspecError(f"need at least 1 sample of at least 2 tokens, got n={n}, seqlen={seqlen}.",
                             "pass a positive number of samples and a sequence length >= 2.")


def _random_windows(ids: torch.Tensor, n: int, seqlen: int, gen: torch.Generator, label: str) -> torch.Tensor:
    """``n`` windows [n, seqlen] at uniform random starts of the 1-D ``ids``."""
    total = ids.numel()
    if total < n * seqlen:
        raise QuantspecError(
            f"calibration data '{label}' has {total} tokens, fewer than n x seqlen = {n} x {seqlen} = {n * seqlen}.",
            f"lower the number of samples or the sequence length (at most {total // seqlen} samples of {seqlen} "
            "tokens fit), or use a larger dataset.",
        )
    starts = torch.randint(0, total - seqlen + 1, (n,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def _draw(length_of: Callable[[int], int], count: int, n: int, seqlen: int,
          gen: torch.Generator) -> Iterator[tuple[int, int | None]]:
    """The document draw, in visiting order: (document index, window start), start None for a
    document shorter than ``seqlen`` (read, not sampled); stops after ``n`` windows."""
    taken = 0
    for index in torch.randperm(count, generator=gen).tolist():
        length = length_of(index)
        if length < seqlen:
            yield index, None
            continue
        yield index, int(torch.randint(0, length - seqlen + 1, (1,), generator=gen))
        taken += 1
        if taken == n:
            return


def _document_windows(tokenizer, source: TextSource, n: int, seqlen: int, gen: torch.Generator) -> torch.Tensor:
    docs = source.documents or []
    encoded = functools.lru_cache(maxsize=None)(lambda i: encode_text(tokenizer, docs[i]))
    samples = [encoded(i)[s : s + seqlen] for i, s in _draw(lambda i: encoded(i).numel(), len(docs), n, seqlen, gen)
               if s is not None]
    if len(samples) == n:
        return torch.stack(samples)
    rest = _random_windows(cached_token_ids(tokenizer, source), n - len(samples), seqlen, gen, source.label)
    return torch.cat([torch.stack(samples), rest]) if samples else rest


def documents_outside_draw(lengths: Sequence[int], n: int, seqlen: int, seed: int = 0) -> list[int]:
    """Indices (ascending) of the documents that ``calibration_samples(tok, docs, n, seqlen,
    seed)`` never reads, given each document's token count under ``tok`` (``lengths``).

    Every document the draw visits counts as read, a short one it skips included; when fewer
    than ``n`` documents are long enough, the draw falls back to windows of all documents
    joined, and none is outside it (``[]``).
    """
    gen = torch.Generator().manual_seed(seed)
    drawn = list(_draw(lambda i: lengths[i], len(lengths), n, seqlen, gen))
    if sum(s is not None for _, s in drawn) < n:
        return []
    read = {i for i, _ in drawn}
    return [i for i in range(len(lengths)) if i not in read]


def calibration_samples(tokenizer, data: str | TextSource, n: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """Token windows for calibration: LongTensor [n, seqlen]; same (data, n, seqlen, seed) -> same ids.

    ``data`` is a name for ``load_text`` (wikitext2, c4, pydoc, python-stdlib, a .txt/.jsonl
    path), a mixture of names joined by ``+``, or a TextSource. Too little data raises QuantspecError saying how much there is.
    """
    _check(n, seqlen)
    if isinstance(data, str) and MIX in data and not Path(data).expanduser().exists():
        parts = [p.strip() for p in data.split(MIX)]
        if not all(parts) or n < len(parts):
            raise QuantspecError(f"calibration data '{data}' is not a mixture of {n} sample(s).",
                                 "join source names with +, e.g. c4+python-stdlib, with at least one sample each.")
        counts = [n // len(parts) + (i < n % len(parts)) for i in range(len(parts))]
        return torch.cat([calibration_samples(tokenizer, p, c, seqlen, seed) for p, c in zip(parts, counts)])
    source = data if isinstance(data, TextSource) else load_text(data)
    gen = torch.Generator().manual_seed(seed)
    if source.documents:
        return _document_windows(tokenizer, source, n, seqlen, gen).long()
    return _random_windows(cached_token_ids(tokenizer, source), n, seqlen, gen, source.label).long()
