"""torch's int4 tile layout ("tinygemm"), through torch's own aten ops.

This is the layout of torchao's int4 weight-only tensors (``TensorCoreTiledLayout`` on CUDA,
``Int4CPULayout`` on CPU): nibble codes packed by ``_convert_weight_to_int4pack[_for_cpu]`` and
one (scale, float zero) pair per group and output, ``w = (q - 8) * s + zf``. An integer zero
point ``z`` is the float zero ``zf = (8 - z) * s`` (exact in fp32 for fp16 scales and codes
below 16), so every scheme of at most 4 bits, symmetric or not, fits. The ops take groups of
32, 64, 128 or 256 columns; the callers sort and pad the columns by group first
(``cpu.column_map``), so act-order and other group lengths need nothing else.
"""

from __future__ import annotations

import torch

GROUPS = (256, 128, 64, 32)  # the group lengths the ops take


def sub_group(length: int) -> int:
    """The largest group the ops take that divides a layout group of ``length`` columns."""
    return next(b for b in GROUPS if length % b == 0)


def scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, reps: int) -> torch.Tensor:
    """float scales and zero points [N, G] -> fp32 [G * reps, N, 2] (scale, float zero)."""
    s = scales.to(torch.float32).repeat_interleave(reps, dim=1)
    z = zeros.to(torch.float32).repeat_interleave(reps, dim=1)
    return torch.stack([s, (8 - z) * s], dim=-1).transpose(0, 1).contiguous()


def inner_k_tiles(kp: int) -> int:
    """CUDA's tile depth: the largest of 8 / 4 / 2 with ``kp`` a multiple of 16 times it."""
    return next(t for t in (8, 4, 2) if kp % (16 * t) == 0)


def pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 codes < 16 [N, Kp] -> the op's packed weight on ``device`` (N % 16 == 0 on CPU,
    N % 8 and Kp % 32 == 0 on CUDA)."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).to(device)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(codes.shape[1]))


def columns(w: torch.Tensor) -> int:
    """Kp, the layout columns of a packed weight (CPU [N, Kp/2] bytes; CUDA int32 tiles
    [N/8, Kp/(16*T), 32, T/2])."""
    if w.dim() == 2:
        return w.shape[1] * 2
    return w.shape[1] * 16 * w.shape[3] * 2


def mm(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x [M, Kp] -> [M, N] in x.dtype (the scales cast to it, as the ops require)."""
    block = columns(w) // sz.shape[0]
    op = torch.ops.aten._weight_int4pack_mm_for_cpu if x.device.type == "cpu" else torch.ops.aten._weight_int4pack_mm
    return op(x, w, block, sz.to(x.dtype))
