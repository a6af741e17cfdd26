"""quantspec: quantize Hugging Face causal LMs, run them through fused dequant-GEMM kernels,
speculate and measure.

The two calls most users need::

    quantspec.quantize("HuggingFaceTB/SmolLM2-135M-Instruct", out="out/")  # write a checkpoint
    model = quantspec.load_quantized("out/")                              # load it back
    model, report = quantspec.quantize_model(model, "rtn-w4g128")         # in memory, no folder

Imports are lazy: importing the package loads nothing heavy.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["quantize", "quantize_model", "load_quantized", "QuantScheme", "QuantspecError"]


def __getattr__(name: str):
    if name == "quantize":
        from .quant.pipeline import quantize

        return quantize
    if name == "quantize_model":
        from .quant.api import quantize_model

        return quantize_model
    if name == "load_quantized":
        from .checkpoint.load import load_quantized

        return load_quantized
    if name == "QuantScheme":
        from .core.scheme import QuantScheme

        return QuantScheme
    if name == "QuantspecError":
        from .errors import QuantspecError

        return QuantspecError
    raise AttributeError(f"module 'quantspec' has no attribute {name!r}")
