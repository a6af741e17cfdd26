"""compressed-tensors checkpoints ("compressed-tensors"): the format of llm-compressor, read by
vLLM (CompressedTensorsWNA16 / W8A8Int8), transformers (through the compressed-tensors
package) and SGLang. Names, dtypes and bit layout were checked against compressed-tensors 0.20.1
(``PackedQuantizationCompressor``, ``IntQuantizationCompressor``, ``pack_to_int32``), which the
tests cross-check when it is installed; this module never imports it.

Weight-only, format "pack-quantized" (2, 3, 4 or 8 bits). One Linear [N, K], G groups:

=================  =========================  ================================================
name               dtype / shape              content
=================  =========================  ================================================
weight_packed      int32 [N, K*b/32]          stored value = signed code + 2**(b-1), i.e. our
                                              unsigned code; packed along K densely
                                              (bitpack.py): 4-bit nibble i of word j = column
                                              8j + i; 3-bit: 32 columns per 3 words
weight_scale       scales dtype [N, G]        G = 1 for per-channel (strategy "channel")
weight_zero_point  int32 [N*b/32, G]          asymmetric only: zero + 2**(b-1) of the signed
                                              zero, i.e. our unsigned zero, packed along N
                                              (pack_to_int32(..., packed_dim=0))
weight_g_idx       int32 [K]                  act-order with a permuted g_idx only
weight_shape       int64 [2]                  [N, K]
=================  =========================  ================================================

W8A8, format "int-quantized" (scheme.activations == "int8-token-dynamic"): ``weight`` int8
[N, K] = code - 128, ``weight_scale`` [N, 1]; activations quantized per token, dynamically,
symmetric int8 (config_groups ... input_activations).

Float weights (FP8, NVFP4, MXFP4): ``ct_float.py``.

Dequantization: ``w[n, k] = weight_scale[n, g] * (q[n, k] - zero[n, g])``, g = g_idx[k].

What it cannot hold (``cannot_hold``): K not divisible by the group size; K*b not a multiple of
32 (vLLM sizes weight_packed as K / (32/b)); for asymmetric schemes N*b not a multiple of 32
(weight_zero_point is packed along N). 3-bit is the dense layout of compressed-tensors >= 0.20
(older releases and vLLM, which runs 4 and 8 bits only, do not read it).

Act-order: with static groups (g_idx = k // group_size) the config says actorder "weight"
(compressed-tensors' canonical name; "static" is its alias) and no g_idx is stored. With a
permuted g_idx it says actorder "group" and stores weight_g_idx; vLLM reads that, but
compressed-tensors removed "group" (its 0.20 refuses the config, so transformers cannot load
such a checkpoint): prefer the gptq format, or static groups, for act-order models.

Dense layers go into the config's ``ignore`` list (full module names; compressed-tensors also
accepts "re:" regexes, passed through as given).
"""

from __future__ import annotations

import torch

from ..errors import QuantspecError
from ..core.scheme import QuantResult, QuantScheme
from ..strict import config_value
from ._common import check_tensors, g_idx_from_store, g_idx_to_store, group_rule
from ..core.kv_config import parse_kv_cache_scheme
from . import ct_float
from .base import FormatConfig
from .bitpack import pack_int32, pack_multiple, packed_len, unpack_int32

PACKED = "pack-quantized"
INT = "int-quantized"
REFERENCE_VERSION = "0.20.1"  # the compressed-tensors release this layout was checked against
_W8A8_FORMATS = (INT, "naive-quantized")


def _permuted_g_idx(scheme: QuantScheme) -> bool:
    return scheme.act_order and not scheme.static_groups


def _weights_args(scheme: QuantScheme) -> dict:
    args = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": None if scheme.group_size == -1 else scheme.group_size,
        "strategy": "channel" if scheme.group_size == -1 else "group",
        "dynamic": False,
    }
    if scheme.act_order:
        args["actorder"] = "group" if _permuted_g_idx(scheme) else "weight"
    return args


_TOKEN_INT8 = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "group_size": None,
    "strategy": "token",
    "dynamic": True,
}


