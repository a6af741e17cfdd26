"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv 2210.17323): pure tensor functions.

``gptq_quantize(W, H, scheme)`` quantizes a [N, K] weight one input column at a time and
spreads each column's rounding error over the not-yet-quantized columns through the upper
Cholesky factor of the damped inverse Hessian (the paper's Algorithm 1, with lazy batch
updates of ``block_size`` columns). The grid is RTN's (``rtn.qparams`` / ``quantize_codes``).

Group parameters are found from the *current* (error-updated) columns of a group when the group
starts (float schemes: FP8 / FP4 scales, ``floatgrid.py``, and the nearest value of their
non-uniform grid for each column; FP8 block: one scale per 128 rows of the group's current
columns). Blocks are split at group starts so that every column of the group is up to date at that
moment, which makes the blocked algorithm equal to the unblocked column-by-column one (the
reference implementation reads partly stale columns when group_size < block_size).

The block-level method that collects Hessians with hooks is ``block_methods.GPTQMethod``.
"""

from __future__ import annotations

import torch

from ..errors import QuantspecError
from .hessian import accumulate_hessian, make_empty_hessian
from ..core.floatcodes import code_values, decode_scales, e2m1_round, e2m1_search_table, encode
from .floatgrid import block_scales, group_scales, tensor_global_scale
from .rtn import qparams
from ..core.scheme import QuantResult, QuantScheme

__all__ = [
    "accumulate_hessian",
    "asymmetric_target",
    "make_empty_hessian",
    "gptq_quantize",
    "inverse_hessian_factor",
]

MAX_DAMP_RETRIES = 4


def _lower_triangular_inverse(L: torch.Tensor, base: int = 256) -> torch.Tensor:
    """``L^-1`` of a lower-triangular [K, K] ``L`` by halves (the off-diagonal block is
    ``-B^-1 C A^-1``), so that most of the work runs as matrix products."""
    k = L.shape[0]
    if k <= base:
        return torch.linalg.solve_triangular(L, torch.eye(k, dtype=L.dtype, device=L.device), upper=False)
    h = k // 2
    out = torch.zeros_like(L)
    a_inv, b_inv = _lower_triangular_inverse(L[:h, :h], base), _lower_triangular_inverse(L[h:, h:], base)
    out[:h, :h], out[h:, h:] = a_inv, b_inv
    out[h:, :h] = -(b_inv @ L[h:, :h]) @ a_inv
    return out


def inverse_hessian_factor(
    H: torch.Tensor, damp_percent: float
) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor U of ``(H + damp * mean(diag H) * I)^-1`` (fp32 [K, K]).

    When a factorization fails the damping is multiplied by 10 and tried again (up to
    MAX_DAMP_RETRIES times). Returns ``(U, damp_percent_used, retries)``.
    """
    if not torch.isfinite(H).all():
        raise QuantspecError(
            "the GPTQ Hessian holds NaN or Inf values.",
            "check the calibration activations (use float32 or bfloat16 instead of float16).",
        )
    mean_diag = torch.diagonal(H).mean()
    damp = damp_percent
    for retry in range(MAX_DAMP_RETRIES + 1):
        # With J the reversal of rows and columns and J Hd J = R R^T (R lower), Hd^-1 = U^T U
        # for the upper U = J R^-1 J: one factorization and one triangular inverse, where
        # factor, invert, factor again did three times the work (2.5x slower at K = 4864).
        Hd = H.flip(0, 1)
        Hd.diagonal().add_(damp * mean_diag)
        R, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            U = _lower_triangular_inverse(R).flip(0, 1)
            if torch.isfinite(U).all():
                return U, damp, retry
        damp *= 10.0
    raise QuantspecError(
        f"the GPTQ Hessian is not positive definite even with damp_percent={damp / 10:g}.",
        "use more calibration samples, or a larger gptq.damp_percent.",
    )


