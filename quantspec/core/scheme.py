"""Quantization schemes and the canonical unpacked result of every algorithm.

Conventions (shared by every algorithm, format and kernel):

* Integer codes are **unsigned**, ``q in [0, 2**bits - 1]``, stored as ``torch.uint8``.
* Dequantization: ``w[n, k] = scales[n, g] * (q[n, k] - z[n, g])`` with ``g = g_idx[k]``.
* Symmetric schemes have no stored zeros: ``z = 2**(bits - 1)`` (so the signed value is
  ``q - 2**(bits-1)`` in ``[-2**(bits-1), 2**(bits-1) - 1]``, the compressed-tensors value).
* Asymmetric schemes store integer zeros ``z in [0, 2**bits - 1]`` as ``torch.uint8``.
* ``scales`` are stored in the dtype the checkpoint will hold (``torch.float16`` by default),
  and algorithms quantize with those rounded scales, so ``unpack(pack(r)) == r`` is exact.

Float schemes (``weights`` "fp8", "nvfp4", "mxfp4") keep the same result type with float codes
and scales as ``quant/floatgrid.py`` describes (codes are E4M3 bytes or E2M1 nibbles, symmetric,
no zeros; NVFP4 adds a per-tensor ``global_scale``). FP8 *block* (``weights="fp8"``,
``group_size=128``: DeepSeek-V3's and compressed-tensors' FP8_BLOCK) has one scale per block of
128 rows x 128 columns; its ``scales`` stay [N, K/128] per row, every row of a block holding the
block's scale, so every consumer keeps reading ``scales[n, g]``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..errors import QuantspecError
from ..strict import check_types, reject_unknown
from .floatcodes import dequantize_values

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
FP8_BLOCK = 128  # rows and columns of an FP8 block scale
# per weight type: its bits and the group sizes it allows (None: SUPPORTED_GROUP_SIZES)
WEIGHT_TYPES: dict[str, tuple[int | None, tuple[int, ...] | None]] = {
    "int": (None, None),
    # E4M3FN, fp32 scales: -1 one per output channel; 128 one per block of 128 rows x 128 columns
    # (FP8 block: ``QuantScheme.is_block``; stored per row as [N, K/128])
    "fp8": (8, (-1, FP8_BLOCK)),
    "nvfp4": (4, (16,)),  # E2M1, E4M3 scale per 16 values, fp32 global scale
    "mxfp4": (4, (32,)),  # E2M1, E8M0 (power-of-two) scale per 32 values
}
ACTIVATION_SCHEMES = (None, "int8-token-dynamic", "fp8-token-dynamic", "fp8-tensor-static", "fp8-group-dynamic")
FP8_ACTIVATIONS = ("fp8-token-dynamic", "fp8-tensor-static", "fp8-group-dynamic")
# which fp8 weights each fp8 activation scheme goes with: per channel, or FP8 block
_FP8_ACTIVATIONS_OF = {-1: ("fp8-token-dynamic", "fp8-tensor-static"), FP8_BLOCK: ("fp8-group-dynamic",)}
# MXFP4: how each group's E8M0 exponent is chosen (quant/floatgrid.py ``mx_exponents``): "ocp" the
# OCP rule floor(log2 amax) - 2 (may clip the group max), "ceil" the smaller of it and the next
# exponent that does not clip, "mse" whichever of the two has the smaller squared error, "round"
# llm-compressor's amax rounded to a power of two, "hmse" mse weighted by GPTQ's Hessian diagonal,
# "auto" the rule chosen per kind of method on a validation split (``AUTO_SCALE_RULE``)
MX_SCALE_RULES = ("auto", "ocp", "ceil", "mse", "round", "hmse")
MX_SCALE_RULE = "auto"  # the default; why: docs/decisions/mxfp4-scale-rule.md
# NVFP4: each group's E4M3 scale (quant/floatgrid.py ``nv_group_scales``): "amax" E4M3(amax / 6 x global),
# the cast's nearest (llm-compressor's); "mse" the one of its E4M3 neighbours (one above, two below)
# with the smallest squared error of the group; "auto" amax (mse lost on the validation split:
# docs/decisions/nvfp4-scale-rule.md)
NV_SCALE_RULES = ("auto", "amax", "mse")
SCALE_RULES = {"mxfp4": MX_SCALE_RULES, "nvfp4": NV_SCALE_RULES}
# "auto": data-free rounding (RTN, AWQ's rounding of its scaled weights) -> round; GPTQ -> mse
AUTO_SCALE_RULE = {False: "round", True: "mse"}


def mx_scale_rule(rule: str, calibrated: bool = False) -> str:
    """The concrete MXFP4 rule a method applies: ``rule``, or for "auto" the one of its kind
    (``calibrated``: GPTQ, which rounds with error feedback from calibration data)."""
    return AUTO_SCALE_RULE[calibrated] if rule == "auto" else rule


@dataclass(frozen=True)
class QuantScheme:
    """How weights (and optionally activations) are quantized.

    bits: 2, 3, 4 or 8. group_size: -1 (one group per output channel) or 32/64/128 input
    columns per group. symmetric: no stored zero point. act_order: GPTQ's desc_act (columns
    processed in order of decreasing Hessian diagonal; the checkpoint carries g_idx).
    static_groups: with act_order, groups are fixed before reordering so g_idx stays
    ``k // group_size``. activations: None (weight-only) or "int8-token-dynamic" (W8A8).
    weights: "int", or a float type (``WEIGHT_TYPES``); "fp8" with group_size 128 is FP8 block:
    one scale per 128x128 block (``is_block``), whose activations are weight-only or
    "fp8-group-dynamic" (absmax / 448 per token per 128 input columns, dynamic); per-channel
    fp8 takes "fp8-token-dynamic" or "fp8-tensor-static". scale_rule: how mxfp4 picks each
    group's power-of-two scale (``MX_SCALE_RULES``), nvfp4 its E4M3 scale (``NV_SCALE_RULES``);
    other weight types keep the default. The
    checkpoint's quantization_config cannot tell the rule (the stored exponents mean the same
    whichever chose them): a loaded scheme has the default, the checkpoint's recipe.yaml the rule.
    """

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    static_groups: bool = False
    activations: str | None = None
    weights: str = "int"
    scale_rule: str = MX_SCALE_RULE

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_TYPES:
            raise QuantspecError(
                f"weights={self.weights!r} is not a weight type.", f"use one of {list(WEIGHT_TYPES)}."
            )
        rules = SCALE_RULES.get(self.weights)
        if self.scale_rule != MX_SCALE_RULE and rules is None:
            raise QuantspecError(f"scale_rule={self.scale_rule!r} only applies to mxfp4 and nvfp4 weights (group scales).",
                                 "drop scale_rule, or use --scheme mxfp4 or nvfp4.")
        if rules is not None and self.scale_rule not in rules:
            raise QuantspecError(f"scale_rule={self.scale_rule!r} is not a scale rule of {self.weights} weights.",
                                 f"use one of {list(rules)} (default {MX_SCALE_RULE!r}).")
        if self.is_float:
            self._check_float()
            return
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
        if self.activations in FP8_ACTIVATIONS:
            raise QuantspecError(
                "fp8 activations need fp8 weights.", "set weights='fp8' (e.g. --scheme fp8-dynamic)."
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

    def _check_float(self) -> None:
        bits, groups = WEIGHT_TYPES[self.weights]
        if self.bits != bits:
            raise QuantspecError(f"{self.weights} weights have {bits} bits, not {self.bits}.", f"set bits={bits}.")
        if self.group_size not in groups:
            raise QuantspecError(
                f"{self.weights} weights take group_size {list(groups)}, not {self.group_size}.",
                f"set group_size={groups[0]}.",
            )
        if not self.symmetric:
            raise QuantspecError(f"{self.weights} weights are symmetric (no zero point).", "set symmetric=true.")
        if self.act_order and not self.static_groups:
            raise QuantspecError(
                f"{self.weights} checkpoints store no g_idx: act-order needs static groups.",
                "set static_groups=true (or drop act_order).",
            )
        allowed = _FP8_ACTIVATIONS_OF.get(self.group_size, ()) if self.weights == "fp8" else ()
        if self.activations is not None and self.activations not in allowed:
            raise QuantspecError(
                f"activations={self.activations!r} do not go with {self.weights} weights "
                f"(group_size {self.group_size}).",
                "use fp8-token-dynamic or fp8-tensor-static with per-channel fp8 weights, fp8-group-dynamic "
                "with fp8 block weights (group_size 128), or weight-only.",
            )

    @property
    def static_activations(self) -> bool:
        """Activations quantized with one scale calibrated on data (``QuantResult.input_scale``)."""
        return self.activations == "fp8-tensor-static"

    @property
    def is_block(self) -> bool:
        """FP8 block: one scale per 128 rows x 128 columns (``group_size`` both ways)."""
        return self.weights == "fp8" and self.group_size == FP8_BLOCK

    @property
    def is_float(self) -> bool:
        """FP8 / FP4 weights (``quant/floatgrid.py``) rather than integer codes."""
        return self.weights != "int"

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
        """e.g. ``w4g128``, ``w4g128-asym``, ``w8a8``, ``fp8``, ``fp8-dynamic``, ``fp8-block``,
        ``nvfp4``, ``mxfp4`` (``mxfp4-ocp``, ``mxfp4-ceil``: a scale rule other than the default)."""
        if self.is_block:
            name = "fp8-block" + ("" if self.activations else "-weight")
            return name + ("-actorder" if self.act_order else "")
        if self.is_float:
            name = self.weights + {None: "", "fp8-token-dynamic": "-dynamic", "fp8-tensor-static": "-static"}[self.activations]
            if self.weights in SCALE_RULES and self.scale_rule != MX_SCALE_RULE:
                name += f"-{self.scale_rule}"
            return name + ("-actorder" if self.act_order else "")
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
        """The fields as a dict; ``weights`` only when not "int" and ``scale_rule`` only for mxfp4
        (always there, so a recipe or journal says which rule made it even if the default moves)
        and for nvfp4 when not the default,
        so that other schemes read (recipes, reports, resume and scales-file fingerprints) as they
        did before these fields."""
        d = asdict(self)
        if d["weights"] != "mxfp4" and not (d["weights"] == "nvfp4" and self.scale_rule != MX_SCALE_RULE):
            del d["scale_rule"]
        if d["weights"] == "int":
            del d["weights"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantScheme":
        reject_unknown(cls, data, "scheme")
        check_types(cls, data, "scheme")
        return cls(**data)


# The float schemes by the names the CLI's --scheme takes (compressed-tensors' presets:
# FP8 weight-only, FP8_DYNAMIC, FP8 (static per-tensor activations; weights per channel here),
# FP8_BLOCK (128x128 weight blocks, activations per token per 128 columns) and its weight-only
# variant, NVFP4A16, MXFP4A16).
SCHEME_PRESETS: dict[str, QuantScheme] = {
    "fp8-weight": QuantScheme(bits=8, group_size=-1, weights="fp8"),
    "fp8-dynamic": QuantScheme(bits=8, group_size=-1, weights="fp8", activations="fp8-token-dynamic"),
    "fp8-static": QuantScheme(bits=8, group_size=-1, weights="fp8", activations="fp8-tensor-static"),
    "fp8-block": QuantScheme(bits=8, group_size=FP8_BLOCK, weights="fp8", activations="fp8-group-dynamic"),
    "fp8-block-weight": QuantScheme(bits=8, group_size=FP8_BLOCK, weights="fp8"),
    "nvfp4": QuantScheme(bits=4, group_size=16, weights="nvfp4"),
    "mxfp4": QuantScheme(bits=4, group_size=32, weights="mxfp4"),
}


@dataclass
class QuantResult:
    """The canonical unpacked result of every algorithm, for one Linear of shape [N, K].

    qweight: uint8 [N, K] codes in [0, 2**bits - 1].
    scales:  [N, G] floating (the dtype the checkpoint stores, fp16 by default).
    zeros:   uint8 [N, G] integer zero points, or None for symmetric schemes.
    g_idx:   int32 [K] group of each input column, or None for ``k // group_len``.
    global_scale: fp32 [1], NVFP4 only (``quant/floatgrid.py``); None otherwise.
    input_scale: fp32 [1], the calibrated activation scale of static activation schemes
    (``fp8-tensor-static``: amax / 448 of the layer's inputs); None otherwise.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    scheme: QuantScheme = field(default_factory=QuantScheme)
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    def to(self, device: torch.device | str) -> "QuantResult":
        """The same result with every tensor on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, qweight=move(self.qweight), scales=move(self.scales),
                       zeros=move(self.zeros), g_idx=move(self.g_idx),
                       global_scale=move(self.global_scale), input_scale=move(self.input_scale))

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
        if self.scheme.is_float:
            k = self.qweight.shape[1]
            return dequantize_values(
                self.qweight, self.scales, self.scheme.weights, self.scheme.group_len(k), self.global_scale
            ).to(dtype)
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
        if self.scheme.weights in ("nvfp4", "mxfp4") and int(self.qweight.max()) > 15:
            raise ValueError("fp4 codes exceed 4 bits")
        if (self.scheme.weights == "nvfp4") != (self.global_scale is not None):
            raise ValueError("global_scale must be set exactly for nvfp4")
        if self.scheme.static_activations != (self.input_scale is not None):
            raise ValueError("input_scale must be set exactly for static activation schemes (calibrate them)")
        if self.scheme.is_float:
            if self.zeros is not None or self.g_idx is not None:
                raise ValueError("float schemes have no zeros and no g_idx")
        elif int(self.qweight.max()) > self.scheme.maxq:
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
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.dtype.is_floating_point and a.dtype.itemsize == 1:  # float8: torch.equal lacks it
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            return torch.equal(a, b)

        return (
            self.scheme == other.scheme
            and same(self.qweight, other.qweight)
            and same(self.scales, other.scales)
            and same(self.zeros, other.zeros)
            and same(self.g_idx, other.g_idx)
            and same(self.global_scale, other.global_scale)
            and same(self.input_scale, other.input_scale)
        )
