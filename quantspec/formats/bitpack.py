"""Dense little-endian bit packing of b-bit codes into int32 words (b in 1..8).

One layout serves every format here: along the packed dimension, element ``e`` occupies bits
``[e*b, (e+1)*b)`` of a little-endian bit stream cut into 32-bit words, so 32 elements fill
exactly ``b`` words and no bit is wasted. An element may straddle two words (3-bit: element 10
has its two low bits in bits 30-31 of word 0 and its high bit in bit 0 of word 1).

* b in {2, 4, 8}: this is the classic "nibble i of word j = element (32/b)*j + i" layout of
  GPTQ v1 (qweight along K, qzeros along N), compressed-tensors' pack_to_int32 and AWQ (AWQ
  permutes columns first, see awq.py).
* b = 3: this is AutoGPTQ/GPTQModel's 3-bit layout (32 rows -> 3 words, elements 10 and 21
  cross word boundaries) and the dense layout of compressed-tensors' pack_to_int32 (0.20).

Pure tensor functions; the packed dimension is the last one. Words are returned as int32 (the
two's complement view of the 32 unsigned bits), as every checkpoint stores them.
"""

from __future__ import annotations

import math

import torch

_U32 = (1 << 32) - 1


def pack_multiple(bits: int) -> int:
    """Fewest elements that fill whole int32 words (16 for 2-bit, 32 for 3-bit, 8, 4)."""
    return 32 // math.gcd(32, bits)


def packed_len(length: int, bits: int) -> int:
    """int32 words holding ``length`` b-bit elements: ``ceil(length * bits / 32)``."""
    return (length * bits + 31) // 32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32 bits."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _layout(bits: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the 32 elements of a chunk: word index, bit offset, and whether it straddles."""
    start = torch.arange(32, device=device, dtype=torch.int64) * bits
    return start // 32, start % 32, (start % 32) + bits > 32


_ROWS_ELEMS = 1 << 24  # rows are processed in slices of about this many elements


def _row_slices(rows: int, cols: int) -> list[slice]:
    """Row slices bounding the int64 temporaries (~16M elements) for layers of large models."""
    step = max(1, _ROWS_ELEMS // max(cols, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)] or [slice(0, 0)]


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [R, C] integer codes in [0, 2**bits - 1] along C -> int32 [R, ceil(C*bits/32)].

    Missing elements of the last 32-element chunk are taken as 0.
    """
    if codes.dim() == 2 and codes.shape[0] * codes.shape[1] > _ROWS_ELEMS:
        parts = [pack_int32(codes[s], bits) for s in _row_slices(*codes.shape)]
        return torch.cat(parts, dim=0)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D, got shape {tuple(codes.shape)}")
    rows, cols = codes.shape
    v = codes.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}]")
    chunks = (cols + 31) // 32
    v = torch.nn.functional.pad(v, (0, chunks * 32 - cols))
    if 32 % bits == 0:  # no element straddles: word j = sum_i v[per*j + i] << (bits*i)
        per = 32 // bits
        shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
        words = (v.view(rows, -1, per) << shifts).sum(-1)[:, : packed_len(cols, bits)]
        return _to_int32(words).contiguous()
    v = v.view(rows, chunks, 32)
    word, off, straddle = _layout(bits, codes.device)
    words = torch.zeros(rows, chunks, bits, dtype=torch.int64, device=codes.device)
    # bit fields are disjoint, so adding them is OR-ing them
    words.scatter_add_(2, word.expand(rows, chunks, 32), (v << off) & _U32)
    if bool(straddle.any()):
        high = v[:, :, straddle] >> (32 - off[straddle])
        words.scatter_add_(2, (word[straddle] + 1).expand(rows, chunks, -1), high)
    words = words.view(rows, chunks * bits)[:, : packed_len(cols, bits)]
    return _to_int32(words).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of ``pack_int32``: int32 [R, ceil(length*bits/32)] -> uint8 [R, length]."""
    if packed.dim() == 2 and packed.shape[0] * max(length, 1) > _ROWS_ELEMS:
        parts = [unpack_int32(packed[s], bits, length) for s in _row_slices(packed.shape[0], length)]
        return torch.cat(parts, dim=0)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(
            f"packed must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    rows, nwords = packed.shape
    if nwords != packed_len(length, bits):
        raise ValueError(
            f"{nwords} words cannot hold exactly {length} {bits}-bit elements "
            f"(expected {packed_len(length, bits)})"
        )
    chunks = (length + 31) // 32
    w = packed.to(torch.int64) & _U32
    if 32 % bits == 0:
        per = 32 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * bits
        out = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return out.view(rows, -1)[:, :length].to(torch.uint8)
    w = torch.nn.functional.pad(w, (0, chunks * bits - nwords)).view(rows, chunks, bits)
    word, off, straddle = _layout(bits, packed.device)
    out = w[:, :, word] >> off
    if bool(straddle.any()):
        out[:, :, straddle] |= w[:, :, word[straddle] + 1] << (32 - off[straddle])
    out &= (1 << bits) - 1
    return out.view(rows, chunks * 32)[:, :length].to(torch.uint8)
