"""The ``marlin`` backend: vLLM's Marlin kernels for integer weight-only layers on NVIDIA GPUs.

Marlin (a mixed-precision GEMM that streams 4-bit weights at close to the memory bandwidth for
batch 1-16) ships in vLLM's CUDA build. This backend uses vLLM's own preparation helpers
(``marlin_utils``: repack into Marlin's tile order, scale and zero-point permutations, tile
padding) and its ``apply_gptq_marlin_linear``, so the layout is exactly the one vLLM serves.
It is written against vLLM 0.3x's helpers (``marlin_padded_nk`` and the ``marlin_gemm`` op
without ``g_idx``); ``cannot_run`` says when the installed vLLM lacks them.

What it runs: 4-bit (symmetric as ``uint4b8``, asymmetric with zero points as ``uint4``) and
symmetric 8-bit (``uint8b128``), every group size quantspec writes (-1 / 32 / 64 / 128), fp16 or bf16 activations, on
sm80+. Act-order checkpoints are sorted by group at prepare and x gathered per call (the
Marlin op of these vLLM versions takes no ``g_idx``). Nothing here runs on a CPU-only machine:
the tests there check the declared limits; ``tests/test_peer_backends_gpu.py`` checks the
outputs against the reference where vLLM's CUDA build is importable.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..core.scheme import QuantResult, QuantScheme
from .act_order import group_sorted_codes

HELPERS = "vllm.model_executor.layers.quantization.utils.marlin_utils"


def vllm_cuda_reason() -> str | None:
    """None when vLLM's CUDA build with Marlin's ops and helpers imports here, else why not."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (its CUDA build carries Marlin: pip install vllm)"
    try:
        utils = importlib.import_module(HELPERS)
        importlib.import_module("vllm._custom_ops")
    except Exception as e:  # a vLLM import fails in many ways on a machine it was not built for
        return f"vLLM does not import here ({type(e).__name__}: {e})"
    missing = [n for n in ("marlin_padded_nk", "marlin_pad_qweight", "apply_gptq_marlin_linear")
               if not hasattr(utils, n)]
    if missing:
        return f"the installed vLLM's Marlin helpers differ from 0.3x's (no {', '.join(missing)})"
    if not hasattr(torch.ops._C, "gptq_marlin_repack"):
        return "the installed vLLM build has no Marlin ops (a CPU or ROCm build)"
    return None


def weight_type(scheme: QuantScheme):
    """vLLM's scalar type of the codes: the bias form for symmetric codes, plain with zeros."""
    from vllm.scalar_type import scalar_types

    if not scheme.symmetric:
        return scalar_types.uint4
    return scalar_types.uint4b8 if scheme.bits == 4 else scalar_types.uint8b128


class MarlinBackend:
    name = "marlin"

    def cannot_run(self, scheme: QuantScheme, out_features: int, in_features: int,
                   device: torch.device, dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        if scheme.is_float or scheme.activations is not None:
            return f"runs integer weight-only schemes, not {scheme.short_name}"
        if scheme.bits not in (4, 8):
            return f"Marlin's integer kernels take 4 or 8 bits, not {scheme.bits}"
        if scheme.bits == 8 and not scheme.symmetric:
            return "Marlin takes zero points with 4-bit codes only"
        if scheme.group_size > 0 and in_features % scheme.group_size:
            return f"in_features={in_features} is not a multiple of the group size {scheme.group_size}"
        if device.type != "cuda":
            return f"runs on NVIDIA GPUs, not {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"activations must be fp16 or bf16, not {dtype}"
        if torch.version.hip is not None:
            return "Marlin is NVIDIA's (inline PTX); this is a ROCm build of torch"
        reason = vllm_cuda_reason()
        if reason:
            return reason
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"needs compute capability >= 8.0, the GPU has {major}.{minor}"
        return None

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``qweight`` Marlin's tiles, ``scales`` (permuted, in ``dtype``), ``zeros`` (packed,
        empty when symmetric), ``workspace`` its locks, ``perm`` int32 [K] (act-order: the x
        column of each sorted column; empty otherwise)."""
        from vllm import _custom_ops as ops
        utils = importlib.import_module(HELPERS)

        from .triton_backend import pack_codes

        scheme = result.scheme
        n, k = result.shape
        device = result.qweight.device
        codes, perm = group_sorted_codes(result, "Marlin")
        group = scheme.group_size if scheme.group_size > 0 else -1
        pn, pk = utils.marlin_padded_nk(n, k, group)
        qweight = ops.gptq_marlin_repack(
            utils.marlin_pad_qweight(pack_codes(codes, scheme.bits), n, k, pn, pk),
            size_k=pk, size_n=pn, num_bits=scheme.bits)
        scales = utils.marlin_permute_scales(
            utils.marlin_pad_scales(result.scales.t().to(dtype).contiguous(), n, k, pn, pk, group),
            size_k=pk, size_n=pn, group_size=group)
        if result.zeros is None:
            zeros = torch.empty(0, dtype=torch.int32, device=device)
        else:
            padded = utils.marlin_pad_scales(result.zeros.t().to(torch.int32).contiguous(), n, k, pn, pk, group)
            zeros = utils.marlin_zero_points(padded, size_k=padded.shape[0], size_n=pn, num_bits=scheme.bits)
        workspace = utils.marlin_make_workspace_new(device, getattr(utils, "MARLIN_MAX_BLOCKS_PER_SM", 1))
        return {"qweight": qweight, "scales": scales, "zeros": zeros, "workspace": workspace, "perm": perm}

    def linear(self, x, prepared, scheme: QuantScheme, out_features, in_features, bias):
        utils = importlib.import_module(HELPERS)
        x2 = x.reshape(-1, in_features)
        if prepared["perm"].numel():
            x2 = x2[:, prepared["perm"].to(torch.int64)]
        scales = prepared["scales"]
        y = utils.apply_gptq_marlin_linear(
            input=x2.contiguous(), weight=prepared["qweight"], weight_scale=scales.to(x.dtype),
            weight_zp=prepared["zeros"], workspace=prepared["workspace"], wtype=weight_type(scheme),
            output_size_per_partition=out_features, input_size_per_partition=in_features)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], out_features)
