"""The reference backend: dequantize, then a dense matmul. Runs every scheme on any device.

It is the oracle of every test: slow, simple, and obviously correct. W8A8 layers also quantize
their activations per token (symmetric int8, dynamic; FP8 E4M3 for fp8-dynamic; FP8 E4M3 per
token per 128 columns for FP8 block's fp8-group-dynamic, multiplied as the dequantized
activations ``q * scale``, as compressed-tensors does) so the reference matches what the fast
W8A8 kernels compute. Float weights (FP8, NVFP4, MXFP4) are decoded through their code tables
(``core/floatcodes.py``).
"""

from __future__ import annotations

import torch

from ..core.floatcodes import dequantize_values, quantize_per_group_fp8, quantize_per_token_fp8, round_fp8
from ..core.scheme import QuantResult, QuantScheme


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> int8 codes [M, K] and fp32 scales [M, 1] (symmetric, absmax / 127)."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / 127.0).clamp(min=1e-10)
    q = torch.round(x.to(torch.float32) / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


class ReferenceBackend:
    name = "reference"

    def cannot_run(self, scheme, out_features, in_features, device, dtype):
        return None

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        # Kept dequantized-on-the-fly from the canonical tensors; nothing dense is stored.
        if result.scheme.is_float:
            out = {"codes": result.qweight, "scales": result.scales}
            for name in ("global_scale", "input_scale"):
                if getattr(result, name) is not None:
                    out[name] = getattr(result, name)
            return out
        out = {"codes": result.qweight, "scales": result.scales, "group": result.group_index()}
        if result.zeros is not None:
            out["zeros"] = result.zeros
        return out

    def linear(self, x, prepared, scheme: QuantScheme, out_features, in_features, bias):
        if scheme.is_float:
            return self._float_linear(x, prepared, scheme, out_features, in_features, bias)
        g = prepared["group"]
        s = prepared["scales"].to(torch.float32)[:, g]
        if "zeros" in prepared:
            z = prepared["zeros"].to(torch.float32)[:, g]
        else:
            z = float(scheme.sym_zero)
        w = (prepared["codes"].to(torch.float32) - z) * s
        if scheme.activations == "int8-token-dynamic":
            flat = x.reshape(-1, in_features)
            qx, sx = quantize_per_token_int8(flat)
            y = (qx.to(torch.float32) @ w.T) * sx
            y = y.reshape(*x.shape[:-1], out_features)
        else:
            y = x.to(torch.float32) @ w.T
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype)

    def _float_linear(self, x, prepared, scheme: QuantScheme, out_features, in_features, bias):
        w = dequantize_values(prepared["codes"], prepared["scales"], scheme.weights,
                              scheme.group_len(in_features), prepared.get("global_scale"))
        flat = x.reshape(-1, in_features)
        if scheme.activations == "fp8-token-dynamic":
            qx, sx = quantize_per_token_fp8(flat)
            y = (qx @ w.T) * sx
        elif scheme.activations == "fp8-group-dynamic":
            glen = scheme.group_len(in_features)
            qx, sx = quantize_per_group_fp8(flat, glen)
            y = (qx * sx.repeat_interleave(glen, dim=1)) @ w.T
        elif scheme.static_activations:
            sx = prepared["input_scale"].to(torch.float32)
            qx = round_fp8(flat.to(torch.float32) / sx)
            y = (qx @ w.T) * sx
        else:
            y = flat.to(torch.float32) @ w.T
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.reshape(*x.shape[:-1], out_features).to(x.dtype)
