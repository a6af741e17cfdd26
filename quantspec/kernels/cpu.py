"""The ``cpu`` backend: int8-activation x packed-weight matmul at memory bandwidth.

Fast path (C++ extension, quantspec/csrc/cpu_qgemm.cpp, built on first use): activations are
quantized to int8 per block of B <= 128 columns (absmax / 127) and multiplied with 4-bit
(bits 2, 3, 4 share the nibble layout) or 8-bit codes in integer arithmetic, fp32 accumulation;
parallel over N. This adds the error of int8 activations (relative ~0.5% of a dot product; see
tests/test_cpu_backend.py) compared with the reference. W8A8 layers use one block per row,
which is exactly the reference's per-token quantization. Above ``DENSE_FROM_M`` rows, weights
are dequantized a tile of rows at a time and multiplied in fp32 (compute-bound regime), with
unquantized activations.

Two layouts (``prepare``; ``prepare_ext(result, layout)``). Both sort columns by group
(act-order) and pad each group to L columns (L a multiple of 32), so Kp = G * L; ``src`` int32
[Kp] names the x column of each layout column (K = a zero column), empty for the identity.
* rows (any CPU: AVX2 maddubs or a portable loop):
  w4 uint8 [N, Kp/2] (64-column chunks: byte j = col j | col 32+j << 4) or w8 int8-as-uint8
  [N, Kp] (code - 128); scales fp16 [N, G]; zeros int8 [N, G] (z, or z - 128 for 8 bits).
* panels (CPUs with AVX-512 VNNI, chosen there by default): 16 output rows per panel, so one
  vpdpbusd yields 16 outputs' partial sums and the per-block scaling is one multiply per 16
  outputs (~3x faster than rows at M = 16 on a 2-core AVX-512 Xeon). w uint8 [P, Kp/8 or Kp/4,
  64], scales fp16 [P, G, 16], zeros uint8 [P, G, 16] (see ``pack_panels``). On CPUs with
  AMX-INT8 (and an OS that grants the tile state), 8 or more rows of x go through tile
  products instead: the panel rows are the tiles' B operand as stored (4-bit: nibbles split
  per chunk), the int32 block sums are the same, so the outputs are bit-identical to the VNNI
  loop (on a 2-core Sapphire-Rapids-class Xeon: 1.1x at M = 8, ~1.6x at M = 16-128).
Without the extension (no compiler) it falls back to torch's packed ops: 4-bit through
``_weight_int4pack_mm_for_cpu`` (``int4pack.py``; bf16 activations and bf16 scales),
per-channel 8-bit through ``_weight_int8pack_mm``, and dequantize + bf16 matmul otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.floatcodes import dequantize_values, pack_fp4_pairs, unpack_fp4_pairs
from ..core.scheme import QuantResult, QuantScheme
from . import int4pack
from .cpu_ext import load_cpu_ext
from .reference import quantize_per_token_int8

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DENSE_FROM_M = 1024  # the int8 kernel beat dequantize + fp32 GEMM up to M=512 on a Zen 3 core
# float weights: fgemm's time grows with every row, dequantize + fp32 GEMM wins from 256 rows
# (one Xeon core, 4864x896 and 896x4864, FP8/NVFP4/MXFP4, fp32 x: 0.58-0.86 of fgemm's time at
# M = 256, 1.4-1.9x it at 64; bf16 x about even at 256); a perplexity window is 512 rows
FLOAT_DENSE_FROM_M = 256
DENSE_TILE_N = 1024
EXT, INT4PACK, INT8PACK, DEQUANT, EXT_PANEL = 0, 1, 2, 3, 4
PANEL = 16  # output rows per panel of the AVX-512 VNNI layout


def _round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def column_map(result: QuantResult, align: int = 32) -> tuple[torch.Tensor, int, int]:
    """src int64 [G*L] (x column per layout column, K = padding), G, L: groups sorted, padded."""
    n, k = result.shape
    gi = result.group_index().cpu()
    groups = result.scales.shape[1]
    counts = torch.bincount(gi, minlength=groups)
    length = _round_up(int(counts.max()), align)
    if groups % 2 == 1 and length % 64 == 32:  # 4-bit chunks are 64 columns
        if groups * 32 <= length:
            length += 32
        else:
            groups += 1
    order = torch.argsort(gi, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(k) - starts[gi[order]]
    src = torch.full((groups * length,), k, dtype=torch.int64)
    src[gi[order] * length + rank] = order
    return src, groups, length


def block_len(length: int, scheme: QuantScheme) -> int:
    """Activation quantization block: the whole row for W8A8, else the largest of 128/64/32."""
    if scheme.activations == "int8-token-dynamic":
        return length
    return next(b for b in (128, 64, 32) if length % b == 0)


def _gather_codes(result: QuantResult, src: torch.Tensor, groups: int) -> tuple:
    """codes uint8 [N, Kp] in layout order, scales float [N, G'], zeros float [N, G']."""
    n, k = result.shape
    padded = torch.cat([result.qweight, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
    codes = padded[:, src]
    extra = groups - result.scales.shape[1]
    scales = torch.nn.functional.pad(result.scales.to(torch.float32), (0, extra))
    zeros = result.zero_points().cpu()
    zeros = torch.nn.functional.pad(zeros, (0, extra))
    return codes, scales, zeros


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp] codes < 16 (Kp % 64 == 0) -> [N, Kp/2]: byte j of chunk c = c[j] | c[32+j] << 4."""
    n, kp = codes.shape
    chunks = codes.reshape(n, kp // 64, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, kp // 2).contiguous()


def pack_panels(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, Kp] codes -> the panel layout uint8 [P, Kp/8 (4-bit) or Kp/4 (8-bit), 64], rows
    padded to P * 16 with code 0; byte 4i+t of step j is row 16p+i's column 8j+t (| 8j+4+t << 4)
    for 4 bits, its column 4j+t for 8 bits."""
    n, kp = codes.shape
    panels = -(-n // PANEL)
    c = torch.nn.functional.pad(codes, (0, 0, 0, panels * PANEL - n))
    if bits == 8:
        c = c.reshape(panels, PANEL, kp // 4, 4)
    else:
        c = c.reshape(panels, PANEL, kp // 8, 2, 4)
        c = c[:, :, :, 0] | (c[:, :, :, 1] << 4)
    return c.permute(0, 2, 1, 3).reshape(panels, -1, 4 * PANEL).contiguous()


def _panel_params(t: torch.Tensor) -> torch.Tensor:
    """[N, G] per-row values -> [P, G, 16] (rows padded with 0)."""
    n, groups = t.shape
    panels = -(-n // PANEL)
    t = torch.nn.functional.pad(t, (0, 0, 0, panels * PANEL - n))
    return t.reshape(panels, PANEL, groups).transpose(1, 2).contiguous()


def panels_supported() -> bool:
    """Whether the extension runs the panel layout here (a CPU with AVX-512 VNNI)."""
    ext = load_cpu_ext()
    return ext is not None and ext.has_vnni()


def layout_columns(p: dict[str, torch.Tensor]) -> int:
    """Kp: the columns of an extension layout (rows or panels), padding included."""
    kind, bits = int(p["meta"][0]), int(p["meta"][1])
    if kind == EXT_PANEL:
        return p["w"].shape[1] * (8 if bits <= 4 else 4)
    return p["w"].shape[1] * (2 if bits <= 4 else 1)


def _src_tensor(src: torch.Tensor, k: int) -> torch.Tensor:
    identity = torch.equal(src[:k], torch.arange(k)) and bool((src[k:] == k).all())
    return torch.empty(0, dtype=torch.int32) if identity else src.to(torch.int32)


def _meta(kind: int, bits: int, block: int, k: int) -> torch.Tensor:
    return torch.tensor([kind, bits, block, k], dtype=torch.int64)


def prepare_ext(result: QuantResult, layout: str = "auto") -> dict[str, torch.Tensor]:
    """The extension's layout (see the module docstring): ``rows``, ``panels`` (AVX-512 VNNI
    CPUs), or ``auto`` = panels where they run, else rows."""
    if layout not in ("auto", "rows", "panels"):
        raise ValueError(f"layout={layout!r} is not auto, rows or panels")
    if layout == "auto":
        layout = "panels" if panels_supported() else "rows"
    scheme = result.scheme
    n, k = result.shape
    src, groups, length = column_map(result)
    codes, scales, zeros = _gather_codes(result, src, groups)
    meta = (scheme.bits, block_len(length, scheme), k)
    if layout == "panels":
        return {
            "w": pack_panels(codes, 8 if scheme.bits == 8 else 4),
            "scales": _panel_params(scales.to(torch.float16)),
            "zeros": _panel_params(zeros.round().to(torch.uint8)),
            "src": _src_tensor(src, k),
            "meta": _meta(EXT_PANEL, *meta),
        }
    if scheme.bits == 8:
        w = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8).contiguous()
        zeros = zeros - 128
    else:
        w = pack_nibbles(codes)
    return {
        "w": w,
        "scales": scales.to(torch.float16).contiguous(),
        "zeros": zeros.to(torch.int8).contiguous(),
        "src": _src_tensor(src, k),
        "meta": _meta(EXT, *meta),
    }


def prepare_torch(result: QuantResult) -> dict[str, torch.Tensor]:
    """Layouts for torch's own ops when the extension is unavailable."""
    scheme = result.scheme
    n, k = result.shape
    src, groups, length = column_map(result)
    codes, scales, zeros = _gather_codes(result, src, groups)
    src_t = _src_tensor(src, k)
    if scheme.bits <= 4 and n % 16 == 0:
        sub = int4pack.sub_group(length)
        return {"w": int4pack.pack(codes, torch.device("cpu")),
                "sz": int4pack.scales_and_zeros(scales, zeros, length // sub), "src": src_t,
                "meta": _meta(INT4PACK, scheme.bits, sub, k)}
    if scheme.bits == 8 and groups == 1:
        return {"w": (codes.to(torch.int16) - 128).to(torch.int8), "scales": scales[:, 0],
                "zoff": ((zeros[:, 0] - 128) * scales[:, 0]), "src": src_t,
                "meta": _meta(INT8PACK, 8, length, k)}
    return {"w": codes, "scales": scales, "zeros": zeros, "src": src_t,
            "meta": _meta(DEQUANT, scheme.bits, length, k)}


def _gather(x2: torch.Tensor, src: torch.Tensor, kp: int) -> torch.Tensor:
    """x [M, K] -> [M, Kp] in layout column order (zeros in the padding)."""
    if src.numel() == 0:
        return torch.nn.functional.pad(x2, (0, kp - x2.shape[1]))
    return torch.nn.functional.pad(x2, (0, 1))[:, src.to(torch.int64)]


def _dense_ext(ext, x2, p, scheme, n, bits) -> torch.Tensor:
    """Compute-bound regime: dequantize DENSE_TILE_N rows at a time, fp32 matmul."""
    w8a8 = scheme.activations == "int8-token-dynamic"
    if w8a8:
        qx, sx = quantize_per_token_int8(x2)
        xs = qx.to(torch.float32)
    else:
        xs = x2.to(torch.float32)
    xs = _gather(xs, p["src"], layout_columns(p))
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    ext_bits = 4 if bits <= 4 else 8
    dequant = ext.dequant_panel_rows if int(p["meta"][0]) == EXT_PANEL else ext.dequant_rows
    for n0 in range(0, n, DENSE_TILE_N):
        n1 = min(n, n0 + DENSE_TILE_N)
        w = dequant(p["w"], p["scales"], p["zeros"], ext_bits, n0, n1)
        torch.mm(xs, w.T, out=y[:, n0:n1])
    return y * sx if w8a8 else y


def _linear_torch(x2, p, scheme, n, bias) -> torch.Tensor:
    kind = int(p["meta"][0])
    kp = int4pack.columns(p["w"]) if kind == INT4PACK else p["w"].shape[1]
    sx = None
    if scheme.activations == "int8-token-dynamic":
        qx, sx = quantize_per_token_int8(x2)
        xs = _gather(qx.to(torch.float32), p["src"], kp)
    else:
        xs = _gather(x2.to(torch.float32), p["src"], kp)
    if kind == INT8PACK and sx is not None:  # exact integer products, as the reference
        acc = torch._int_mm(xs.to(torch.int8), p["w"].t()).float()
        y = (acc * p["scales"] - xs.sum(dim=1, keepdim=True) * p["zoff"]) * sx
        return y if bias is None else y + bias.to(torch.float32)
    if kind == INT4PACK:
        y = int4pack.mm(xs.to(torch.bfloat16), p["w"], p["sz"]).float()
    elif kind == INT8PACK:
        y = torch.ops.aten._weight_int8pack_mm(
            xs.to(torch.bfloat16), p["w"], p["scales"].to(torch.bfloat16)).float()
        y = y - xs.sum(dim=1, keepdim=True) * p["zoff"]
    else:
        groups = p["scales"].shape[1]
        length = p["w"].shape[1] // groups
        s = p["scales"].repeat_interleave(length, dim=1)
        z = p["zeros"].repeat_interleave(length, dim=1)
        w = ((p["w"].to(torch.float32) - z) * s).to(torch.bfloat16)
        y = (xs.to(torch.bfloat16) @ w.T).float()
    if sx is not None:
        y = y * sx
    return y if bias is None else y + bias.to(torch.float32)


@dataclass(frozen=True)
class BoundQGemm:
    """``CpuBackend.linear`` for one extension layout, as ``torch.ops.quantspec_cpu.qgemm``
    with the layer's constants (a plain object: picklable, traced by torch.compile)."""

    scheme: QuantScheme
    out_features: int
    in_features: int
    bits: int  # 4 (bits 2, 3, 4 share the nibble layout) or 8
    block: int
    panels: bool = False  # the panel layout (quantspec_cpu.qgemm_panel)

    def __call__(self, x: torch.Tensor, p: dict[str, torch.Tensor], bias: torch.Tensor | None):
        # a decode step calls this hundreds of times: few tensor attribute reads, one op call
        lead = x.shape[:-1]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the layer takes {self.in_features}")
        if x.dtype not in DTYPES or not x.is_cpu:
            raise ValueError(f"x must be a CPU fp32/bf16/fp16 tensor, got {x.dtype} on {x.device}")
        x2 = x.reshape(-1, self.in_features) if len(lead) != 1 else x
        if x2.shape[0] >= DENSE_FROM_M:
            return CpuBackend().linear(x, p, self.scheme, self.out_features, self.in_features, bias)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.panels:
            y = _ops().qgemm_panel.default(x2, p["w"], p["scales"], p["zeros"], p["src"], bias,
                                           self.bits, self.block, self.out_features)
        else:
            y = _ops().qgemm.default(x2, p["w"], p["scales"], p["zeros"], p["src"], bias,
                                     self.bits, self.block, True)
        return y if len(lead) == 1 else y.view(*lead, self.out_features)


@functools.cache
def _ops():
    """The extension's op namespace (looked up once: ``torch.ops`` attribute lookups cost
    microseconds per call)."""
    return torch.ops.quantspec_cpu


FLOAT_KINDS = {"fp8": 0, "nvfp4": 1, "mxfp4": 2}


def float_weight_rows(p: dict[str, torch.Tensor], weights: str, group_len: int, n0: int, n1: int) -> torch.Tensor:
    """fp32 rows n0:n1 [n1 - n0, K] of the weight a ``prepare_float`` layout holds (exactly the
    reference's ``dequantize_values``)."""
    codes = p["fcodes"][n0:n1]
    stored = p["fscales"][n0:n1]
    if weights != "fp8":
        codes = unpack_fp4_pairs(codes)
    if weights == "nvfp4":
        stored = stored.view(torch.float8_e4m3fn)  # prepare_float keeps the E4M3 bytes
    return dequantize_values(codes, stored, weights, group_len, p["gscale"])


def _dense_float(x2: torch.Tensor, p: dict[str, torch.Tensor], scheme: QuantScheme, n: int, k: int) -> torch.Tensor:
    """Compute-bound regime of float weights: DENSE_TILE_N rows dequantized at a time, fp32 matmul."""
    xs = x2.to(torch.float32)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, DENSE_TILE_N):
        n1 = min(n, n0 + DENSE_TILE_N)
        torch.mm(xs, float_weight_rows(p, scheme.weights, scheme.group_len(k), n0, n1).T, out=y[:, n0:n1])
    return y


