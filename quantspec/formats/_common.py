"""Checks and conversions the three formats share (g_idx canonical form, shape checks)."""

from __future__ import annotations

import torch

from ..errors import QuantspecError
from ..core.scheme import QuantResult, QuantScheme


def default_g_idx(scheme: QuantScheme, in_features: int, device=None) -> torch.Tensor:
    """int32 [K]: ``k // group_len`` (0 everywhere for per-channel schemes)."""
    k = torch.arange(in_features, dtype=torch.int32, device=device)
    return k // scheme.group_len(in_features)


def g_idx_to_store(result: QuantResult, fmt: str) -> tuple[torch.Tensor, bool]:
    """The g_idx a checkpoint stores for ``result`` and whether it is the default one.

    A non-default g_idx (GPTQ act-order without static groups) needs a scheme that says
    act_order: loaders told desc_act/actorder is off ignore g_idx and would compute wrong
    outputs silently.
    """
    _, k = result.shape
    default = default_g_idx(result.scheme, k, result.qweight.device)
    if result.g_idx is None:
        return default, True
    g = result.g_idx.to(torch.int32)
    is_default = bool(torch.equal(g, default))
    if not is_default and not (result.scheme.act_order and not result.scheme.static_groups):
        raise ValueError(
            f"{fmt}: the result has a permuted g_idx but its scheme does not say act_order "
            "(without static_groups); loaders would ignore the permutation"
        )
    return g, is_default


def g_idx_from_store(stored: torch.Tensor | None, scheme: QuantScheme, in_features: int):
    """Canonical g_idx of an unpacked result.

    Canonical form (what algorithms return, so that ``unpack(pack(r))`` equals ``r``): a
    tensor exactly when the scheme has act-order without static groups (even when it happens
    to equal ``k // group_len``, e.g. per-channel), else None. A stored non-default g_idx
    under a scheme without act-order is an inconsistent checkpoint: QuantspecError.
    """
    if scheme.act_order and not scheme.static_groups:
        if stored is None:
            return default_g_idx(scheme, in_features)
        return stored.to(torch.int32).contiguous()
    if stored is not None and not torch.equal(
        stored.to(torch.int32), default_g_idx(scheme, in_features, stored.device)
    ):
        raise QuantspecError(
            "the checkpoint stores a permuted g_idx but its config does not say act-order "
            "(desc_act / actorder 'group'), so loaders would ignore it.",
            "set desc_act: true (GPTQ) or actorder: 'group' (compressed-tensors) in its quantization_config.",
        )
    return None


def check_tensors(
    fmt: str,
    tensors: dict[str, torch.Tensor],
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    float_names: tuple[str, ...] = (),
) -> None:
    """Raise QuantspecError when ``tensors`` lack a spec'd tensor or disagree in shape/dtype.

    Names in ``float_names`` (scales) may be stored in any floating dtype.
    """
    for name, (shape, dtype) in specs.items():
        if name not in tensors:
            raise QuantspecError(
                f"{fmt} layer has no tensor {name!r} (found {sorted(tensors)}).",
                "check that the checkpoint was written in this format with this scheme.",
            )
        t = tensors[name]
        dtype_ok = t.dtype.is_floating_point if name in float_names else t.dtype == dtype
        if tuple(t.shape) != tuple(shape) or not dtype_ok:
            raise QuantspecError(
                f"{fmt} tensor {name!r} is {t.dtype} {tuple(t.shape)}; expected {dtype} {tuple(shape)}.",
                "check the checkpoint's quantization_config (bits, group_size, sym) against its tensors.",
            )


def group_rule(scheme: QuantScheme, in_features: int) -> str | None:
    """Every format here needs whole groups: K divisible by the group size."""
    if scheme.group_size != -1 and in_features % scheme.group_size:
        return (
            f"in_features={in_features} is not divisible by group_size={scheme.group_size} "
            "(loaders need whole groups)"
        )
    return None