class CompressedTensorsFormat:
    name = "compressed-tensors"

    def cannot_hold(self, scheme: QuantScheme, out_features: int, in_features: int) -> str | None:
        if scheme.is_float:
            return ct_float.cannot_hold(scheme, out_features, in_features)
        reason = group_rule(scheme, in_features)
        if reason or scheme.activations is not None:
            return reason  # int-quantized stores the plain int8 matrix: any shape
        m = pack_multiple(scheme.bits)
        if in_features % m:
            return (
                f"in_features={in_features} is not a multiple of {m} "
                f"({scheme.bits}-bit weight_packed packs along K)"
            )
        if not scheme.symmetric and out_features % m:
            return (
                f"out_features={out_features} is not a multiple of {m} "
                f"({scheme.bits}-bit weight_zero_point packs along N)"
            )
        return None

    def tensor_specs(
        self,
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
        scale_dtype: torch.dtype = torch.float16,
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k, b = out_features, in_features, scheme.bits
        if scheme.is_float:
            return ct_float.tensor_specs(scheme, n, k)
        g = scheme.num_groups(k)
        if scheme.activations is not None:
            return {"weight": ((n, k), torch.int8), "weight_scale": ((n, 1), scale_dtype)}
        specs = {
            "weight_packed": ((n, packed_len(k, b)), torch.int32),
            "weight_scale": ((n, g), scale_dtype),
            "weight_shape": ((2,), torch.int64),
        }
        if not scheme.symmetric:
            specs["weight_zero_point"] = ((packed_len(n, b), g), torch.int32)
        if _permuted_g_idx(scheme):
            specs["weight_g_idx"] = ((k,), torch.int32)
        return specs

    def pack(self, result: QuantResult) -> dict[str, torch.Tensor]:
        scheme = result.scheme
        n, k = result.shape
        reason = self.cannot_hold(scheme, n, k)
        if reason:
            raise QuantspecError(f"compressed-tensors cannot hold this layer: {reason}.", "leave it dense.")
        result.validate()
        if scheme.is_float:
            return ct_float.pack(result)
        g_idx, _ = g_idx_to_store(result, "compressed-tensors")
        if scheme.activations is not None:
            signed = result.qweight.to(torch.int16) - scheme.sym_zero
            return {"weight": signed.to(torch.int8), "weight_scale": result.scales.contiguous()}
        out = {
            "weight_packed": pack_int32(result.qweight, scheme.bits),
            "weight_scale": result.scales.contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if result.zeros is not None:
            out["weight_zero_point"] = pack_int32(result.zeros.t(), scheme.bits).t().contiguous()
        if _permuted_g_idx(scheme):
            out["weight_g_idx"] = g_idx
        return out

    def unpack(
        self,
        tensors: dict[str, torch.Tensor],
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
    ) -> QuantResult:
        n, k, b = out_features, in_features, scheme.bits
        specs = self.tensor_specs(scheme, n, k)
        if scheme.is_float:
            check_tensors("compressed-tensors", tensors, specs,
                          float_names=("weight_scale",) if scheme.weights == "fp8" else ())
            return ct_float.unpack(tensors, scheme, n, k)
        check_tensors("compressed-tensors", tensors, specs, float_names=("weight_scale",))
        if scheme.activations is not None:
            codes = (tensors["weight"].to(torch.int16) + scheme.sym_zero).to(torch.uint8)
            return QuantResult(codes, tensors["weight_scale"].contiguous(), None, None, scheme)
        shape = [int(x) for x in tensors["weight_shape"].tolist()]
        if shape != [n, k]:
            raise QuantspecError(
                f"compressed-tensors weight_shape {shape} does not match the module's [{n}, {k}].",
                "check that the checkpoint belongs to this model.",
            )
        zeros = None
        if not scheme.symmetric:
            zp = tensors["weight_zero_point"].t().contiguous()
            zeros = unpack_int32(zp, b, n).t().contiguous()
        return QuantResult(
            qweight=unpack_int32(tensors["weight_packed"], b, k),
            scales=tensors["weight_scale"].contiguous(),
            zeros=zeros,
            g_idx=g_idx_from_store(tensors.get("weight_g_idx"), scheme, k),
            scheme=scheme,
        )

    def quantization_config(self, scheme: QuantScheme, ignore: list[str]) -> dict:
        if scheme.is_float:
            fmt = ct_float.format_name(scheme)
            weights, inputs = ct_float.weights_args(scheme), ct_float.input_args(scheme)
        else:
            fmt = INT if scheme.activations is not None else PACKED
            weights, inputs = _weights_args(scheme), dict(_TOKEN_INT8) if scheme.activations else None
        group = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": inputs,
            "output_activations": None,
            "format": fmt,
        }
        return {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "config_groups": {"group_0": group},
            "ignore": list(ignore),
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
            "version": REFERENCE_VERSION,
        }

    def parse_config(self, config: dict) -> FormatConfig:
        method = str(config.get("quant_method", "")).lower().replace("_", "-")
        if method != "compressed-tensors":
            raise QuantspecError(
                f"quant_method {method!r} is not compressed-tensors.", "read it with the matching format."
            )
        _refuse_extras(config)
        groups = config_value(config, "config_groups", dict, {}, "compressed-tensors quantization_config")
        if len(groups) != 1:
            raise QuantspecError(
                f"compressed-tensors config has {len(groups)} config_groups; quantspec reads exactly one.",
                "requantize with one scheme for all quantized Linear layers.",
            )
        (group,) = groups.values()
        if not isinstance(group, dict):
            raise QuantspecError(f"compressed-tensors config group {group!r} is not a mapping.",
                                 "write config_groups as {group_0: {targets: [Linear], weights: {...}}}.")
        fmt = str(group.get("format") or config.get("format") or "").lower()
        scheme = _scheme_from_group(group, fmt)
        return FormatConfig(
            format="compressed-tensors",
            scheme=scheme,
            ignore=list(config_value(config, "ignore", list, [], "compressed-tensors quantization_config")),
            extra={"format": fmt, "targets": list(group.get("targets") or []),
                   "kv_cache": parse_kv_cache_scheme(config["kv_cache_scheme"]) if config.get("kv_cache_scheme") else None},
        )


def _refuse_extras(config: dict) -> None:
    status = str(config.get("quantization_status", "compressed")).lower()
    if status != "compressed":
        raise QuantspecError(
            f"compressed-tensors quantization_status is {status!r}; only 'compressed' "
            "checkpoints hold packed weights.",
            "save the model compressed (llm-compressor save_compressed=True).",
        )
    for key in ("sparsity_config", "transform_config"):
        if config.get(key):
            raise QuantspecError(
                f"compressed-tensors {key} is set; quantspec does not support it.",
                f"use a checkpoint without {key}.",
            )


def _scheme_from_group(group: dict, fmt: str) -> QuantScheme:
    w = config_value(group, "weights", dict, {}, "compressed-tensors config group")
    acts = config_value(group, "input_activations", dict | None, None, "compressed-tensors config group")
    if str(w.get("type", "int")).lower() == "float" and not group.get("output_activations"):
        return ct_float.scheme_from_args(w, acts, fmt)
    if str(w.get("type", "int")).lower() != "int":
        raise QuantspecError(
            f"compressed-tensors weights of type {w.get('type')!r} are not supported.", "use integer weights."
        )
    if group.get("output_activations"):
        raise QuantspecError("compressed-tensors output activation quantization is not supported.", "drop it.")
    where = "compressed-tensors weights"
    group_size = config_value(w, "group_size", int | None, None, where)
    strategy = str(w.get("strategy") or ("group" if (group_size or 0) > 0 else "channel")).lower()
    if strategy == "group":
        if group_size is None:
            raise QuantspecError("compressed-tensors weights have strategy 'group' but no group_size.",
                                 "add group_size (32, 64 or 128) to the weights in config.json.")
    elif strategy == "channel":
        group_size = -1
    else:
        raise QuantspecError(
            f"compressed-tensors weight strategy {strategy!r} is not supported.", "use 'group' or 'channel'."
        )
    actorder = w.get("actorder")
    actorder = {True: "group", False: None}.get(actorder, actorder) if isinstance(actorder, bool) else actorder
    actorder = None if actorder is None else str(actorder).lower()
    if actorder not in (None, "group", "dynamic", "weight", "static"):
        raise QuantspecError(f"compressed-tensors actorder {actorder!r} is unknown.", "use 'group' or 'weight'.")
    activations = _activation_scheme(acts) if acts else None
    expected = PACKED if activations is None else _W8A8_FORMATS
    if (activations is None and fmt != PACKED) or (activations is not None and fmt not in _W8A8_FORMATS):
        raise QuantspecError(
            f"compressed-tensors format {fmt!r} is not supported for this scheme (expected {expected!r}).",
            "use 'pack-quantized' for weight-only int and 'int-quantized' for W8A8.",
        )
    return QuantScheme(
        bits=config_value(w, "num_bits", int, 8, where),
        group_size=group_size,
        symmetric=config_value(w, "symmetric", bool, True, where),
        act_order=actorder is not None,
        static_groups=actorder in ("weight", "static"),
        activations=activations,
    )


def _activation_scheme(acts: dict) -> str:
    ok = (
        str(acts.get("type", "int")).lower() == "int"
        and config_value(acts, "num_bits", int, 8, "compressed-tensors input_activations") == 8
        and config_value(acts, "symmetric", bool, True, "compressed-tensors input_activations")
        and str(acts.get("strategy", "")).lower() == "token"
        and acts.get("dynamic") is True
    )
    if not ok:
        raise QuantspecError(
            f"compressed-tensors input_activations {acts} are not supported.",
            "quantspec runs int8 activations quantized per token, dynamically, symmetrically.",
        )
    return "int8-token-dynamic"
