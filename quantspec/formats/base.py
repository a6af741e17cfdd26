"""The contract every checkpoint format follows.

A format turns a ``QuantResult`` into named tensors (``pack``) and back (``unpack``), exactly:
``unpack(pack(r), ...)`` equals ``r`` tensor for tensor. It never quantizes. It also says which
(scheme, shape) it can hold, which tensors a layer has (for building modules on the meta
device), and writes/reads the ``quantization_config`` of ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..core.scheme import QuantResult, QuantScheme


@dataclass
class FormatConfig:
    """What a checkpoint's ``quantization_config`` says, parsed.

    scheme: the weight scheme of the quantized layers. ignore: module names left dense
    (full dotted names, e.g. ``lm_head``). extra: format-specific fields kept as read.
    """

    format: str
    scheme: QuantScheme
    ignore: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    # (regex fully matching a module name, scheme) pairs that override ``scheme`` per layer,
    # e.g. a group size that divides the layer's K; first match wins.
    overrides: list[tuple[str, QuantScheme]] = field(default_factory=list)

    def scheme_for(self, module_name: str) -> QuantScheme:
        import re

        for pattern, scheme in self.overrides:
            if re.fullmatch(pattern, module_name):
                return scheme
        return self.scheme


class Format(Protocol):
    name: str

    def cannot_hold(self, scheme: QuantScheme, out_features: int, in_features: int) -> str | None:
        """None when a [N, K] layer with this scheme fits the format, else the reason."""

    def tensor_specs(
        self, scheme: QuantScheme, out_features: int, in_features: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the tensors one quantized Linear holds in a checkpoint."""

    def pack(self, result: QuantResult) -> dict[str, torch.Tensor]:
        """The tensors of one layer, named relative to the module (e.g. ``qweight``)."""

    def unpack(
        self,
        tensors: dict[str, torch.Tensor],
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
    ) -> QuantResult:
        """Exact inverse of ``pack``."""

    def quantization_config(self, scheme: QuantScheme, ignore: list[str]) -> dict:
        """The ``quantization_config`` entry of config.json that the format's loaders read."""

    def parse_config(self, config: dict) -> FormatConfig:
        """Read a ``quantization_config``; raise QuantspecError for what we do not support."""
