"""The Triton backend: fused dequant-GEMM kernels for CUDA and ROCm (one source).

Runs weight-only schemes (2/3/4/8-bit, group sizes -1/32/64/128, symmetric or not, act-order)
with fp16, bf16 or fp32 activations, and W8A8 (int8 per-token dynamic activations). Importing
this module raises ImportError when Triton is missing, so the registry skips it. It runs on
CUDA/ROCm devices, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests).

Prepared layout (see ``triton/wq_gemm.py`` for the bit order):

* weight-only: ``qweight`` int32 [ceil(K/PF), N] packed along K, or instead ``qweight_mma``
  int32 [ceil(N/16), ceil(K/64), 128] or ``qweight_mfma`` [ceil(N/16), ceil(K/128), 256]
  (``weight_layout``, ``triton/layout.py``: pre-shuffled so that each thread's load is its tl.dot
  fragment, NVIDIA's or AMD's; the key says which); ``scales`` [G, N] in the
  checkpoint's scale dtype (fp16 scales are not rounded to bf16); ``zeros`` uint8 [G, N] when
  asymmetric; with act-order either ``perm`` int32 [K] (strategy "permute") or ``g_idx``
  int32 [K] (strategy "gidx").
* W8A8: ``qweight`` int8 [N, K] (code - 128), ``wscale`` fp32 [N].
* float weight-only (FP8 per channel or in 128x128 blocks, NVFP4, MXFP4): ``fcodes`` uint8 and
  decoded fp32 ``fscales`` [G, N] (``triton/fp_gemm.py``; FP8 block: the per-row scales of the
  canonical result, one row of scales per 128 input columns).
* FP8 W8A8 (fp8-dynamic, fp8-static, fp8-block): ``f8weight`` uint8 [N, K] fp8 bytes of the
  target's flavour (``fp8_format``: E4M3FNUZ on MI300, bytes kept and scales doubled), ``f8scale``
  fp32 [N] or [K / 128, N] (FP8 block), ``input_scale`` fp32 [1] for fp8-static
  (``triton/fp8_w8a8.py``).

Act-order strategies. "permute" (default) sorts the rows of W by group once at load, so every
group is contiguous again and a tile reads one row of scales, and gathers x's columns at run
time: extra traffic M*K activations read and written, against N*K/2 bytes of int4 weights, so
it wins while M < N/4, i.e. for decode and small batches, where the kernel is memory-bound.
"gidx" keeps the original order and gathers one scale (and zero) per weight element: no
activation copy but BLOCK_K times more scale loads (cache hits, yet load instructions in the
inner loop). A g_idx that sorting cannot turn into contiguous equal groups falls back to "gidx".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import triton  # noqa: F401  (ImportError here makes the registry skip this backend)

from ..core.floatcodes import decode_scales, e4m3fn_to_fnuz
from ..core.scheme import QuantResult, QuantScheme
from .act_order import contiguous_groups_perm
from .op_call import call_quant_linear
from .triton import configs
from .triton.fp8_w8a8 import BLOCK as FP8_BLOCK_COLS, fp8_format, fp8_linear
from .triton.fp_gemm import FP4, FP8, PER_CHANNEL_GROUP, fp_linear, prepare_float
from .triton.w8a8 import w8a8_linear
from .triton.layout import LAYOUT_GPTQ, LAYOUT_MFMA, LAYOUT_MMA, preshuffle, preshuffle_reason
from .triton.wq_gemm import PER_CHANNEL_GROUP as WQ_PER_CHANNEL, PRESHUFFLED_BACKENDS, field_bits, wq_linear

ACT_ORDER_STRATEGIES = ("permute", "gidx")
WEIGHT_LAYOUTS = ("auto", LAYOUT_GPTQ, LAYOUT_MMA, LAYOUT_MFMA)
QWEIGHT_KEYS = {LAYOUT_GPTQ: "qweight", LAYOUT_MMA: "qweight_mma", LAYOUT_MFMA: "qweight_mfma"}


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, K] codes -> int32 [ceil(K / PF), N], PF = 32 // field_bits(bits).

    Field i (bits ``FB*i .. FB*i+FB-1``) of word [j, n] holds the code of row ``PF*j + i``;
    rows past K are zero.
    """
    fb = field_bits(bits)
    pf = 32 // fb
    n, k = codes.shape
    kw = -(-k // pf)
    t = torch.zeros((kw * pf, n), dtype=torch.int64, device=codes.device)
    t[:k] = codes.t().to(torch.int64)
    shifts = (torch.arange(pf, device=codes.device, dtype=torch.int64) * fb).view(1, pf, 1)
    words = (t.view(kw, pf, n) << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32).contiguous()


class TritonBackend:
    """Fused dequant-GEMM.

    act_order: the act-order strategy, "permute" (default) or "gidx" (see the module doc).
    autotune: False runs the first fitting config per target instead of tuning (tests).
    fp8: the FP8 flavour of W8A8 (FP8 activations): "e4m3fn" or "e4m3fnuz"; None picks the
    current target's (``fp8_w8a8.fp8_format``).
    weight_layout: the weight-only qweight layout: "gptq", "mma16x64" / "mfma16x128" (pre-shuffled
    for NVIDIA / AMD tensor cores: 4-bit fields, groups of a multiple of 128 or per channel, no
    g_idx; others keep "gptq", with a warning saying why) or "auto" (default): "mma16x64" where it
    can hold the weight on the backends of ``wq_gemm.PRESHUFFLED_BACKENDS``, else "gptq".
    """

    name = "triton"

    def __init__(self, act_order: str = "permute", autotune: bool = True, fp8: str | None = None,
                 weight_layout: str = "auto"):
        if weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
        if act_order not in ACT_ORDER_STRATEGIES:
            raise ValueError(f"act_order must be one of {ACT_ORDER_STRATEGIES}, got {act_order!r}")
        if fp8 not in (None, "e4m3fn", "e4m3fnuz"):
            raise ValueError(f"fp8 must be e4m3fn, e4m3fnuz or None, got {fp8!r}")
        self.act_order = act_order
        self.autotune = autotune
        self.fp8 = fp8
        self.weight_layout = weight_layout

    def _layout_for(self, bits: int, group: int, has_gidx: bool, device: torch.device) -> str:
        """The qweight layout ``prepare`` writes for a weight on ``device``."""
        if self.weight_layout == LAYOUT_GPTQ:
            return LAYOUT_GPTQ
        reason = preshuffle_reason(bits, group, has_gidx)
        if self.weight_layout != "auto":
            if reason is not None:
                warnings.warn(f"weight_layout {self.weight_layout!r}: {reason}; keeping {LAYOUT_GPTQ!r}", stacklevel=3)
                return LAYOUT_GPTQ
            if (self.weight_layout == LAYOUT_MFMA and device.type == "cuda" and torch.version.hip is None
                    and not configs.interpreting()):  # AMD's fragments: NVIDIA's tiles on it spill (kernel-spills.md)
                warnings.warn(f"weight_layout {LAYOUT_MFMA!r} is AMD's MFMA layout; an NVIDIA GPU takes "
                              f"{LAYOUT_MMA!r}", stacklevel=3)
                return LAYOUT_MMA
            return self.weight_layout
        if configs.interpreting() or device.type != "cuda":
            backend = "interpreter"
        else:
            backend = "hip" if torch.version.hip is not None else "cuda"
        return LAYOUT_MMA if backend in PRESHUFFLED_BACKENDS and reason is None else LAYOUT_GPTQ

    def _fp8_format(self) -> str:
        """The FP8 flavour, the target's looked up once (not a driver query per linear call)."""
        if self.fp8 is None:
            self.fp8 = fp8_format(configs.current_target())
        return self.fp8

    def cannot_run(
        self, scheme: QuantScheme, out_features: int, in_features: int,
        device: torch.device, dtype: torch.dtype,
    ) -> str | None:
        device = torch.device(device)
        fp8_acts = scheme.is_float and scheme.activations is not None
        if fp8_acts and scheme.is_block and in_features % FP8_BLOCK_COLS:
            return f"{scheme.short_name} needs K a multiple of {FP8_BLOCK_COLS}, the layer has {in_features}"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"activations must be fp16, bf16 or fp32, not {dtype}"
        if device.type == "cpu":
            if configs.interpreting():
                return None
            return "Triton runs on CUDA/ROCm GPUs (TRITON_INTERPRET=1 runs its CPU interpreter, for tests)"
        if device.type != "cuda":
            return f"Triton runs on CUDA/ROCm GPUs, not {device.type}"
        if not torch.cuda.is_available():
            return "no CUDA/ROCm device is visible"
        if torch.version.hip is None:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (7, 5):
                return f"needs compute capability >= 7.5, the GPU has {major}.{minor}"
            if dtype == torch.bfloat16 and major < 8:
                return "bf16 needs compute capability >= 8.0"
            if fp8_acts and (major, minor) < (8, 9):
                return f"{scheme.short_name} (fp8 tl.dot) needs compute capability >= 8.9, the GPU has {major}.{minor}"
        elif fp8_acts:
            arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
            if not arch.startswith(("gfx94", "gfx95")):
                return f"{scheme.short_name} (fp8 tl.dot) needs an MI300 or MI355 GPU (gfx942 / gfx950), not {arch}"
        return None

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        scheme = result.scheme
        if scheme.is_float and scheme.activations is not None:
            return self._prepare_fp8(result)
        if scheme.is_float:
            scales = decode_scales(result.scales, scheme.weights, result.global_scale)
            return prepare_float(result.qweight, scales, FP8 if scheme.weights == "fp8" else FP4)
        if scheme.activations == "int8-token-dynamic":
            return {
                "qweight": (result.qweight.to(torch.int16) - 128).to(torch.int8).contiguous(),
                "wscale": result.scales[:, 0].to(torch.float32).contiguous(),
            }
        n, k = result.shape
        glen = scheme.group_len(k)
        codes, g_idx, out = result.qweight, result.g_idx, {}
        if g_idx is not None and torch.equal(g_idx.to(torch.int64), torch.arange(k, device=g_idx.device) // glen):
            g_idx = None  # static groups, or act-order that kept the natural order
        if g_idx is not None and self.act_order == "permute":
            perm = contiguous_groups_perm(g_idx, glen)
            if perm is not None:
                codes, g_idx = codes[:, perm], None
                out["perm"] = perm.to(torch.int32).contiguous()
        if g_idx is not None:
            out["g_idx"] = g_idx.to(torch.int32).contiguous()
        group = WQ_PER_CHANNEL if scheme.group_size == -1 else glen
        layout = self._layout_for(scheme.bits, group, g_idx is not None, codes.device)
        out[QWEIGHT_KEYS[layout]] = pack_codes(codes, scheme.bits)
        if layout != LAYOUT_GPTQ:
            out[QWEIGHT_KEYS[layout]] = preshuffle(out[QWEIGHT_KEYS[layout]], k, layout)
        out["scales"] = result.scales.t().contiguous()
        if result.zeros is not None:
            out["zeros"] = result.zeros.t().contiguous()
        return out

    def _prepare_fp8(self, result: QuantResult) -> dict[str, torch.Tensor]:
        codes, scales = result.qweight, result.scales.to(torch.float32)
        if self._fp8_format() == "e4m3fnuz":
            codes, scales = e4m3fn_to_fnuz(codes, scales)
        # FP8 block: per-row scales [N, K / 128] (equal within 128-row blocks) -> [K / 128, N]
        scales = scales.t().contiguous() if result.scheme.is_block else scales.reshape(-1).contiguous()
        out = {"f8weight": codes.contiguous(), "f8scale": scales}
        if result.input_scale is not None:
            out["input_scale"] = result.input_scale.to(torch.float32).reshape(1).contiguous()
        return out

    def bind(self, prepared, scheme: QuantScheme, out_features: int, in_features: int):
        """A weight-only layer's call with its decisions taken once (``BoundWQ``); None for the
        float, FP8 and W8A8 schemes (``linear`` serves those)."""
        if scheme.is_float or scheme.activations is not None:
            return None
        layout = next(lay for lay, key in QWEIGHT_KEYS.items() if key in prepared)
        return BoundWQ(scheme, out_features, in_features, layout, "perm" in prepared, self.autotune)

    def linear(
        self, x: torch.Tensor, prepared: dict[str, torch.Tensor], scheme: QuantScheme,
        out_features: int, in_features: int, bias: torch.Tensor | None,
    ) -> torch.Tensor:
        bound = self.bind(prepared, scheme, out_features, in_features)
        if bound is not None:  # weight-only: the bound call, decisions read now
            return bound(x, prepared, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_features)
        if "perm" in prepared:
            x2 = x2.index_select(1, prepared["perm"])
        elif x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if bias is not None:
            bias = bias.contiguous()
        if "f8weight" in prepared:
            y = fp8_linear(x2, prepared["f8weight"], prepared["f8scale"], bias, self._fp8_format(),
                           grouped=scheme.is_block, static_scale=prepared.get("input_scale"), autotune=self.autotune)
        elif scheme.is_float:
            fp8 = scheme.weights == "fp8"
            y = fp_linear(x2, prepared["fcodes"], prepared["fscales"], bias, FP8 if fp8 else FP4,
                          PER_CHANNEL_GROUP if scheme.group_size == -1 else scheme.group_size, self.autotune)
        else:  # int8-token-dynamic
            y = w8a8_linear(x2, prepared["qweight"], prepared["wscale"], bias, self.autotune)
        return y.reshape(*lead, out_features)


@dataclass(frozen=True)
class BoundWQ:
    """``TritonBackend.linear`` for one weight-only layer, with the qweight's layout, the
    act-order permutation and the tuning mode read once at ``bind``: an eager call goes straight
    to ``wq_linear``; under torch.compile it is the custom op ``quantspec::quant_linear``, as
    without binding (a plain object: picklable)."""

    scheme: QuantScheme
    out_features: int
    in_features: int
    layout: str
    permute: bool
    autotune: bool

    def __call__(self, x: torch.Tensor, p: dict[str, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the op QuantLinear.prepare registered, traced as one node
            return call_quant_linear(x, p, TritonBackend.name, self.scheme, self.out_features, self.in_features, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.permute:
            x2 = x2.index_select(1, p["perm"])
        elif x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = wq_linear(x2, p[QWEIGHT_KEYS[self.layout]], p["scales"], p.get("zeros"), p.get("g_idx"),
                      None if bias is None else bias.contiguous(), bits=self.scheme.bits,
                      group_size=self.scheme.group_size, autotune=self.autotune, layout=self.layout)
        return y.reshape(*lead, self.out_features)
