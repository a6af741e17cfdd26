"""``Decoder``: the one interface of quantspec's decoders, incremental forward passes of a causal LM
over a batch of B rows with a KV cache the decoder owns.

Implementations: ``runtime.decoder.StaticDecoder`` (the static-cache forward of a declared
family), ``runtime.kv.KVDecoder`` (transformers' forward with per-row rollback; speculative
decoding drafts and verifies through it or the static one) and ``runtime.kv.PlainDecoder``
(transformers' forward with nothing added, every row in step: the speed bench's baseline).
Callers (``specdec``, ``eval.speed``) hold a ``Decoder`` and use only what is declared here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Decoder(ABC):
    """Incremental forward passes over a batch of rows.

    ``lengths[b]``: the tokens row b holds in the cache (empty before the first ``forward``).
    """

    lengths: list[int]

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the model's weights and the cache are."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every row; the next ``forward`` starts a new batch."""

    @abstractmethod
    def forward(self, chunks: list[torch.Tensor], keep: int = 0) -> torch.Tensor:
        """Feed ``chunks[b]`` (int64 [T_b]) to row b after what it holds; returns logits
        [B, T, V], T = max T_b, row b's in its last T_b positions (``keep`` > 0: the last
        ``keep`` positions only). A batch of another size than the cache holds starts afresh."""

    def forward_features(self, chunks: list[torch.Tensor], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the features they were computed from: the final-normed
        hidden states [B, T, H] the LM head reads, for the same positions (feature-level drafts
        such as EAGLE heads draft from them). Decoders that cannot expose them raise."""
        raise NotImplementedError(f"{type(self).__name__} does not expose the target's features")

    def step(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Every row takes the T tokens of its row of ``ids`` (int64 [B, T]): the logits of
        ``forward(list(ids), keep)``, which this is unless overridden (``PlainDecoder`` hands
        ``ids`` to the model whole)."""
        return self.forward(list(ids), keep)

    @abstractmethod
    def drop_last(self, counts: list[int]) -> None:
        """Forget the last ``counts[b]`` tokens of each row (rejected drafts)."""
