"""The registry of quantization methods: one entry per method a recipe (and the CLI) can name.

Each entry declares how to build the method from a recipe, which recipe field holds its
options, whether it has a Hessian (so act-order applies), whether its scheme must quantize
activations, and its default scheme. A composed method lists its steps (a smoother, then a
rounder: ``compose.py``), so AWQ->GPTQ, SmoothQuant->GPTQ and SmoothQuant->RTN are one
mechanism. The CLI's choices, recipe validation and defaults all read this table; adding a
method is its module plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..errors import QuantspecError
from .awq import method_from_recipe as awq_method, smoother_from_recipe as awq_smoother
from .block_methods import RTNMethod, gptq_from_recipe
from .compose import Composed
from .method import BlockMethod, Smoother
from ..core.scheme import QuantScheme
from .smoothquant import method_from_recipe as smoothquant_smoother

if TYPE_CHECKING:
    from .recipe import Recipe

W4_SYM = QuantScheme()
W4_ASYM = QuantScheme(symmetric=False)
# static act-order: columns by decreasing Hessian diagonal, groups fixed before the pass (better
# perplexity, no g_idx, loads everywhere)
W4_ACT_ORDER = QuantScheme(act_order=True, static_groups=True)
W8A8 = QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")


@dataclass(frozen=True)
class MethodSpec:
    """One method. ``build(recipe)`` returns its BlockMethod, or with ``steps`` the composed
    method is built from the steps' own entries (``smoother`` of the first, ``build`` of the
    second). ``smoother``: how to build it as the first step of a composition (None: it cannot
    be one)."""

    name: str
    summary: str
    default_scheme: QuantScheme
    options: str | None = None  # the Recipe field of its options
    hessian: bool = False
    activations: bool = False  # the scheme must quantize activations (W8A8)
    default_format: str = "gptq"
    build: Callable[["Recipe"], BlockMethod] | None = None
    smoother: Callable[["Recipe"], Smoother] | None = None
    steps: tuple[str, ...] = ()


def _rtn(recipe: "Recipe") -> BlockMethod:
    return RTNMethod()


METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("rtn", "round to nearest, no calibration", W4_SYM, build=_rtn),
    MethodSpec("gptq", "GPTQ (Hessian-aware rounding, true-sequential)", W4_ACT_ORDER, "gptq", hessian=True,
               build=gptq_from_recipe),
    MethodSpec("awq", "AWQ scales, clipping and RTN", W4_ASYM, "awq", build=awq_method, smoother=awq_smoother),
    MethodSpec("smoothquant", "SmoothQuant scales then RTN, W8A8", W8A8, "smoothquant", activations=True,
               default_format="compressed-tensors", smoother=smoothquant_smoother, steps=("smoothquant", "rtn")),
    MethodSpec("awq+gptq", "AWQ scales then GPTQ", W4_ACT_ORDER, "awq", hessian=True, steps=("awq", "gptq")),
    MethodSpec("smoothquant+gptq", "SmoothQuant scales then GPTQ, W8A8", W8A8, "smoothquant", hessian=True,
               activations=True, default_format="compressed-tensors", steps=("smoothquant", "gptq")),
)}


def method_spec(name: str) -> MethodSpec:
    if name not in METHODS:
        raise QuantspecError(f"unknown method {name!r}.", f"use one of {list(METHODS)}.")
    return METHODS[name]


def option_sections(method: str) -> tuple[str, ...]:
    """The recipe sections whose options ``method`` reads: its own and each step's."""
    spec = method_spec(method)
    names = [spec.options, *(method_spec(step).options for step in spec.steps)]
    return tuple(dict.fromkeys(n for n in names if n))


def default_scheme(method: str) -> QuantScheme:
    """The scheme a method quantizes with when the recipe gives none."""
    return method_spec(method).default_scheme


def build_method(recipe: "Recipe") -> BlockMethod:
    """The BlockMethod that runs ``recipe`` on the calibration engine."""
    spec = method_spec(recipe.method)
    if not spec.steps:
        return spec.build(recipe)  # type: ignore[misc]
    first, second = (method_spec(s) for s in spec.steps)
    if first.smoother is None or second.build is None:
        raise QuantspecError(f"method {spec.name!r} composes {spec.steps}, which do not compose.",
                             "declare the first step's smoother and the second step's build.")
    return Composed(first.smoother(recipe), second.build(recipe))