def prepare_float(result: QuantResult) -> dict[str, torch.Tensor]:
    """The layout of ``quantspec_cpu::fgemm`` (csrc/cpu_fgemv.cpp): FP8 codes [N, K] and fp32
    channel scales; FP4 codes two per byte (column 2j low nibble) and the stored scale bytes
    (E4M3 for NVFP4, with the global scale; E8M0 for MXFP4), decoded in the kernel."""
    kind = result.scheme.weights
    codes = result.qweight
    if kind != "fp8":
        codes = pack_fp4_pairs(codes)
    scales = result.scales.to(torch.float32) if kind == "fp8" else result.scales.contiguous().view(torch.uint8)
    gscale = result.global_scale if result.global_scale is not None else torch.ones(1)
    return {"fcodes": codes.contiguous(), "fscales": scales.contiguous(),
            "gscale": gscale.to(torch.float32).reshape(1).contiguous(),
            "fkind": torch.tensor(FLOAT_KINDS[kind])}


class CpuBackend:
    """Packed 2/3/4/8-bit weights (any group size, act-order, W8A8) on CPU tensors; FP8 (per
    channel) / NVFP4 / MXFP4 weight-only with unquantized activations (``prepare_float``). FP8
    block scales and FP8 activations are left to the reference backend (``cannot_run`` says so)."""

    name = "cpu"

    def cannot_run(self, scheme, out_features, in_features, device, dtype):
        if scheme.is_float:
            if scheme.activations is not None:
                return f"{scheme.short_name} (FP8 activations) runs on the reference backend"
            if scheme.is_block:
                return ("fp8 block scales (one per 128x128 block) run on the reference backend "
                        "(cpu_fgemv.cpp takes one fp8 scale per output channel)")
            if load_cpu_ext() is None:
                return f"{scheme.weights} weights need the C++ extension (cpu_fgemv.cpp), which is not built here"
            if in_features % (16 if scheme.weights == "fp8" else scheme.group_size):
                return f"in_features={in_features} is not a multiple of the kernel's step"
        if torch.device(device).type != "cpu":
            return f"runs on CPU tensors only, not {torch.device(device).type}"
        if dtype not in DTYPES:
            return f"activations must be fp32, bf16 or fp16, not {dtype}"
        if out_features < 1 or in_features < 1:
            return "empty layer"
        return None

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if result.scheme.is_float:
            return prepare_float(result.to("cpu"))
        result = QuantResult(
            result.qweight.cpu(), result.scales.cpu(),
            None if result.zeros is None else result.zeros.cpu(),
            None if result.g_idx is None else result.g_idx.cpu(), result.scheme,
        )
        if load_cpu_ext() is not None:
            return prepare_ext(result)
        return prepare_torch(result)

    def bind(self, prepared, scheme: QuantScheme, out_features: int, in_features: int):
        """The extension's op with this layer's constants (the layout's kind, bits and block
        read once), or None for torch's fallback layouts (``linear`` serves those)."""
        if scheme.is_float:
            return None
        kind, bits, block, _ = prepared["meta"].tolist()
        if kind not in (EXT, EXT_PANEL) or load_cpu_ext() is None:
            return None
        return BoundQGemm(scheme, out_features, in_features, 4 if bits <= 4 else 8, block,
                          kind == EXT_PANEL)

    def linear(self, x, prepared, scheme: QuantScheme, out_features, in_features, bias):
        """x [..., K] (fp32/bf16/fp16, CPU) -> [..., N] in x.dtype."""
        if x.shape[-1] != in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the layer takes {in_features}")
        if x.device.type != "cpu" or x.dtype not in DTYPES:
            raise ValueError(f"x must be a CPU fp32/bf16/fp16 tensor, got {x.dtype} on {x.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_features)
        if scheme.is_float:
            if load_cpu_ext() is None:
                raise RuntimeError("float weights need the cpu extension, which is not built here")
            if x2.shape[0] >= FLOAT_DENSE_FROM_M:
                y = _dense_float(x2, prepared, scheme, out_features, in_features)
            else:
                xk = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.float32)  # bf16: the AVX-512 BF16 path
                y = torch.ops.quantspec_cpu.fgemm(xk, prepared["fcodes"], prepared["fscales"], prepared["gscale"],
                                                  int(prepared["fkind"]), scheme.group_len(in_features))
            if bias is not None:
                y = y + bias.to(torch.float32)
            return y.to(x.dtype).reshape(*lead, out_features)
        kind, bits, block, _ = prepared["meta"].tolist()
        if kind in (EXT, EXT_PANEL):
            ext = load_cpu_ext()
            if ext is None:
                raise RuntimeError("layer was prepared for the cpu extension, which is gone")
            if x2.shape[0] < DENSE_FROM_M:  # the bound op's path (one kernel call)
                bound = BoundQGemm(scheme, out_features, in_features, 4 if bits <= 4 else 8, block,
                                   kind == EXT_PANEL)
                return bound(x, prepared, bias)
            y = _dense_ext(ext, x2, prepared, scheme, out_features, bits)
            if bias is not None:
                y = y + bias.to(torch.float32)
        else:
            y = _linear_torch(x2, prepared, scheme, out_features, bias)
        return y.to(x.dtype).reshape(*lead, out_features)
