"""The layer-wise Hessian of GPTQ: ``H = 2/n * sum_t x_t x_t^T`` over the n input rows.

Pure tensor functions, kept apart from any model code (the reference GPTQ's ``add_batch``;
llm-compressor's make_empty_hessian / accumulate_hessian).
"""

from __future__ import annotations

import torch


# Inputs at least TRI_MIN_K wide get their Gram matrix by blocks on and above the diagonal
# only: b column blocks of at least TRI_MIN_BLOCK columns (at most TRI_BLOCKS) do (b + 1) / (2b)
# of the full product's work (measured here, 2 threads: 32768 x 1536 in 0.76 s instead of
# 1.30 s; 32768 x 4864, Qwen2.5-0.5B's down_proj, in 4.05 s by 8 blocks, 4.40 s by 4, 6.71 s whole).
TRI_MIN_K = 512
TRI_MIN_BLOCK = 256
TRI_BLOCKS = 8


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` for ``x`` [T, K] (fp32), computing each off-diagonal block once."""
    k = x.shape[1]
    if k < TRI_MIN_K:
        return x.t() @ x
    out = torch.empty(k, k, dtype=x.dtype, device=x.device)
    step = -(-k // min(TRI_BLOCKS, k // TRI_MIN_BLOCK))
    for i in range(0, k, step):
        blk = x[:, i : i + step].t() @ x[:, i:]
        out[i : i + step, i:] = blk
        out[i:, i : i + step] = blk.t()
    return out


# bf16 Gram: rows per bf16 product. Each product's fp32 sums come back rounded to bf16 (torch's CPU
# matmul has no bf16 -> fp32 output), so the rows go by chunks whose products are summed in fp32:
# 8192 rows keep the error at ~8e-4 of the Gram's norm (32768 rows at once: 1.6e-3) at 2.3x the
# speed of the fp32 product (32768 x 4864, 2 threads of an AVX-512 BF16 CPU: 1.62 s vs 3.76 s).
BF16_CHUNK_ROWS = 8192
HESSIAN_DTYPES = ("auto", "float32", "bfloat16")


def gram_bf16(x: torch.Tensor, chunk_rows: int = BF16_CHUNK_ROWS) -> torch.Tensor:
    """``x^T x`` (fp32 [K, K]) of ``x`` [T, K] rounded to bf16: bf16 products of ``chunk_rows``
    rows at a time, summed in fp32."""
    k = x.shape[1]
    out = torch.zeros(k, k, dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], chunk_rows):
        out.add_(gram(x[i : i + chunk_rows].to(torch.bfloat16)))
    return out


def _difference_rows(x_fp: torch.Tensor, x_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [n, K] of ``x_fp - x_q`` and of ``x_q``."""
    xq = x_q.reshape(-1, x_q.shape[-1]).to(torch.float32)
    return x_fp.reshape(-1, x_fp.shape[-1]).to(device=xq.device, dtype=torch.float32) - xq, xq


def cross_term(x_fp: torch.Tensor, x_q: torch.Tensor, bf16: bool = False,
               chunk_rows: int = BF16_CHUNK_ROWS) -> torch.Tensor:
    """``2/n * (X - Xq)^T Xq`` (fp32 [K, K]) over the n rows of a Linear's float-model inputs
    ``x_fp`` and quantized-model inputs ``x_q`` ([..., K], the same rows in the same order): the
    term by which asymmetric calibration (``gptq.asymmetric_target``) moves the weight that GPTQ
    rounds. Scaled as ``accumulate_hessian``'s H of the same rows. ``bf16``: the difference and
    ``Xq`` rounded to bf16, multiplied ``chunk_rows`` rows at a time and summed in fp32 (as
    ``gram_bf16``)."""
    delta, xq = _difference_rows(x_fp, x_q)
    if not bf16:
        return (delta.t() @ xq).mul_(2.0 / max(xq.shape[0], 1))
    out = torch.zeros(xq.shape[1], xq.shape[1], dtype=torch.float32, device=xq.device)
    for i in range(0, xq.shape[0], chunk_rows):
        out.add_(delta[i : i + chunk_rows].to(torch.bfloat16).t() @ xq[i : i + chunk_rows].to(torch.bfloat16))
    return out.mul_(2.0 / max(xq.shape[0], 1))


def weight_cross_term(weight: torch.Tensor, x_fp: torch.Tensor, x_q: torch.Tensor, bf16: bool = False,
                      chunk_rows: int = BF16_CHUNK_ROWS) -> torch.Tensor:
    """``W @ cross_term(x_fp, x_q)`` (fp32 [N, K]) as ``2/n * (D W^T)^T Xq`` with D = X - Xq: 4nNK
    multiply-adds instead of 2nK^2, the cheaper way when K > 2N (a down_proj). ``bf16``: the
    products in bf16 by ``chunk_rows`` rows, summed in fp32."""
    delta, xq = _difference_rows(x_fp, x_q)
    W = weight.detach().to(device=xq.device, dtype=torch.float32)
    dtype = torch.bfloat16 if bf16 else torch.float32
    Wt = W.t().to(dtype)
    out = torch.zeros_like(W)
    step = chunk_rows if bf16 else max(xq.shape[0], 1)
    for i in range(0, xq.shape[0], step):
        P = delta[i : i + step].to(dtype) @ Wt  # [rows, N]
        out.add_(P.t() @ xq[i : i + step].to(dtype))
    return out.mul_(2.0 / max(xq.shape[0], 1))


def make_empty_hessian(in_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [K, K] zeros."""
    return torch.zeros(in_features, in_features, dtype=torch.float32, device=device)


def accumulate_hessian(
    H: torch.Tensor, x: torch.Tensor, nsamples: int, bf16: bool = False
) -> tuple[torch.Tensor, int]:
    """Fold the rows of ``x`` ([..., K], any float dtype) into the running mean ``H``.

    ``H`` (fp32 [K, K], updated in place and returned) is ``2/n * X^T X`` over the ``nsamples``
    rows seen so far; each row of ``x`` (every token) counts as one sample. ``bf16``: the
    products from ``x`` rounded to bf16 (``gram_bf16``). Returns ``(H, nsamples + rows)``.
    """
    x = x.reshape(-1, x.shape[-1]).to(device=H.device)
    rows = x.shape[0]
    if rows == 0:
        return H, nsamples
    total = nsamples + rows
    H.mul_(nsamples / total)
    H.add_(gram_bf16(x) if bf16 else gram(x.to(torch.float32)), alpha=2.0 / total)
    return H, total
