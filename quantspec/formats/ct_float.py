"""compressed-tensors float formats: FP8 ("float-quantized" / "naive-quantized"), NVFP4
("nvfp4-pack-quantized") and MXFP4 ("mxfp4-pack-quantized"), as compressed-tensors 0.20.1
writes them (``FloatQuantizationCompressor``, ``NVFP4PackedCompressor``,
``MXFP4PackedCompressor``; cross-checked by the tests when it is installed, never imported here).
The codes and scales are those of ``quant/floatgrid.py`` (element codes: ``core/floatcodes.py``). One Linear [N, K]:

==========================  ===========================  =====================================
scheme                      tensors                      content
==========================  ===========================  =====================================
fp8 (weight-only, format    weight float8_e4m3fn [N, K]  the E4M3FN codes
naive-quantized), fp8 with  weight_scale fp32 [N, 1]     per output channel
fp8-token-dynamic or        input_scale fp32 [1]         fp8-tensor-static only: amax / 448 of
fp8-tensor-static                                        the layer's calibration inputs
(float-quantized)
fp8 block (group_size 128;  weight float8_e4m3fn [N, K]  the E4M3FN codes
weight-only: naive-         weight_scale fp32            one per block of 128 rows x 128
quantized; with fp8-group-  [ceil(N/128), K/128]         columns (the last row of blocks may be
dynamic: float-quantized)                                shorter; K must be a multiple of 128)
nvfp4                       weight_packed uint8 [N, K/2] E2M1 nibbles, column 2j in the low
                                                         nibble of byte j, 2j+1 in the high
                            weight_scale float8_e4m3fn   per 16 columns, divided by the global
                            [N, K/16]                    scale: ``w = e2m1 * scale / global``
                            weight_global_scale fp32 [1]
mxfp4                       weight_packed uint8 [N, K/2] as nvfp4
                            weight_scale uint8 [N, K/32] E8M0: ``2 ** (e - 127)``
==========================  ===========================  =====================================

FP8 block (compressed-tensors' FP8_BLOCK): weights ``strategy "block"``, ``block_structure
[128, 128]``; activations (fp8-group-dynamic) ``strategy "group"``, ``group_size 128``,
``dynamic true``. ``pack`` keeps one row of ``QuantResult.scales`` per block (and raises when
the rows of a block disagree), ``unpack`` repeats it on every row of its block.
"""

from __future__ import annotations

import torch

from ..errors import QuantspecError
from ..core.floatcodes import pack_fp4_pairs, unpack_fp4_pairs
from ..core.scheme import FP8_BLOCK, QuantResult, QuantScheme
from ..strict import config_value

FP8_WEIGHT_ONLY = "naive-quantized"
FP8_DYNAMIC = "float-quantized"
NVFP4 = "nvfp4-pack-quantized"
MXFP4 = "mxfp4-pack-quantized"
FORMATS = (FP8_WEIGHT_ONLY, FP8_DYNAMIC, NVFP4, MXFP4)

_STRATEGY = {"fp8": "channel", "nvfp4": "tensor_group", "mxfp4": "group"}
_SCALE_DTYPE = {"nvfp4": "torch.float8_e4m3fn", "mxfp4": "torch.uint8"}
_FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
              "strategy": "token", "dynamic": True}
_FP8_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
               "strategy": "tensor", "dynamic": False}
_FP8_GROUP = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": FP8_BLOCK,
              "strategy": "group", "dynamic": True}
_INPUT_ARGS = {"fp8-token-dynamic": _FP8_TOKEN, "fp8-tensor-static": _FP8_TENSOR, "fp8-group-dynamic": _FP8_GROUP}


def format_name(scheme: QuantScheme) -> str:
    if scheme.weights == "fp8":
        return FP8_DYNAMIC if scheme.activations else FP8_WEIGHT_ONLY  # float-quantized: dynamic or static
    return NVFP4 if scheme.weights == "nvfp4" else MXFP4


