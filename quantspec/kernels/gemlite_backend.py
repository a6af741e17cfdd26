"""The ``gemlite`` backend: gemlite's Triton low-bit GEMV/GEMM kernels (CUDA and ROCm).

gemlite (``pip install gemlite``: numpy, tqdm and Triton, no torch pin, so it never replaces
the installed torch) packs ``w = (q - z) * s`` weights of 1, 2, 4 or 8 bits with grouped scales
and picks its GEMV / split-K / GEMM kernel by batch size. This backend packs a layer with
``GemLiteLinearTriton.pack`` at prepare and keeps gemlite's tensors as the prepared layout; the
call is gemlite's own ``gemlite::forward_functional`` op, so torch.compile traces it.

What it runs: integer weight-only schemes of 1/2/4/8 bits with groups of 16 or more columns
that divide K (per-channel scales take another gemlite path, not wired here), K a multiple of
32, fp16 or bf16 activations, on CUDA or ROCm GPUs. Symmetric layers keep the exact
``(q - zero) * s``; asymmetric ones take gemlite's fused form ``q * s - z * s`` with ``z * s``
in the activation dtype (``backend.ROUNDS_A16_ACTIVATIONS``). Act-order checkpoints are sorted
by group at prepare and x gathered per call. gemlite needs a GPU (it queries the device at
import and pack): the CPU tests check the declared limits, ``tests/test_peer_backends_gpu.py``
the outputs where it imports.
"""

from __future__ import annotations

import importlib.util

import torch

from ..core.scheme import QuantResult, QuantScheme
from .act_order import group_sorted_codes

BITS = (1, 2, 4, 8)


def gemlite_reason() -> str | None:
    """None when gemlite imports here, else why not."""
    if importlib.util.find_spec("gemlite") is None:
        return "gemlite is not installed (pip install gemlite)"
    try:
        import gemlite  # noqa: F401
    except Exception as e:
        return f"gemlite does not import here ({type(e).__name__}: {e})"
    return None


class GemliteBackend:
    name = "gemlite"

    def cannot_run(self, scheme: QuantScheme, out_features: int, in_features: int,
                   device: torch.device, dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        if scheme.is_float or scheme.activations is not None:
            return f"runs integer weight-only schemes, not {scheme.short_name}"
        if scheme.bits not in BITS:
            return f"gemlite packs {BITS} bits, not {scheme.bits}"
        glen = scheme.group_len(in_features)
        if scheme.group_size == -1 or glen >= in_features:
            return "per-channel scales take a gemlite path not wired here (grouped scales only)"
        if in_features % glen:
            return f"groups must divide K: {glen} does not divide {in_features}"
        if in_features % 32:
            return f"in_features={in_features} is not a multiple of 32"
        if device.type != "cuda":
            return f"runs on CUDA / ROCm GPUs, not {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"activations must be fp16 or bf16, not {dtype}"
        reason = gemlite_reason()
        if reason:
            return reason
        if not torch.cuda.is_available():
            return "no CUDA / ROCm device is visible"
        return None

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """gemlite's tensors (``W_q``, ``scales``, ``zeros``, ``meta_scale``), ``meta`` int64
        [2, A] its integer arguments for fp16 and for bf16 activations, ``perm`` int32 [K]
        (act-order: the x column of each sorted column; empty otherwise)."""
        from gemlite import DType, GemLiteLinearTriton

        scheme = result.scheme
        n, k = result.shape
        glen = scheme.group_len(k)
        codes, perm = group_sorted_codes(result, "gemlite")
        metas = {}
        for act, kind in ((torch.float16, DType.FP16), (torch.bfloat16, DType.BF16)):
            layer = GemLiteLinearTriton(scheme.bits, glen, k, n, input_dtype=kind, output_dtype=kind)
            zeros = int(scheme.sym_zero) if result.zeros is None else result.zeros.to(act)
            layer.pack(codes.contiguous(), result.scales.to(act), zeros, None)
            metas[act] = layer.get_meta_args()
            if act == dtype:
                w_q, scales, zeros_t, meta_scale = layer.get_tensor_args()
        return {"W_q": w_q, "scales": scales, "zeros": zeros_t, "meta_scale": meta_scale,
                "meta": torch.tensor([metas[torch.float16], metas[torch.bfloat16]], dtype=torch.int64),
                "perm": perm}

    def bind(self, prepared, scheme: QuantScheme, out_features: int, in_features: int):
        """gemlite's op with the layer's integer arguments read once, per activation dtype (a
        module cast between fp16 and bf16 keeps the layout: its scales are cast per call)."""
        rows = prepared["meta"].tolist()
        metas = {torch.float16: [int(v) for v in rows[0]], torch.bfloat16: [int(v) for v in rows[1]]}

        def run(x, p, bias):
            x2 = x.reshape(-1, in_features)
            if p["perm"].numel():
                x2 = x2[:, p["perm"].to(torch.int64)]
            zeros = p["zeros"] if not p["zeros"].is_floating_point() else p["zeros"].to(x.dtype)
            tensors = [p["W_q"], p["scales"].to(x.dtype), zeros, p["meta_scale"]]
            y = torch.ops.gemlite.forward_functional(x2.contiguous(), None, tensors, metas[x.dtype], -1)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], out_features)

        return run

    def linear(self, x, prepared, scheme: QuantScheme, out_features, in_features, bias):
        return self.bind(prepared, scheme, out_features, in_features)(x, prepared, bias)
