"""GPTQ checkpoints ("gptq"): the v1 layout of AutoGPTQ / GPTQModel / optimum, read by vLLM
(``gptq``, ``gptq_marlin``), transformers (optimum + GPTQModel kernels) and GPTQModel.

Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers". One Linear of shape [N, K] (out, in) with b-bit codes, G groups:

==========  =====================  ========================================================
name        dtype / shape          content
==========  =====================  ========================================================
qweight     int32 [K*b/32, N]      codes packed along K (bitpack.py: b in {2, 4, 8}: field i
                                   of word j = row (32/b)*j + i; b = 3: 32 rows per 3 words,
                                   rows 10 and 21 straddle words, as AutoGPTQ packs them)
qzeros      int32 [G, N*b/32]      zero points packed along N, same bit order, stored as
                                   ``zero - 1`` (v1; "gptq_v2" stores ``zero``). Symmetric:
                                   every zero is 2**(b-1), so stored 2**(b-1) - 1 (7 for 4-bit)
scales      fp16 [G, N]            one scale per group and output channel
g_idx       int32 [K]              group of each input column; ``k // group_size`` without
                                   act-order (always written; per-channel: all 0, G = 1)
==========  =====================  ========================================================

Dequantization: ``w[n, k] = scales[g, n] * (q[k, n] - (stored_zero[g, n] + 1))``, g = g_idx[k].

What it cannot hold (``cannot_hold``): int8 activations (W8A8 lives in compressed-tensors);
K not divisible by the group size; K*b or N*b not a multiple of 32 (K and N multiples of
32/b, i.e. 16 for 2-bit, 32 for 3-bit, 8 for 4-bit, 4 for 8-bit). And one value ``pack``
refuses: an asymmetric zero point of 0 (v1 stores zero-1 = -1 and every v1 loader reads it
back as 2**b; GPTQModel's v1 -> v2 conversion wraps it) — write such a layer in
compressed-tensors or AWQ.

quantization_config: quant_method "gptq", bits, group_size, desc_act (= act_order without
static groups: vLLM 0.32 refuses desc_act=true and serves only sym=true), sym,
static_groups, lm_head false, checkpoint_format "gptq", meta.quantizer. Layers left dense
are listed in GPTQModel's ``dynamic`` field as negative entries ``"-:^<escaped name>$"``,
which GPTQModel and vLLM both honour (both re.match the pattern against module names).
``lm_head`` is never written there: every GPTQ loader keeps it dense unless ``lm_head`` is
true. We do not write optimum's ``modules_in_block_to_quantize`` (it lists what *is*
quantized, relative to a block, the same for every block, which an ignore list cannot
always express). transformers loads GPTQ through optimum's GPTQQuantizer, which reads
``modules_in_block_to_quantize``; whether it honours ``dynamic`` was not verified here, so
with transformers keep dense layers to ``lm_head`` (the usual case) or load through
GPTQModel / vLLM / quantspec.
Caveat: vLLM fuses q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``); a pattern
naming one member of a fused group does not match the fused layer, so leave whole groups
dense or none.
"""

from __future__ import annotations

import re

import torch

from ..errors import QuantspecError
from ..core.scheme import QuantResult, QuantScheme
from ..strict import config_value
from ._common import check_tensors, g_idx_from_store, g_idx_to_store, group_rule
from .base import FormatConfig
from .bitpack import pack_int32, pack_multiple, unpack_int32

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_NAME_RE = re.compile(r"\^?((?:[A-Za-z0-9_\-]|\\\.)+)\$")


def ignore_to_dynamic(ignore: list[str]) -> dict[str, dict]:
    """GPTQModel ``dynamic`` negative entries for the dense layers (``re:`` names pass as regex)."""
    out: dict[str, dict] = {}
    for name in ignore:
        if name == "lm_head":
            continue
        pattern = name[3:] if name.startswith("re:") else "^" + re.escape(name) + "$"
        out["-:" + pattern] = {}
    return out