def cannot_hold(scheme: QuantScheme, out_features: int, in_features: int) -> str | None:
    if scheme.is_block and in_features % FP8_BLOCK:
        return (f"in_features={in_features} is not a multiple of {FP8_BLOCK} "
                f"(fp8 block scales cover {FP8_BLOCK}x{FP8_BLOCK} blocks; loaders need whole column blocks)")
    if scheme.weights != "fp8" and in_features % scheme.group_size:
        return f"in_features={in_features} is not a multiple of {scheme.group_size} ({scheme.weights} groups)"
    return None


def tensor_specs(scheme: QuantScheme, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if scheme.weights == "fp8":
        scale_shape = (-(-n // FP8_BLOCK), k // FP8_BLOCK) if scheme.is_block else (n, 1)
        specs = {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": (scale_shape, torch.float32)}
        if scheme.static_activations:
            specs["input_scale"] = ((1,), torch.float32)
        return specs
    specs = {"weight_packed": ((n, k // 2), torch.uint8)}
    if scheme.weights == "nvfp4":
        specs["weight_scale"] = ((n, k // 16), torch.float8_e4m3fn)
        specs["weight_global_scale"] = ((1,), torch.float32)
    else:
        specs["weight_scale"] = ((n, k // 32), torch.uint8)
    return specs


def pack(result: QuantResult) -> dict[str, torch.Tensor]:
    scheme = result.scheme
    if scheme.weights == "fp8":
        scales = result.scales.to(torch.float32)
        out = {"weight": result.qweight.contiguous().view(torch.float8_e4m3fn),
               "weight_scale": _block_rows(scales) if scheme.is_block else scales.contiguous()}
        if scheme.static_activations:
            out["input_scale"] = result.input_scale.to(torch.float32).reshape(1).contiguous()
        return out
    codes = result.qweight
    out = {"weight_packed": pack_fp4_pairs(codes),
           "weight_scale": result.scales.contiguous()}
    if scheme.weights == "nvfp4":
        out["weight_global_scale"] = result.global_scale.to(torch.float32).reshape(1).contiguous()
    return out


def unpack(tensors: dict[str, torch.Tensor], scheme: QuantScheme, n: int, k: int) -> QuantResult:
    if scheme.weights == "fp8":
        codes = tensors["weight"].contiguous().view(torch.uint8)
        inp = tensors["input_scale"].contiguous() if scheme.static_activations else None
        scales = tensors["weight_scale"].to(torch.float32)
        if scheme.is_block:
            scales = scales.repeat_interleave(FP8_BLOCK, dim=0)[:n]
        return QuantResult(codes, scales.contiguous(), None, None, scheme, input_scale=inp)
    packed = tensors["weight_packed"]
    codes = unpack_fp4_pairs(packed)
    gscale = tensors["weight_global_scale"].contiguous() if scheme.weights == "nvfp4" else None
    return QuantResult(codes, tensors["weight_scale"].contiguous(), None, None, scheme, global_scale=gscale)


def _block_rows(scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N, G] per-row scales of an FP8 block result -> [ceil(N/128), G], one row per block;
    ValueError when the rows of a block do not all hold the block's scale."""
    blocks = scales[::FP8_BLOCK].contiguous()
    if not torch.equal(blocks.repeat_interleave(FP8_BLOCK, dim=0)[: scales.shape[0]], scales):
        raise ValueError(f"fp8 block scales differ within a block of {FP8_BLOCK} rows; "
                         "an FP8 block result holds its block's scale on every row")
    return blocks


def weights_args(scheme: QuantScheme) -> dict:
    if scheme.is_block:  # compressed-tensors' FP8_BLOCK weights, field for field
        args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                "block_structure": [FP8_BLOCK, FP8_BLOCK], "group_size": None, "dynamic": False}
        if scheme.act_order:
            args["actorder"] = "weight"
        return args
    args = {
        "num_bits": scheme.bits,
        "type": "float",
        "symmetric": True,
        "group_size": None if scheme.group_size == -1 else scheme.group_size,
        "strategy": _STRATEGY[scheme.weights],
        "dynamic": False,
    }
    if scheme.weights in _SCALE_DTYPE:
        args["scale_dtype"] = _SCALE_DTYPE[scheme.weights]
    if scheme.act_order:
        args["actorder"] = "weight"
    return args


def input_args(scheme: QuantScheme) -> dict | None:
    args = _INPUT_ARGS.get(scheme.activations)
    return None if args is None else dict(args)


def scheme_from_args(w: dict, acts: dict | None, fmt: str) -> QuantScheme:
    """The float QuantScheme of a config group's ``weights`` / ``input_activations``."""
    bits = config_value(w, "num_bits", int, 8, "compressed-tensors weights")
    strategy = str(w.get("strategy") or "").lower()
    group = config_value(w, "group_size", int | None, None, "compressed-tensors weights")
    if bits == 8 and strategy == "channel":
        weights, group_size = "fp8", -1
    elif bits == 8 and strategy == "block" and group is None and list(w.get("block_structure") or []) == [
            FP8_BLOCK, FP8_BLOCK]:
        weights, group_size = "fp8", FP8_BLOCK
    elif bits == 4 and group == 16 and strategy in ("tensor_group", "group"):
        weights, group_size = "nvfp4", 16
    elif bits == 4 and group == 32 and strategy == "group":
        weights, group_size = "mxfp4", 32
    else:
        raise QuantspecError(
            f"compressed-tensors float weights ({bits} bits, strategy {strategy!r}, group {group}, "
            f"block_structure {w.get('block_structure')}) are not supported.",
            "use FP8 per channel or in 128x128 blocks, NVFP4 (group 16) or MXFP4 (group 32); per-tensor "
            "FP8 and other block shapes are not read yet.",
        )
    if not config_value(w, "symmetric", bool, True, "compressed-tensors weights"):
        raise QuantspecError("asymmetric float weights are not supported.", "use symmetric FP8/FP4.")
    activations = None
    if acts:
        activations = _fp8_activations(acts)
    expected = format_name(QuantScheme(bits=bits, group_size=group_size, weights=weights, activations=activations))
    if fmt != expected and not (weights == "fp8" and fmt in (FP8_WEIGHT_ONLY, FP8_DYNAMIC)):
        raise QuantspecError(f"compressed-tensors format {fmt!r} does not hold {weights} weights.",
                             f"expected {expected!r}.")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static"):
        raise QuantspecError(f"float weights with actorder {actorder!r} (a stored g_idx) are not supported.",
                             "use actorder 'weight' (static groups) or none.")
    actorder = actorder or None
    return QuantScheme(bits=bits, group_size=group_size, weights=weights, activations=activations,
                       act_order=actorder is not None, static_groups=actorder is not None)


def _fp8_activations(acts: dict) -> str:
    where = "compressed-tensors input_activations"
    fp8 = (str(acts.get("type")).lower() == "float" and config_value(acts, "num_bits", int, 0, where) == 8
           and config_value(acts, "symmetric", bool, True, where))
    strategy, dynamic = str(acts.get("strategy", "")).lower(), acts.get("dynamic")
    if fp8 and strategy == "token" and dynamic is True:
        return "fp8-token-dynamic"
    if fp8 and strategy == "tensor" and dynamic is False:
        return "fp8-tensor-static"
    if fp8 and strategy == "group" and acts.get("group_size") == FP8_BLOCK and dynamic is True:
        return "fp8-group-dynamic"
    raise QuantspecError(
        f"compressed-tensors float input_activations {acts} are not supported.",
        "quantspec runs FP8 activations per token dynamically (FP8_DYNAMIC), per tensor with a "
        f"calibrated scale (FP8) or per token per {FP8_BLOCK} columns dynamically (FP8_BLOCK).",
    )
