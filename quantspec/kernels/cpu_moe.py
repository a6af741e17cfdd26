"""A few tokens through a quantized MoE block on the cpu backend, in one op call.

The per-expert path of ``LinearExperts`` (``models/experts.py``) runs, for each expert its tokens
chose, a gate/up product, the GLU, a down product and the weighting: two kernel calls and a few
dozen small torch ops per active expert, each call a parallel region over a few hundred KB of
weights, so that for a few tokens (decode, a batch of decoding sequences, speculative
verification) the fixed cost of the calls outweighs reading the weights.
``CpuTokenExperts`` stacks the experts' extension layouts (rows or AVX-512 VNNI panels, the
layouts ``kernels.cpu`` prepares) once, at attach time, and runs the whole block as
``quantspec_cpu::moe_token`` (csrc/cpu_moe.cpp): the (token, expert) pairs grouped by expert, so
that each expert's weights are read once for all its tokens (an M-row product of the same
kernels), every group's gate/up rows in one parallel region, the GLU (SiLU(gate) * up, or
GPT-OSS's clamped SwiGLU), every group's down rows in a second one, and the router-weighted sum
in fp32; the same kernels, roundings and summation order as the per-expert path. Biased experts
(GPT-OSS) pass their biases stacked in fp32, added to each fp32 product before its rounding,
where the per-expert path's kernel adds them.

``attach_cpu_token(model)`` binds it as ``LinearExperts.token_runner`` (used for 1 to
``MAX_ROWS`` rows in inference; more rows keep the per-expert path) to each LinearExperts whose
experts all qualify (``cannot_attach`` says why one does not): every expert Linear a QuantLinear
prepared for the cpu backend's extension with one integer weight-only scheme, no act-order
column gather, and a GLU the op knows (``glu_args``); biases are optional, per Linear. The
experts' own layouts become views of the stacked copy where they are the same bytes (memory
holds one copy), and ``gate_up_layout(e)`` hands the static decoder's fused gate/up
(``kernels.siblings``) its view too.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..models.experts import ClampedSwiGLU, LinearExperts, SiluGLU, experts_modules
from .cpu import EXT, EXT_PANEL, PANEL
from .quant_linear import QuantLinear
from .siblings import stack_results

LAYOUT_KEYS = ("w", "scales", "zeros")
GLU_SILU, GLU_CLAMPED_SWIGLU = 0, 1  # the op's ``glu`` (csrc/cpu_moe_glu.h GluKind)
MAX_ROWS = 32  # the most rows one op call takes (docs/decisions/moe-rows-bound.md)


def is_silu(act_fn) -> bool:
    """Whether ``act_fn`` is SiLU (torch's module or function, transformers' activation)."""
    if act_fn is torch.nn.functional.silu or isinstance(act_fn, nn.SiLU):
        return True
    return type(act_fn).__name__ == "SiLUActivation"


def glu_args(glu) -> tuple[int, float, float] | None:
    """The op's ``(glu, alpha, limit)`` for an experts' GLU, or None when the op has no such GLU."""
    if isinstance(glu, SiluGLU) and is_silu(glu.act_fn):
        return GLU_SILU, 1.0, 0.0
    if isinstance(glu, ClampedSwiGLU):
        return GLU_CLAMPED_SWIGLU, float(glu.alpha), float(glu.limit)
    return None


def _scheme_problem(lins: list[nn.Module]) -> str | None:
    """Why the expert Linears' one scheme cannot run as the op (None: it can)."""
    schemes = {m.scheme for m in lins}
    if len(schemes) != 1:
        return "the experts' schemes differ"
    scheme = next(iter(schemes))
    if scheme.is_float:
        return f"{scheme.weights} weights (the op runs integer weights)"
    if scheme.activations:
        return "W8A8 (the op runs weight-only schemes)"
    if scheme.act_order:
        return "act-order (each expert's own column order; the op quantizes x once for all)"
    return None


def _layout_problem(lins: list[nn.Module]) -> str | None:
    """Why the expert Linears' prepared layouts cannot be stacked for the op (None: they can)."""
    if not all(m.backend_name == "cpu" and m._runner is not None for m in lins):
        return "not every expert Linear runs on the cpu backend's extension"
    kinds = set()
    for m in lins:
        p = m.prepared()
        if p["src"].numel() or not p["w"].is_contiguous():
            return "a layout gathers columns (act-order / padding map)"
        kinds.add(int(p["meta"][0]))
    if len(kinds) != 1 or next(iter(kinds)) not in (EXT, EXT_PANEL):
        return "the experts' layouts are not all rows or all panels of the extension"
    return None


def _shape_problem(experts: LinearExperts) -> str | None:
    """Why the experts' gate/up/down shapes cannot be stacked (None: they are all the same)."""
    gate = experts[0].linears()[0]
    inter, hidden = gate.out_features, gate.in_features
    for mlp in experts:
        g, u, d = mlp.linears()
        if (g.out_features, u.out_features, d.in_features) != (inter,) * 3 or \
                (g.in_features, u.in_features, d.out_features) != (hidden,) * 3:
            return "the experts' shapes differ"
    return None


def cannot_attach(experts: LinearExperts) -> str | None:
    """Why ``experts`` cannot run as one op per call (None: it can)."""
    if len(experts) == 0:
        return "no experts"
    lins = [lin for mlp in experts for lin in mlp.linears()]
    if not all(isinstance(m, QuantLinear) for m in lins):
        return "not every expert Linear is quantized"
    glu = experts[0].glu
    if not all(mlp.glu is glu for mlp in experts):
        return "the experts' GLUs differ"
    if glu_args(glu) is None:
        return "the GLU is neither SiLU(gate) * up nor GPT-OSS's clamped SwiGLU"
    return _scheme_problem(lins) or _layout_problem(lins) or _shape_problem(experts)


