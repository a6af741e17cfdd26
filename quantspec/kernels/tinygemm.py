"""The ``tinygemm`` backend: torch's own int4 kernels, the layout of torchao's int4 weights.

Integer weight-only layers of at most 4 bits (any group length, symmetric or not, act-order)
run through ``int4pack``: on CUDA (sm80+, bf16 activations) the tensor-core "tinygemm" kernel,
on CPU its AVX-512 / AVX2 counterpart. Columns are sorted and padded by group as the ``cpu``
backend lays them out (``cpu.column_map``), and x is gathered into that order per call when
the order is not the identity.

Not the declared scheme at 16 bits: the ops take the scales and float zeros in the activation
dtype, so bf16 (and fp16) activations round them (``backend.ROUNDS_A16_ACTIVATIONS``); fp32
activations on CPU compute the reference's weights exactly.
"""

from __future__ import annotations

import torch

from ..core.scheme import QuantResult, QuantScheme
from . import int4pack
from .cpu import DTYPES, _gather, _gather_codes, _src_tensor, column_map


class TinygemmBackend:
    name = "tinygemm"

    def cannot_run(self, scheme: QuantScheme, out_features: int, in_features: int,
                   device: torch.device, dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        if scheme.is_float or scheme.activations is not None:
            return f"runs integer weight-only schemes, not {scheme.short_name}"
        if scheme.bits > 4:
            return f"the int4 layout holds codes of at most 4 bits, the scheme has {scheme.bits}"
        if device.type == "cpu":
            if out_features % 16:
                return f"out_features={out_features} is not a multiple of 16"
            if dtype not in DTYPES:
                return f"activations must be fp32, bf16 or fp16, not {dtype}"
            return None
        if device.type != "cuda":
            return f"runs on CPU and CUDA tensors, not {device.type}"
        if torch.version.hip is not None:
            return "torch's int4 tile kernel is built for NVIDIA GPUs only"
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"needs compute capability >= 8.0, the GPU has {major}.{minor}"
        if dtype != torch.bfloat16:
            return f"the CUDA kernel takes bf16 activations, not {dtype}"
        if out_features % 8:
            return f"out_features={out_features} is not a multiple of 8"
        return None

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``w`` the packed codes, ``sz`` fp32 [Kp / B, N, 2] (scale, float zero per sub-group
        of B columns), ``src`` int32 [Kp] the x column of each layout column (empty: the
        identity, zero-padded to Kp)."""
        device = result.qweight.device
        cpu = result.to("cpu")
        k = cpu.shape[1]
        src, groups, length = column_map(cpu)
        codes, scales, zeros = _gather_codes(cpu, src, groups)
        return {
            "w": int4pack.pack(codes, device),
            "sz": int4pack.scales_and_zeros(scales, zeros, length // int4pack.sub_group(length)).to(device),
            "src": _src_tensor(src, k).to(device),
        }

    def linear(self, x, prepared, scheme: QuantScheme, out_features, in_features, bias):
        if x.shape[-1] != in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the layer takes {in_features}")
        lead = x.shape[:-1]
        xs = _gather(x.reshape(-1, in_features), prepared["src"], int4pack.columns(prepared["w"]))
        y = int4pack.mm(xs.contiguous(), prepared["w"], prepared["sz"])
        if bias is not None:
            y = (y.to(torch.float32) + bias.to(torch.float32)).to(x.dtype)
        return y.reshape(*lead, out_features)
