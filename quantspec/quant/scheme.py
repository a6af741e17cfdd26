"""Quantization schemes and the canonical unpacked result of every algorithm.

Conventions (shared by every algorithm, format and kernel):

* Integer codes are **unsigned**, ``q in [0, 2**bits - 1]``, stored as ``torch.uint8``.
* Dequantization: ``w[n, k] = scales[n, g] * (q[n, k] - z[n, g])`` with ``g = g_idx[k]``.
* Symmetric schemes have no stored zeros: ``z = 2**(bits - 1)`` (so the signed value is
  ``q - 2**(bits-1)`` in ``[-2**(bits-1), 2**(bits-1) - 1]``, the compressed-tensors value).
* Asymmetric schemes store integer zeros ``z in [0, 2**bits - 1]`` as ``torch.uint8``.
* ``scales`` are stored in the dtype the checkpoint will hold (``torch.float16`` by default),
  and algorithms quantize with those rounded scales, so ``unpack(pack(r)) == r`` is exact.
"""

from __future__ import annotations

from dataclasses import replace, asdict, dataclass, field
from typing import Any

import torch

from ..errors import QuantspecError
from ..strict import reject_unknown

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
ACTIVATION_SCHEMES = (None, "int8-token-dynamic")


@dataclass(frozen=True)
class QuantScheme:
    """How weights (and optionally activations) are quantized.

    bits: 2, 3, 4 or 8. group_size: -1 (one group per output channel) or 32/64/128 input
    columns per group. symmetric: no stored zero point. act_order: GPTQ's desc_act (columns
    processed in order of decreasing Hessian diagonal; the checkpoint carries g_idx).
    static_groups: with act_order, groups are fixed before reordering so g_idx stays
    ``k // group_size``. activations: None (weight-only) or "int8-token-dynamic" (W8A8).
    """

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    static_groups: bool = False
    activations: str | None = None

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise QuantspecError(
                f"bits={self.bits} is not supported.", f"use one of {list(SUPPORTED_BITS)}."
            )
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise QuantspecError(
                f"group_size={self.group_size} is not supported.",
                f"use one of {list(SUPPORTED_GROUP_SIZES)} (-1 = per output channel).",
            )
        if self.activations not in ACTIVATION_SCHEMES:
            raise QuantspecError(
                f"activations={self.activations!r} is not supported.",
                "use null (weight-only) or 'int8-token-dynamic'.",
            )
        if self.activations is not None and (self.bits != 8 or not self.symmetric):
            raise QuantspecError(
                "int8 activations need symmetric 8-bit weights (W8A8).",
                "set bits=8 and symmetric=true, or drop the activation scheme.",
            )
        if self.activations is not None and self.group_size != -1:
            raise QuantspecError(
                "W8A8 uses one weight scale per output channel.", "set group_size=-1."
            )
        if self.static_groups and not self.act_order:
            raise QuantspecError(
                "static_groups only has a meaning together with act_order.",
                "set act_order=true or static_groups=false.",
            )

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        """The implicit zero point of symmetric codes."""
        return 1 << (self.bits - 1)

    def group_len(self, in_features: int) -> int:
        """Input columns per group for a layer with ``in_features`` columns."""
        return in_features if self.group_size == -1 else self.group_size

    def num_groups(self, in_features: int) -> int:
        g = self.group_len(in_features)
        return (in_features + g - 1) // g

    @property
    def short_name(self) -> str:
        """e.g. ``w4g128``, ``w4g128-asym``, ``w8a8``."""
        if self.activations:
            return "w8a8"
        g = "pc" if self.group_size == -1 else str(self.group_size)
        name = f"w{self.bits}g{g}"
        if not self.symmetric:
            name += "-asym"
        if self.act_order:
            name += "-actorder"
        return name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantScheme":
        reject_unknown(cls, data, "scheme")
        return cls(**data)


@dataclass
class QuantResult:
    """The canonical unpacked result of every algorithm, for one Linear of shape [N, K].

    qweight: uint8 [N, K] codes in [0, 2**bits - 1].
    scales:  [N, G] floating (the dtype the checkpoint stores, fp16 by default).
    zeros:   uint8 [N, G] integer zero points, or None for symmetric schemes.
    g_idx:   int32 [K] group of each input column, or None for ``k // group_len``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: QuantScheme = field(default_factory=QuantScheme)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    def to(self, device: torch.device | str) -> "QuantResult":
        """The same result with every tensor on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, qweight=move(self.qweight), scales=move(self.scales),
                       zeros=move(self.zeros), g_idx=move(self.g_idx))

    def group_index(self) -> torch.Tensor:
        """int64 [K]: the group of each input column."""
        n, k = self.qweight.shape
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        return torch.arange(k, device=self.qweight.device) // self.scheme.group_len(k)

    def zero_points(self) -> torch.Tensor:
        """[N, G] zero points as float (the implicit one for symmetric schemes)."""
        if self.zeros is not None:
            return self.zeros.to(torch.float32)
        return torch.full(self.scales.shape, float(self.scheme.sym_zero), device=self.scales.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight this result stands for (the reference)."""
        gi = self.group_index()
        s = self.scales.to(torch.float32)[:, gi]
        z = self.zero_points()[:, gi]
        return ((self.qweight.to(torch.float32) - z) * s).to(dtype)

    def validate(self) -> None:
        """Raise ValueError when shapes, dtypes or ranges disagree with the scheme."""
        n, k = self.qweight.shape
        g = self.scheme.num_groups(k) if self.g_idx is None else int(self.g_idx.max()) + 1
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be uint8, got {self.qweight.dtype}")
        if int(self.qweight.max()) > self.scheme.maxq:
            raise ValueError(f"codes exceed {self.scheme.bits} bits")
        if self.scales.shape != (n, g):
            raise ValueError(f"scales shape {tuple(self.scales.shape)} != {(n, g)}")
        if self.scheme.symmetric != (self.zeros is None):
            raise ValueError("zeros must be None exactly when the scheme is symmetric")
        if self.zeros is not None and self.zeros.shape != (n, g):
            raise ValueError(f"zeros shape {tuple(self.zeros.shape)} != {(n, g)}")
        if self.g_idx is not None and self.g_idx.shape != (k,):
            raise ValueError(f"g_idx shape {tuple(self.g_idx.shape)} != {(k,)}")

    def equal(self, other: "QuantResult") -> bool:
        """Exact equality of every tensor and of the scheme."""

        def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

        return (
            self.scheme == other.scheme
            and same(self.qweight, other.qweight)
            and same(self.scales, other.scales)
            and same(self.zeros, other.zeros)
            and same(self.g_idx, other.g_idx)
        )
