"""The small ops of a decoder block, each one op of the CPU extension where it is built.

At decode these ops cost more in dispatch than in arithmetic (transformers' RMSNorm is eight
ops, rotary six per tensor); the torch expressions here are the references the ops are tested
against.

- ``rms_norm(x, weight, eps)``: transformers' Llama RMSNorm, ``weight * (x32 * rsqrt(mean(x32^2)
  + eps)).to(x.dtype)`` over the last dimension.
- ``rms_norm_rounded_once(x, weight, eps)``: GPT-OSS's, ``(weight * x32 * rsqrt(...)).to(x.dtype)``
  (the weight applied in fp32, one rounding; the weight may be fp32 in a bf16 model).
- ``rope(x, cos, sin_signed)``: rotary embedding of x [B, T, H, D] with cos and sin [B, T, D] as
  the model's ``rotary_emb`` returns them, sin with its first half negated (``signed_sin``):
  ``x * cos + rotate_half(x) * sin == x * cos + roll(x, D/2) * sin_signed``.
- ``silu_mul(gate, up)``: ``silu(gate) * up`` (the SwiGLU of a Llama MLP).
- ``attend(q, k, v, cos, sin_signed, k_cache, v_cache, lo, sinks, window)``: a decode step's
  attention over a cache without holes: rope on q and k, k and v written into the caches
  [B, KV, cap, D] at columns [lo, lo + t), causal attention of the t queries over columns
  [0, lo + t) with grouped-query heads (``window``: each query over its last ``window`` columns
  only; ``sinks``: as in ``attention``); returns [B, t, H * D].
- ``attention(q, k, v, mask, sinks)``: the attention of the other cases (a mask with holes, a
  tree, a quantized cache): torch's SDPA, or with ``sinks`` [H] (GPT-OSS: one more logit per
  head in the softmax's denominator, a column with no value) the same in fp32, rounded once.
- ``argmax(x)``: ``x.argmax(-1)`` (first maximum, NaN counts as the maximum) for fp32/bf16 logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_ext import ext_supports, load_cpu_ext


def _ext_ok(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return first.is_cpu and all(t.dtype == first.dtype for t in tensors) and load_cpu_ext() is not None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]."""
    if _ext_ok(x, weight):
        return torch.ops.quantspec_cpu.rms_norm.default(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_rounded_once(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] (any float dtype) -> [..., D] in x's dtype."""
    if x.dtype == weight.dtype == torch.float32:
        return rms_norm(x, weight, eps)  # in fp32 the two norms are the same arithmetic
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(torch.float32) * normed).to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated (the sign of rotate_half folded in)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    c, s = cos.unsqueeze(2), sin_signed.unsqueeze(2)
    return torch.addcmul(x * c, x.roll(x.shape[-1] // 2, dims=-1), s)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], cos and sin_signed [B, T, D] -> [B, T, H, D]."""
    if _ext_ok(x, cos, sin_signed) and x.stride(-1) == 1:
        return torch.ops.quantspec_cpu.rope.default(x, cos, sin_signed)
    return rope_reference(x, cos, sin_signed)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] (views of one fused product allowed) -> silu(gate) * up."""
    if _ext_ok(gate, up):
        return torch.ops.quantspec_cpu.silu_mul.default(gate, up)
    return F.silu(gate) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, t, D], k and v [B, KV, L, D] (head h reads KV head h // (H / KV)), mask bool
    broadcastable to [B, 1, t, L] (True: attend; None: every column), sinks fp32 [H] or None ->
    [B, H, t, D], scaled by D^-0.5."""
    h, kv = q.shape[1], k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kv)
    b, _, t, d = q.shape
    grouped = q.to(torch.float32).reshape(b, kv, (h // kv) * t, d)  # one product per KV head
    scores = (grouped @ k.to(torch.float32).transpose(-1, -2)).view(b, h, t, -1) * d ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(torch.float32).view(1, h, 1, 1).expand(b, h, t, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = probs.reshape(b, kv, (h // kv) * t, -1) @ v.to(torch.float32)
    return out.view(b, h, t, d).to(q.dtype)


def attend_reference(q, k, v, cos, sin_signed, k_cache, v_cache, lo: int,
                     sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    b, t, h, d = q.shape
    q, k = rope_reference(q, cos, sin_signed), rope_reference(k, cos, sin_signed)
    k_cache[:, :, lo:lo + t] = k.transpose(1, 2)
    v_cache[:, :, lo:lo + t] = v.transpose(1, 2)
    total = lo + t
    cols, rows = torch.arange(total, device=q.device), torch.arange(lo, total, device=q.device)
    allowed = cols.unsqueeze(0) <= rows.unsqueeze(1)
    if window:
        allowed &= cols.unsqueeze(0) > rows.unsqueeze(1) - window
    o = attention(q.transpose(1, 2), k_cache[:, :, :total], v_cache[:, :, :total], allowed, sinks)
    return o.transpose(1, 2).reshape(b, t, h * d)


def attend(q, k, v, cos, sin_signed, k_cache, v_cache, lo: int,
           sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, t, H, D], k and v [B, t, KV, D] (views of a fused product allowed), cos and
    sin_signed [B, t, D], caches [B, KV, cap, D] (written), sinks [H] or None, window (positions)
    or None -> [B, t, H * D]."""
    d = q.shape[-1]
    if (ext_supports("has_avx512f") and _ext_ok(q, k, v, cos, sin_signed, k_cache, v_cache) and d % 16 == 0
            and d <= 256 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(x.stride(-1) == 1 for x in (q, k, v))):
        sk = None if sinks is None else sinks.to(torch.float32).contiguous()
        return torch.ops.quantspec_cpu.attend.default(q, k, v, cos, sin_signed, k_cache, v_cache, lo,
                                                      d ** -0.5, sk, window or 0)
    return attend_reference(q, k, v, cos, sin_signed, k_cache, v_cache, lo, sinks, window)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> int64 [...]: ``x.argmax(-1)``, through the extension for CPU fp32/bf16."""
    if (x.dtype in (torch.float32, torch.bfloat16) and ext_supports("has_avx512f") and x.is_cpu
            and x.numel() > 0):
        lead = x.shape[:-1]
        return torch.ops.quantspec_cpu.argmax_rows.default(x.reshape(-1, x.shape[-1])).reshape(lead)
    return x.argmax(-1)
