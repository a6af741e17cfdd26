"""Which Linears get quantized, with which scheme, and which stay dense and why.

The documented rule for a layer the format cannot hold with the recipe's scheme:

1. K not divisible by the group size: the layer is *regrouped* to the largest smaller group
   size that divides K (128 -> 64 -> 32), else to one group per output channel, provided the
   format holds that; the checkpoint records it as a per-layer override (GPTQ ``dynamic``,
   compressed-tensors config groups), so loaders read the true group size. Real engines
   (vLLM, Marlin) reject partial groups, so a partial last group is never written.
   Float schemes are never regrouped: their group sizes are fixed by the number format (NVFP4
   16, MXFP4 32, FP8 block 128x128), so such a layer stays dense (rule 2).
2. Anything else the format cannot hold (AWQ and N not divisible by 8, say) stays dense.
3. An nn.Linear subclass whose forward is not x @ W.T + b (DeepSeek-V4's grouped ``o_a_proj``, a
   block-diagonal bmm over its weight's row groups) stays dense: a quantized Linear computes
   x @ W.T + b only. A subclass whose forward computes it (Falcon's FalconLinear) is quantized.

Both are reported per layer in quant_report.json; nothing is dropped silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import QuantspecError
from ..core.scheme import QuantScheme


@dataclass
class LayerPlan:
    quantize: dict[str, QuantScheme] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)  # name -> reason
    regrouped: dict[str, str] = field(default_factory=dict)  # name -> reason

    def overrides(self, base: QuantScheme) -> dict[str, QuantScheme]:
        return {n: s for n, s in self.quantize.items() if s != base}


def _matches(name: str, patterns) -> bool:
    for p in patterns:
        if p == name or name.endswith("." + p) or re.fullmatch(p, name):
            return True
    return False


def make_plan(
    model: nn.Module, scheme: QuantScheme, fmt, targets=(), ignore=("lm_head",)
) -> LayerPlan:
    """Plan every nn.Linear of ``model``: targets (regexes; empty = all) minus ignore."""
    plan = LayerPlan()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if targets and not _matches(name, targets):
            continue
        if _matches(name, ignore):
            plan.dense[name] = "ignored by the recipe"
            continue
        if not _computes_linear(mod):
            plan.dense[name] = (f"{type(mod).__name__} subclasses nn.Linear with a forward that is not x @ W.T + b, "
                                "which a quantized Linear would not compute")
            continue
        n, k = mod.out_features, mod.in_features
        chosen, note = _fit(scheme, fmt, n, k)
        if chosen is None:
            plan.dense[name] = note
        else:
            plan.quantize[name] = chosen
            if note:
                plan.regrouped[name] = note
    if not plan.quantize:
        conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
        if conv1d:
            raise QuantspecError(
                f"this model computes its projections with transformers' GPT-2-style Conv1D "
                f"modules ({len(conv1d)}, e.g. {conv1d[0]}), not nn.Linear, and quantspec "
                "quantizes nn.Linear layers only.",
                "quantize a model whose projections are nn.Linear (most current causal LMs), "
                "or convert the Conv1D modules to nn.Linear (weight transposed) first.",
            )
        raise QuantspecError(
            "no Linear layer of the model can be quantized with this recipe "
            f"({len(plan.dense)} left dense: {next(iter(plan.dense.values()), 'none found')}).",
            "check the recipe's targets/ignore, scheme and format.",
        )
    return plan


def _computes_linear(mod: nn.Linear) -> bool:
    """Whether ``mod`` computes x @ W.T + b: nn.Linear's own forward, or a subclass's forward that
    gives F.linear's result on a probe of 3 rows (Falcon's FalconLinear does; DeepSeek-V4's grouped
    o_a_proj, a block-diagonal bmm, does not). Weights on the meta device: the output shape only."""
    if type(mod).forward is nn.Linear.forward:
        return True
    w = mod.weight
    x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            got, want = mod(x), F.linear(x, w, mod.bias)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:  # Llama-4's router returns a pair
        return False
    if w.is_meta:
        return True
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max().clamp(min=1))))


def _fit(scheme: QuantScheme, fmt, n: int, k: int) -> tuple[QuantScheme | None, str]:
    reason = fmt.cannot_hold(scheme, n, k)
    if reason is None:
        return scheme, ""
    from ..formats.overrides import SUPPORTS_OVERRIDES

    regroup = fmt.name in SUPPORTS_OVERRIDES
    permuted = scheme.act_order and not scheme.static_groups  # g_idx written: kept as asked
    fixed = scheme.is_float  # float group sizes belong to the number format: never regrouped
    if regroup and not fixed and scheme.group_size != -1 and k % scheme.group_size != 0 and not permuted:
        for g in (128, 64, 32, -1):
            if g != -1 and (g >= scheme.group_size or k % g != 0):
                continue
            alt = replace(scheme, group_size=g)
            if fmt.cannot_hold(alt, n, k) is None:
                gname = "per channel" if g == -1 else f"group size {g}"
                return alt, (
                    f"K={k} is not divisible by group size {scheme.group_size}: {gname} instead"
                )
    return None, reason


def override_patterns(names: list[str], all_names: list[str]) -> list[str]:
    """Compact full-match regexes for ``names``: one per layer-role across blocks when every
    block's layer of that role is in ``names``, else one per exact name."""
    generic = lambda n: re.sub(r"\.\d+\.", ".#.", n)  # noqa: E731
    chosen = set(names)
    by_role: dict[str, list[str]] = {}
    for n in all_names:
        by_role.setdefault(generic(n), []).append(n)
    out = []
    done = set()
    for n in names:
        role = generic(n)
        members = by_role.get(role, [n])
        if role in done:
            continue
        if len(members) > 1 and all(m in chosen for m in members):
            out.append(re.escape(role).replace(r"\#", r"\d+").replace("#", r"\d+"))
            done.add(role)
        else:
            out.append(re.escape(n))
    return out
