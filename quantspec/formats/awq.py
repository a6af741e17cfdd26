"""AWQ GEMM checkpoints ("awq"): the layout of llm-awq / AutoAWQ's WQLinear_GEMM, read by
vLLM (``awq``, ``awq_marlin``), transformers and SGLang.

Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration". 4-bit only. One Linear of shape [N, K] (out, in), G groups:

==========  =====================  ========================================================
name        dtype / shape          content
==========  =====================  ========================================================
qweight     int32 [K, N/8]         codes packed along N: nibble i (bits 4i..4i+3) of word j
                                   holds output column 8j + ORDER[i], ORDER = 0,2,4,6,1,3,5,7
                                   (the interleave the AWQ GEMM kernel's dequant expects)
qzeros      int32 [G, N/8]         zero points, same packing and order, stored as they are
                                   (no -1). Symmetric schemes store 8 everywhere.
scales      fp16 [G, N]            one scale per group and output channel
==========  =====================  ========================================================

Dequantization: ``w[n, k] = scales[g, n] * (q[k, n] - zeros[g, n])`` with ``g = k // group``.

What it cannot hold (``cannot_hold``): bits other than 4; act-order with a permuted g_idx
(there is no g_idx tensor; act-order with static groups is fine, its g_idx is the default);
int8 activations; K not divisible by the group size; N not a multiple of 8. Per-channel
(group_size -1) is written as such; vLLM's awq_marlin and transformers read it, vLLM's plain
``awq`` kernel needs a positive group size.

quantization_config: quant_method "awq", bits, group_size, zero_point true, version "gemm",
modules_to_not_convert (the dense layers). ``zero_point`` is always true: every AWQ loader reads
qzeros, and a symmetric scheme is stored exactly as zeros of 8, so a symmetric checkpoint
reads back as an asymmetric scheme with the same dequantized weights (the recipe saved with the
checkpoint keeps the original scheme). transformers and vLLM match modules_to_not_convert as
substrings of module names (vLLM: of fused names such as ``qkv_proj``, so leave whole fused
groups dense or none).
"""

from __future__ import annotations

import torch

from ..errors import QuantspecError
from ..core.scheme import QuantResult, QuantScheme
from ..strict import config_value
from ._common import check_tensors, g_idx_to_store, group_rule
from .base import FormatConfig
from .bitpack import pack_int32, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort(AWQ_ORDER)
VERSIONS = ("gemm",)


def pack_awq(codes_kn: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] 4-bit codes -> int32 [R, N/8] in AWQ's interleaved nibble order."""
    r, n = codes_kn.shape
    perm = codes_kn.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n)
    return pack_int32(perm, 4)


def unpack_awq(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_awq``: int32 [R, N/8] -> uint8 [R, N]."""
    r = packed.shape[0]
    u = unpack_int32(packed, 4, n).reshape(r, n // 8, 8)
    return u[:, :, list(AWQ_REVERSE_ORDER)].reshape(r, n).contiguous()


class AWQFormat:
    name = "awq"

    def cannot_hold(self, scheme: QuantScheme, out_features: int, in_features: int) -> str | None:
        if scheme.is_float:
            return f"AWQ checkpoints hold integer codes; {scheme.weights} needs the compressed-tensors format"
        if scheme.activations is not None:
            return "AWQ checkpoints are weight-only; W8A8 needs the compressed-tensors format"
        if scheme.bits != 4:
            return f"AWQ GEMM holds 4-bit weights only (got {scheme.bits}-bit)"
        if scheme.act_order and not scheme.static_groups:
            return "AWQ has no g_idx, so it cannot hold act-order (use static_groups or the gptq format)"
        reason = group_rule(scheme, in_features)
        if reason:
            return reason
        if out_features % 8:
            return f"out_features={out_features} is not a multiple of 8 (AWQ packs 8 output columns per int32)"
        return None

    def tensor_specs(
        self,
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
        scale_dtype: torch.dtype = torch.float16,
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k = out_features, in_features
        g = scheme.num_groups(k)
        return {
            "qweight": ((k, n // 8), torch.int32),
            "qzeros": ((g, n // 8), torch.int32),
            "scales": ((g, n), scale_dtype),
        }

    def pack(self, result: QuantResult) -> dict[str, torch.Tensor]:
        scheme = result.scheme
        n, k = result.shape
        reason = self.cannot_hold(scheme, n, k)
        if reason:
            raise QuantspecError(f"AWQ cannot hold this layer: {reason}.", "leave it dense.")
        result.validate()
        g_idx_to_store(result, "awq")  # raises on a permuted g_idx
        zeros = result.zeros if result.zeros is not None else torch.full_like(
            result.scales, scheme.sym_zero, dtype=torch.uint8
        )
        return {
            "qweight": pack_awq(result.qweight.t()),
            "qzeros": pack_awq(zeros.t()),
            "scales": result.scales.t().contiguous(),
        }

    def unpack(
        self,
        tensors: dict[str, torch.Tensor],
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
    ) -> QuantResult:
        n, k = out_features, in_features
        reason = self.cannot_hold(scheme, n, k)
        if reason:
            raise QuantspecError(f"AWQ cannot hold this layer: {reason}.", "check the quantization_config.")
        check_tensors("AWQ", tensors, self.tensor_specs(scheme, n, k), float_names=("scales",))
        zeros = unpack_awq(tensors["qzeros"], n).t().contiguous()
        if scheme.symmetric:
            if not bool((zeros == scheme.sym_zero).all()):
                raise QuantspecError(
                    "the AWQ layer was read with a symmetric scheme but its zero points are not all 8.",
                    "read it with symmetric=false (zero_point true).",
                )
            zeros = None
        return QuantResult(
            qweight=unpack_awq(tensors["qweight"], n).t().contiguous(),
            scales=tensors["scales"].t().contiguous(),
            zeros=zeros,
            g_idx=None,
            scheme=scheme,
        )

    def quantization_config(self, scheme: QuantScheme, ignore: list[str]) -> dict:
        if scheme.bits != 4 or scheme.activations is not None:
            raise QuantspecError(
                f"AWQ holds 4-bit weight-only schemes, not {scheme.short_name}.",
                "use --format gptq or compressed-tensors.",
            )
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": scheme.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(ignore) or None,
        }

    def parse_config(self, config: dict) -> FormatConfig:
        method = str(config.get("quant_method", "")).lower()
        if method != "awq":
            raise QuantspecError(f"quant_method {method!r} is not AWQ.", "read it with the matching format.")
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        if version not in VERSIONS:
            raise QuantspecError(
                f"AWQ version {version!r} is not supported (only the GEMM layout is).",
                "re-export the model with AutoAWQ version='gemm', or requantize with quantspec.",
            )
        where = "AWQ quantization_config"
        # AutoAWQ's quant_config.json spells bits and group_size w_bit and q_group_size
        bits = config_value(config, "bits" if "bits" in config else "w_bit", int, 4, where)
        if bits != 4:
            raise QuantspecError(f"AWQ with {bits} bits is not supported.", "use a 4-bit AWQ checkpoint.")
        if not config_value(config, "zero_point", bool, True, where):
            raise QuantspecError(
                "AWQ checkpoints without zero points (zero_point: false) are not supported.",
                "use a zero_point: true AWQ checkpoint, or a GPTQ one.",
            )
        group = config_value(config, "group_size" if "group_size" in config else "q_group_size", int, 128, where)
        scheme = QuantScheme(bits=4, group_size=group, symmetric=False)
        ignore = list(config_value(config, "modules_to_not_convert", list, [], where))
        return FormatConfig(format="awq", scheme=scheme, ignore=ignore, extra={"version": version})