def dynamic_to_ignore(dynamic: dict) -> list[str]:
    """Inverse of ``ignore_to_dynamic``; other regexes come back as ``re:<pattern>``.

    Positive entries (per-module bits/group overrides) are mixed precision: not supported.
    """
    names = []
    for key, override in (dynamic or {}).items():
        if not key.startswith("-:"):
            raise QuantspecError(
                f"GPTQ 'dynamic' entry {key!r} overrides the scheme of some modules (mixed precision).",
                "quantspec reads one scheme per checkpoint; requantize with one scheme.",
            )
        pattern = key[2:]
        m = _NAME_RE.fullmatch(pattern)
        names.append(m.group(1).replace("\\.", ".") if m else "re:" + pattern)
    return names


WHERE = "GPTQ quantization_config"


def scheme_from_config(config: dict, where: str = WHERE) -> QuantScheme:
    """The scheme of a GPTQ ``quantization_config`` (or of a ``dynamic`` entry over it), each
    field type-checked (``config_value``: sym "false" is not a bool, bits "four" not an int)."""
    # static groups imply act-order even when written as desc_act=false (see quantization_config)
    static = config_value(config, "static_groups", bool, False, where)
    return QuantScheme(
        bits=config_value(config, "bits", int, None, where),
        group_size=config_value(config, "group_size", int, 128, where),
        symmetric=config_value(config, "sym", bool, True, where),
        act_order=config_value(config, "desc_act", bool, False, where) or static,
        static_groups=static,
    )