def _stack_biases(groups: list[list[nn.Module]]) -> torch.Tensor | None:
    """[E, n] fp32: row e the biases of ``groups[e]``'s Linears in order (zeros for one without;
    gate's then up's, as ``kernels.siblings`` concatenates them), or None when none has a bias."""
    if all(m.bias is None for group in groups for m in group):
        return None
    return torch.stack([
        torch.cat([torch.zeros(m.out_features) if m.bias is None else m.bias.detach().float().cpu() for m in group])
        for group in groups
    ])


def _stack_into(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{key: [E, ...]} of the experts' layouts (one copy, filled expert by expert)."""
    out = {}
    for key in LAYOUT_KEYS:
        first = parts[0][key]
        if any(p[key].shape != first.shape or p[key].dtype != first.dtype for p in parts):
            raise ValueError(f"the experts' {key} layouts differ in shape or dtype")
        out[key] = torch.empty((len(parts), *first.shape), dtype=first.dtype)
        for e, p in enumerate(parts):
            out[key][e].copy_(p[key])
    return out


def _share(lin: QuantLinear, views: dict[str, torch.Tensor]) -> bool:
    """Make ``lin``'s own layout tensors ``views`` (of a stacked copy) when they hold the same
    bytes; returns whether it did."""
    own = lin.prepared()
    if not all(k in own and own[k].shape == v.shape and own[k].dtype == v.dtype and torch.equal(own[k], v)
               for k, v in views.items()):
        return False
    for k, v in views.items():
        setattr(lin, f"_p_{k}", v)
    lin._prepared_cache = None
    return True


class CpuTokenExperts:
    """Stacked extension layouts of one LinearExperts; called as the fused experts module is
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, for T up to
    ``max_rows`` (the op takes any T; LinearExperts sends more rows per expert)."""

    max_rows = MAX_ROWS

    def __init__(self, experts: LinearExperts):
        why = cannot_attach(experts)
        if why is not None:
            raise ValueError(f"the cpu one-op experts path cannot run these experts: {why}")
        first = experts[0].linears()[0]
        self.n_experts = len(experts)
        self.inter, self.hidden = first.out_features, first.in_features
        self._stack_layouts(experts)
        self.gu_bias = _stack_biases([list(mlp.linears()[:2]) for mlp in experts])  # [E, 2I] or None
        self.down_bias = _stack_biases([[mlp.linears()[2]] for mlp in experts])  # [E, H] or None
        self.glu, self.alpha, self.limit = glu_args(experts[0].glu)
        self.shared = self._share_layouts(experts)

    def _stack_layouts(self, experts: LinearExperts) -> None:
        """``gu`` / ``down``: {key: [E, ...]} of every expert's gate/up (one product, gate rows
        first) and down layouts, with their meta, bits and blocks."""
        first = experts[0].linears()[0]
        backend, dtype = first._backend, first.compute_dtype
        gate_up = []
        for mlp in experts:
            gate, up, _ = mlp.linears()
            gate_up.append(backend.prepare(stack_results([gate.quant_result(), up.quant_result()]), dtype))
        self.gu_meta = gate_up[0]["meta"]
        self.gu = _stack_into(gate_up)
        del gate_up
        downs = [mlp.linears()[2].prepared() for mlp in experts]
        self.down_meta = downs[0]["meta"]
        self.down = _stack_into(downs)
        self.src = torch.empty(0, dtype=torch.int32)
        kind, bits, self.gu_block, _ = self.gu_meta.tolist()
        self.panels = kind == EXT_PANEL
        self.bits = 4 if bits <= 4 else 8
        self.down_block = int(self.down_meta[2])

    def _share_layouts(self, experts: LinearExperts) -> int:
        """Point the experts' own layouts at views of the stacked copy; returns how many
        Linears now share it."""
        n = 0
        for e, mlp in enumerate(experts):
            gate, up, down = mlp.linears()
            n += _share(down, {k: self.down[k][e] for k in LAYOUT_KEYS})
            if self.panels and self.inter % PANEL:
                continue  # gate's last panel is padded: its rows are not a slice of the stack
            split = self.inter // PANEL if self.panels else self.inter
            n += _share(gate, {k: self.gu[k][e, :split] for k in LAYOUT_KEYS})
            n += _share(up, {k: self.gu[k][e, split:] for k in LAYOUT_KEYS})
        return n

    def gate_up_layout(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e's gate and up as one prepared layout (views), for ``Siblings(prepared=)``."""
        return {**{k: self.gu[k][e] for k in LAYOUT_KEYS}, "src": self.src, "meta": self.gu_meta}

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        gu, down = self.gu, self.down
        return _moe_token()(
            hidden, top_k_index, top_k_weights, gu["w"], gu["scales"], gu["zeros"],
            down["w"], down["scales"], down["zeros"], self.bits, self.gu_block, self.down_block,
            self.inter, self.panels, self.gu_bias, self.down_bias, self.glu, self.alpha, self.limit)


@functools.cache
def _moe_token():
    """The op, looked up once (``torch.ops`` attribute lookups cost microseconds per call)."""
    return torch.ops.quantspec_cpu.moe_token.default


def attach_cpu_token(model: nn.Module) -> list[str]:
    """Bind the one-op path to every qualifying LinearExperts of ``model`` that has no
    grouped (Triton) runner; returns their names."""
    bound = []
    for name, experts in experts_modules(model).items():
        if experts.runner is None and cannot_attach(experts) is None:
            experts.token_runner = CpuTokenExperts(experts)
            bound.append(name)
    return bound