def _without_dead_inputs(weight: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 copies of ``weight`` and ``H`` with each dead input (``H[k, k] == 0``) given
    ``H[k, k] = 1`` and a zero weight column, and the mask of the dead inputs."""
    W = weight.detach().to(torch.float32).clone()
    H = H.detach().to(device=W.device, dtype=torch.float32).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    return W, H, dead


def asymmetric_target(
    weight: torch.Tensor, H: torch.Tensor, WC: torch.Tensor, damp_percent: float
) -> torch.Tensor:
    """The fp32 [N, K] weight whose GPTQ rounding minimizes the asymmetric objective
    ``||W X - Q Xq||^2 + damp ||Q - W||^2`` (X: the Linear's inputs in the float model, Xq: in
    the model quantized so far; the idea of GPTAQ, Li et al. 2025, arXiv 2504.02692).

    With ``H = 2/n Xq Xq^T``, ``C = 2/n (X - Xq) Xq^T`` (``hessian.cross_term``) and Hd = H
    damped as GPTQ damps it, the objective's minimizer is ``W* = W + W C Hd^-1``, and for any Q
    the objective equals ``tr((W* - Q) Hd (W* - Q)^T)`` plus a constant, which is what GPTQ
    minimizes when it rounds W* under Hd. ``WC``: the fp32 [N, K] product ``W C``
    (``W @ cross_term`` or ``hessian.weight_cross_term``). Dead inputs (``H[k, k] == 0``) are
    treated as GPTQ treats them (their column is zero)."""
    W, H, dead = _without_dead_inputs(weight, H)
    U, _, _ = inverse_hessian_factor(H, damp_percent)  # Hd^-1 = U^T U
    WC = WC.to(device=W.device, dtype=torch.float32).clone()
    WC[:, dead] = 0.0  # an input GPTQ treats as dead adds nothing
    return W + (WC @ U.t()) @ U


def _group_starts(k: int, glen: int, block_size: int, dynamic_groups: bool) -> list[int]:
    starts = set(range(0, k, block_size))
    if dynamic_groups:
        starts |= set(range(0, k, glen))
    return sorted(starts)


def _params(
    W: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype, gscale: torch.Tensor | None,
    hdiag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored scale [N], zero [N] | None) of the group ``W`` ([N, L]): RTN's grid, or a float
    scheme's scales (``floatgrid.group_scales``, no zero; FP8 block: ``block_scales`` of the
    group's blocks of rows, on each row); ``hdiag`` [L]: the Hessian's diagonal of the group's
    columns, which MXFP4's ``hmse`` rule weights the error by."""
    if scheme.is_block:
        return block_scales(W, scheme.group_size)[:, 0], None  # K % 128 != 0 raises here
    if scheme.is_float:
        return group_scales(W, scheme, gscale, hdiag, calibrated=True), None
    return qparams(W, scheme, scale_dtype)


def _static_params(
    W: torch.Tensor, scheme: QuantScheme, glen: int, scale_dtype: torch.dtype, gscale: torch.Tensor | None,
    hdiag: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(scale [N], zero [N] | None) of each natural contiguous group of ``W`` ([N, K]). A float
    scheme's scales are row-wise functions of each group, so its whole groups go as the rows of
    one [N * G, L] call (MXFP4 at K = 1536: 48 calls became one)."""
    n, k = W.shape
    if scheme.is_float and not scheme.is_block and k % glen == 0 and k > glen:
        g = k // glen
        imp = None if hdiag is None else hdiag.reshape(1, g, glen).expand(n, g, glen).reshape(n * g, glen)
        scales = group_scales(W.reshape(n * g, glen), scheme, gscale, imp, calibrated=True).reshape(n, g)
        return [(scales[:, j], None) for j in range(g)]
    return [_params(W[:, s : s + glen], scheme, scale_dtype, gscale, None if hdiag is None else hdiag[s : s + glen])
            for s in range(0, W.shape[1], glen)]


def _quantize_columns(
    W: torch.Tensor,
    U: torch.Tensor,
    scheme: QuantScheme,
    glen: int,
    block_size: int,
    static: list | None,
    perm: torch.Tensor | None,
    scale_dtype: torch.dtype,
    gscale: torch.Tensor | None = None,
    hdiag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list, float]:
    """The GPTQ column loop on (permuted) ``W`` [N, K] with factor ``U`` [K, K].

    Returns codes uint8 [N, K], dequantized values fp32 [N, K] (both in W's column order),
    the (scale, zero) of each group in processing order (empty when ``static``), and the loss
    ``sum((w - q)^2 / U_cc^2) / 2``. Float schemes round each column to the nearest value of
    their grid (``floatcodes.encode``) instead of ``round(w / s) + z``.
    """
    n, k = W.shape
    values = code_values(scheme.weights, W.device) if scheme.is_float else None
    search = e2m1_search_table(W.device) if scheme.weights in ("nvfp4", "mxfp4") else None
    codes = torch.empty(n, k, dtype=torch.uint8, device=W.device)
    deq = torch.empty(n, k, dtype=torch.float32, device=W.device)
    groups: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    loss = 0.0
    starts = _group_starts(k, glen, block_size, static is None)
    diag = torch.diagonal(U).tolist()
    scale = zero = None

    def decode(sc: torch.Tensor, zr: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The fp32 (scale, zero point) that a group's stored pair stands for."""
        return (decode_scales(sc, scheme.weights, gscale) if scheme.is_float else sc.to(torch.float32),
                float(scheme.sym_zero) if zr is None else zr.to(torch.float32))

    if static is not None:  # decoded once; act-order visits the groups in any order
        static_fp = [decode(sc, zr) for sc, zr in static]
        group_of = [c // glen for c in (perm.tolist() if perm is not None else range(k))]
    for b, i1 in enumerate(starts):
        i2 = starts[b + 1] if b + 1 < len(starts) else k
        if static is None and i1 % glen == 0:
            scale, zero = _params(W[:, i1 : i1 + glen], scheme, scale_dtype, gscale,
                                  None if hdiag is None else hdiag[i1 : i1 + glen])
            groups.append((scale, zero))
        # The block transposed: column i of W is row i here (contiguous for the rank-1 updates).
        W1 = W[:, i1:i2].t().contiguous()
        Q1 = torch.empty_like(W1)
        D1 = torch.empty_like(W1)
        Err1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        s = z = None
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                s, z = static_fp[group_of[col]]
            elif s is None:
                s, z = decode(scale, zero)
            w = W1[i]
            if search is not None:
                Q1[i], v = e2m1_round(w / s, search)
                dq = torch.mul(v, s, out=D1[i])
            elif values is not None:
                c = encode(w / s, scheme.weights)
                Q1[i] = c
                dq = torch.mul(values[c.long()], s, out=D1[i])
            else:
                q = torch.div(w, s, out=Q1[i]).round_().add_(z).clamp_(0, scheme.maxq)
                dq = torch.sub(q, z, out=D1[i]).mul_(s)
            err = torch.sub(w, dq, out=Err1[i]).div_(diag[col])
            if i + 1 < i2 - i1:
                W1[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1.0)
        codes[:, i1:i2] = Q1.t().to(torch.uint8)
        deq[:, i1:i2] = D1.t()
        loss += float(Err1.double().pow(2).sum()) / 2
        W[:, i2:].addmm_(Err1.t(), U[i1:i2, i2:], alpha=-1.0)
    return codes, deq, groups, float(loss)


def gptq_quantize_with_values(
    weight: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    damp_percent: float = 0.01,
    block_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
    gscale: torch.Tensor | None = None,
) -> tuple[QuantResult, torch.Tensor, dict]:
    """``gptq_quantize`` that also returns the fp32 [N, K] fake-quant weight it computed; NVFP4
    under ``gscale`` when given (shared with fused siblings), else the weight's own."""
    n, k = weight.shape
    if H.shape != (k, k):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match K={k}")
    W, H, dead = _without_dead_inputs(weight, H)
    glen = scheme.group_len(k)
    gscale = tensor_global_scale(W, scheme, gscale)
    hdiag = torch.diagonal(H).clone() if scheme.scale_rule == "hmse" and scheme.weights == "mxfp4" else None
    static = _static_params(W, scheme, glen, scale_dtype, gscale, hdiag) if scheme.static_groups else None
    perm = None
    if scheme.act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
        hdiag = None if hdiag is None else hdiag[perm]
    U, damp, retries = inverse_hessian_factor(H, damp_percent)
    del H
    codes, deq, groups, loss = _quantize_columns(
        W, U, scheme, glen, block_size, static, perm, scale_dtype, gscale, hdiag
    )
    params = static if static is not None else groups
    scales = torch.stack([s for s, _ in params], dim=1)
    zeros = None if scheme.symmetric else torch.stack([z for _, z in params], dim=1)
    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes, deq = codes[:, inv], deq[:, inv]
        if static is None and len(params) > 1:
            g_idx = (torch.arange(k, device=W.device) // glen)[inv].to(torch.int32)
    result = QuantResult(qweight=codes, scales=scales, zeros=zeros, g_idx=g_idx, scheme=scheme,
                         global_scale=gscale)
    info = {
        "damp_percent": damp,
        "retries": retries,
        "loss": loss,
        "dead_inputs": int(dead.sum()),
    }
    return result, deq, info


def gptq_quantize(
    weight: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    damp_percent: float = 0.01,
    block_size: int = 128,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[QuantResult, dict]:
    """Quantize ``weight`` (float [N, K]) with GPTQ given its Hessian ``H`` (fp32 [K, K]).

    scheme: bits 2/3/4/8, group_size -1/32/64/128 (K need not be a multiple: the last group is
    shorter), sym/asym. act_order (desc_act) processes columns by decreasing ``diag(H)``;
    without static_groups the groups are formed along that order and ``g_idx[k]`` is the group
    of column k; with static_groups the groups are the natural contiguous ones, found before
    any update, and ``g_idx`` is None (``k // group_size``).
    Dead inputs (``H[k, k] == 0``) get ``H[k, k] = 1`` and a zero weight column.
    Damping: ``damp_percent * mean(diag H)`` added to the diagonal, times 10 on each failed
    Cholesky factorization.

    Returns the QuantResult (scales in ``scale_dtype``) and info: ``damp_percent`` (used),
    ``retries``, ``loss`` (the GPTQ objective, ``sum((w - q)^2 / [H^-1]_cc) / 2``),
    ``dead_inputs``.
    """
    result, _, info = gptq_quantize_with_values(
        weight, H, scheme, damp_percent, block_size, scale_dtype
    )
    return result, info