class GPTQFormat:
    """GPTQ v1 (default) or v2 (``checkpoint_format="gptq_v2"``: zeros stored as they are).

    quantspec writes v1; v2 (GPTQModel's internal layout) is read, under the name "gptq_v2".
    """

    name = "gptq"

    def __init__(self, checkpoint_format: str = "gptq") -> None:
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise QuantspecError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported.",
                f"use one of {list(CHECKPOINT_FORMATS)}.",
            )
        self.checkpoint_format = checkpoint_format
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        # "gptq_v2" instances carry their own name so that get_format(fmt.name) (used by
        # QuantLinear) rebuilds the same reader, never the v1 one (zeros would be off by one).
        self.name = checkpoint_format

    def cannot_hold(self, scheme: QuantScheme, out_features: int, in_features: int) -> str | None:
        if scheme.is_float:
            return f"GPTQ checkpoints hold integer codes; {scheme.weights} needs the compressed-tensors format"
        if scheme.activations is not None:
            return "GPTQ checkpoints are weight-only; W8A8 needs the compressed-tensors format"
        reason = group_rule(scheme, in_features)
        if reason:
            return reason
        m = pack_multiple(scheme.bits)
        if in_features % m:
            return (
                f"in_features={in_features} is not a multiple of {m} ({scheme.bits}-bit qweight "
                f"packs {m} rows per {m * scheme.bits // 32} int32 words)"
            )
        if out_features % m:
            return (
                f"out_features={out_features} is not a multiple of {m} "
                f"({scheme.bits}-bit qzeros pack along N)"
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
        g = scheme.num_groups(k)
        return {
            "qweight": ((k * b // 32, n), torch.int32),
            "qzeros": ((g, n * b // 32), torch.int32),
            "scales": ((g, n), scale_dtype),
            "g_idx": ((k,), torch.int32),
        }

    def pack(self, result: QuantResult) -> dict[str, torch.Tensor]:
        scheme = result.scheme
        n, k = result.shape
        reason = self.cannot_hold(scheme, n, k)
        if reason:
            raise QuantspecError(f"GPTQ cannot hold this layer: {reason}.", "leave it dense.")
        result.validate()
        g_idx, _ = g_idx_to_store(result, "gptq")
        zeros = result.zeros if result.zeros is not None else torch.full_like(
            result.scales, scheme.sym_zero, dtype=torch.uint8
        )
        stored = zeros.to(torch.int64) - self.zero_offset
        if int(stored.min()) < 0:
            raise QuantspecError(
                "a zero point of 0 cannot be stored in GPTQ v1 (it stores zero-1, which loaders read back as 2**bits).",
                "write this model with --format compressed-tensors or awq, or quantize symmetrically.",
            )
        return {
            "qweight": pack_int32(result.qweight, scheme.bits).t().contiguous(),
            "qzeros": pack_int32(stored.t(), scheme.bits),
            "scales": result.scales.t().contiguous(),
            "g_idx": g_idx,
        }

    def unpack(
        self,
        tensors: dict[str, torch.Tensor],
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
    ) -> QuantResult:
        n, k, b = out_features, in_features, scheme.bits
        specs = self.tensor_specs(scheme, n, k)
        check_tensors("GPTQ", tensors, specs, float_names=("scales",))
        codes = unpack_int32(tensors["qweight"].t().contiguous(), b, k)
        zeros = unpack_int32(tensors["qzeros"], b, n).t().to(torch.int64) + self.zero_offset
        if int(zeros.max()) > scheme.maxq:
            raise QuantspecError(
                f"GPTQ qzeros hold a zero point of {1 << b}, outside the {b}-bit code range "
                "(a v1 checkpoint written with zero 0).",
                "requantize the model; quantspec cannot represent this zero point exactly.",
            )
        if scheme.symmetric:
            if not bool((zeros == scheme.sym_zero).all()):
                raise QuantspecError(
                    f"GPTQ checkpoint says sym=true but its zero points are not all {scheme.sym_zero}.",
                    "set sym=false in its quantization_config, or check the checkpoint_format (gptq vs gptq_v2).",
                )
            zeros_out = None
        else:
            zeros_out = zeros.to(torch.uint8).contiguous()
        return QuantResult(
            qweight=codes,
            scales=tensors["scales"].t().contiguous(),
            zeros=zeros_out,
            g_idx=g_idx_from_store(tensors["g_idx"], scheme, k),
            scheme=scheme,
        )

    def quantization_config(self, scheme: QuantScheme, ignore: list[str]) -> dict:
        if scheme.activations is not None:
            raise QuantspecError(
                "GPTQ checkpoints are weight-only.", "use --format compressed-tensors for W8A8."
            )
        cfg = {
            "quant_method": "gptq",
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            # vLLM (0.32) refuses desc_act=true; with static groups the stored layout is the
            # natural one (g_idx = k // group_size), so it is written as desc_act=false.
            "desc_act": scheme.act_order and not scheme.static_groups,
            "sym": scheme.symmetric,
            "static_groups": scheme.static_groups,
            "lm_head": False,
            "checkpoint_format": self.checkpoint_format,
            "meta": {"quantizer": ["quantspec"]},
        }
        dynamic = ignore_to_dynamic(ignore)
        if dynamic:
            cfg["dynamic"] = dynamic
        return cfg

    def parse_config(self, config: dict) -> FormatConfig:
        method = str(config.get("quant_method", "")).lower()
        if method != "gptq":
            raise QuantspecError(
                f"quant_method {method!r} is not GPTQ.", "read it with the matching format."
            )
        ckpt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        marlin = config_value(config, "is_marlin_format", bool, False, WHERE)
        if marlin or ckpt not in CHECKPOINT_FORMATS:
            raise QuantspecError(
                f"GPTQ checkpoint_format {'marlin' if marlin else ckpt!r} is not supported.",
                "convert it to the plain 'gptq' (v1) or 'gptq_v2' layout with GPTQModel first.",
            )
        if config_value(config, "lm_head", bool, False, WHERE):
            raise QuantspecError(
                "this GPTQ checkpoint quantizes lm_head, which quantspec keeps dense.",
                "requantize with lm_head left dense (lm_head: false).",
            )
        if "bits" not in config:
            raise QuantspecError("GPTQ quantization_config has no 'bits'.", "add bits (2, 3, 4 or 8).")
        scheme = scheme_from_config(config)
        ignore = ["lm_head"] + dynamic_to_ignore(config_value(config, "dynamic", dict, {}, WHERE))
        extra = {"checkpoint_format": ckpt}
        if config.get("modules_in_block_to_quantize"):
            extra["modules_in_block_to_quantize"] = config["modules_in_block_to_quantize"]
        return FormatConfig(format="gptq", scheme=scheme, ignore=ignore, extra=extra)
