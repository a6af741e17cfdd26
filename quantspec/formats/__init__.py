"""Checkpoint formats: GPTQ v1 ("gptq"), AWQ GEMM ("awq") and compressed-tensors
("compressed-tensors": "pack-quantized" weight-only, "int-quantized" W8A8).

``get_format(name)`` gives a format by name; ``read_quantization_config(qcfg)`` recognises the
``quantization_config`` of a config.json written by quantspec, AutoGPTQ, GPTQModel, optimum,
AutoAWQ or llm-compressor and returns the format that reads its tensors with the parsed config.
Each format module documents its tensors, bit layout and what it cannot hold.
"""

from __future__ import annotations

from ..errors import QuantspecError
from .awq import AWQFormat
from .base import Format, FormatConfig
from .compressed_tensors import CompressedTensorsFormat
from .gptq import GPTQFormat

# the registry of formats a checkpoint is written in: name -> factory; the CLI's choices and
# recipe validation read it
FORMATS: dict[str, type[Format]] = {
    "gptq": GPTQFormat,
    "awq": AWQFormat,
    "compressed-tensors": CompressedTensorsFormat,
}
FORMAT_NAMES = tuple(FORMATS)
_ALIASES = {"compressed_tensors": "compressed-tensors"}

__all__ = [
    "FORMAT_NAMES",
    "FORMATS",
    "Format",
    "FormatConfig",
    "GPTQFormat",
    "AWQFormat",
    "CompressedTensorsFormat",
    "get_format",
    "read_quantization_config",
]


def get_format(name: str) -> Format:
    """The format called ``name``: one of ``FORMAT_NAMES``, or "gptq_v2" (the reader of
    GPTQModel v2 checkpoints, which ``read_quantization_config`` returns for them)."""
    key = str(name).strip().lower()
    if key == "gptq_v2":  # a read-only alias, see read_quantization_config
        return GPTQFormat(key)
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]()
    raise QuantspecError(f"unknown checkpoint format {name!r}.", f"use one of {list(FORMAT_NAMES)}.")


def read_quantization_config(qcfg: dict) -> tuple[Format, FormatConfig]:
    """The format of a config.json ``quantization_config`` and what it says, parsed.

    GPTQ "gptq_v2" checkpoints (GPTQModel's internal layout, zeros stored without the -1) are
    read by a ``GPTQFormat("gptq_v2")``, whose ``name`` is "gptq_v2" (``get_format(fmt.name)``
    gives the same reader back for every format returned here). Anything else we cannot read exactly (other quant
    methods, AWQ GEMV/Marlin layouts, mixed-precision or FP8 compressed-tensors, ...) raises a
    QuantspecError naming it and the fix.
    """
    if not isinstance(qcfg, dict) or not qcfg:
        raise QuantspecError(
            "the model's config.json has no quantization_config.",
            "point at a quantized checkpoint (GPTQ, AWQ or compressed-tensors).",
        )
    method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
    if method == "gptq":
        parsed = GPTQFormat().parse_config(qcfg)
        return GPTQFormat(parsed.extra["checkpoint_format"]), parsed
    if method == "awq":
        fmt = AWQFormat()
        return fmt, fmt.parse_config(qcfg)
    if method == "compressed-tensors":
        fmt = CompressedTensorsFormat()
        return fmt, fmt.parse_config(qcfg)
    raise QuantspecError(
        f"quantization method {qcfg.get('quant_method')!r} is not supported.",
        "use a GPTQ (quant_method 'gptq'), AWQ ('awq') or compressed-tensors checkpoint, "
        "or requantize the dense model with quantspec.",
    )
