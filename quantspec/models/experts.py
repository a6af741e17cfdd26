"""Mixture-of-experts blocks with one ``nn.Linear`` per expert, named as checkpoints name them.

transformers 5 keeps a block's routed experts as fused 3-D parameters (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]) that no ``nn.Linear`` hook sees, while checkpoints
on disk (and the engines that load them) keep one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``; Mixtral: ``block_sparse_moe.experts.{e}.w1.weight``).
``linearize_experts`` replaces each fused experts module with a ``LinearExperts``: a ModuleList
of per-expert MLPs (``ExpertMLP``: gate, up, down Linears) computing the same routed output,
so that planning, calibration, packing and loading treat experts like any other Linear.

Families are declared as data (``LAYOUTS``, by ``config.model_type``): the per-expert Linear
names, the in-memory layout (GPT-OSS: interleaved, transposed, biased, clamped SwiGLU), the
renames between module names in memory and tensor names on disk. A family declared unsupported
(``ExpertLayout.unsupported``) or a module laid out otherwise is not linearized;
``fused_experts_left`` names those modules with the reason, for the report.
Granite-MoE keeps its experts fused on disk (``input_linear`` / ``output_linear``) and, like
GPT-OSS, is read whole and linearized in memory; its export is per expert, as vLLM loads it.

Calibration modes (``LinearExperts.calibration``):

* ``None`` (inference): each expert runs on the tokens routed to it, as transformers does.
* ``"all"``: every expert runs on every token (full statistics for each expert: GPTQ's Hessian,
  AWQ's activation scales), while the output stays the routed output (the rows routed to an
  expert, weighted by the router), so later blocks see the model's true activations.
* ``"routed"``: every expert is called on its routed rows only, possibly none.

``routed_counts`` (when not None) accumulates how many tokens the router sent to each expert.
``runner`` (when set, in inference): a kernel path for the whole routed output (the grouped
Triton GEMM, ``kernels.moe``), else each active expert's Linears run in turn.
``token_runner`` (when set, in inference, no ``runner``): the same for a few rows, 1 to its
``max_rows`` (the cpu backend's one-op block, ``kernels.cpu_moe``); more rows go per expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

CALIBRATION_MODES = ("all", "routed")


@dataclass(frozen=True)
class ExpertLayout:
    """How one family stores routed experts.

    names: the per-expert Linears (gate, up, down), as on disk.
    disk_renames: (in memory, on disk) substrings of tensor names (Mixtral's ``.mlp.`` is
    ``.block_sparse_moe.`` on disk).
    routers: module names (relative to the experts' parent, e.g. ``mlp``) that route tokens or
    gate a shared expert; kept dense.
    fused: the in-memory layout. "concat": ``gate_up_proj`` [E, 2I, H] (gate rows, then up
    rows), ``down_proj`` [E, H, I], no biases, ``act_fn(gate) * up``. "gpt_oss": ``gate_up_proj``
    [E, H, 2I] with gate and up columns interleaved, ``down_proj`` [E, I, H], biases, and the
    clamped SwiGLU of GPT-OSS (``ClampedSwiGLU``).
    fused_on_disk: the family's checkpoints keep the fused tensors too (GPT-OSS), so the model
    is read whole (resident) and linearized in memory rather than streamed per expert.
    unsupported: why the family's experts are not linearized (None: they are).
    """

    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    disk_renames: tuple[tuple[str, str], ...] = ()
    routers: tuple[str, ...] = ("gate", "shared_expert_gate")
    fused: str = "concat"
    fused_on_disk: bool = False
    unsupported: str | None = None


QWEN_STYLE = ExpertLayout()
MIXTRAL = ExpertLayout(names=("w1", "w3", "w2"), disk_renames=((".mlp.", ".block_sparse_moe."),))
# vLLM's GPT-OSS loader takes per-expert tensors (mlp.experts.{e}.gate_proj.weight/.bias) too
GPT_OSS = ExpertLayout(routers=("router",), fused="gpt_oss", fused_on_disk=True)

LAYOUTS: dict[str, ExpertLayout] = {
    "qwen2_moe": QWEN_STYLE,
    "qwen3_moe": QWEN_STYLE,
    "olmoe": QWEN_STYLE,
    "deepseek_v2": QWEN_STYLE,
    "deepseek_v3": QWEN_STYLE,
    "glm4_moe": QWEN_STYLE,
    "mixtral": MIXTRAL,
    "gpt_oss": GPT_OSS,
    # fused on disk (block_sparse_moe.input_linear / output_linear); vLLM's loader also takes the
    # per-expert block_sparse_moe.experts.{e}.gate_proj / up_proj / down_proj that quantspec writes
    "granitemoe": ExpertLayout(routers=("router",), fused_on_disk=True),
}


def layout_of(model: nn.Module) -> ExpertLayout:
    """The declared layout of ``model``'s family; undeclared families get the Qwen-style names
    (the layout transformers' own conversion uses for most MoE families)."""
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    return LAYOUTS.get(model_type, QWEN_STYLE)


def is_fused_experts(mod: nn.Module) -> bool:
    """A transformers 5 fused experts module: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def _layout_problem(mod: nn.Module, layout: ExpertLayout) -> str | None:
    """None when ``mod``'s parameters are laid out as ``layout.fused`` says; else what differs."""
    gu, down = tuple(mod.gate_up_proj.shape), tuple(mod.down_proj.shape)
    biases = [isinstance(getattr(mod, b, None), torch.Tensor) for b in ("gate_up_proj_bias", "down_proj_bias")]
    if layout.fused == "gpt_oss":
        e, h, two_i = gu
        if two_i % 2 or down != (e, two_i // 2, h) or not all(biases):
            return f"gate_up_proj {gu} and down_proj {down} (with biases) are not [E, H, 2I] and [E, I, H]"
        if not all(isinstance(getattr(mod, a, None), float) for a in ("alpha", "limit")):
            return "the experts module has no alpha/limit of its clamped SwiGLU"
        return None
    e, two_i, h = gu
    if any(biases):
        return "the experts have biases"
    if two_i % 2 or down != (e, h, two_i // 2):
        return f"gate_up_proj {gu} and down_proj {down} are not [E, 2I, H] and [E, H, I]"
    if not callable(getattr(mod, "act_fn", None)):
        return "the experts module has no act_fn"
    return None


class SiluGLU:
    """``act(gate) * up`` (SwiGLU with the model's activation)."""

    def __init__(self, act_fn):
        self.act_fn = act_fn

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


class ClampedSwiGLU:
    """GPT-OSS: gate clamped above at ``limit``, up to [-limit, limit], then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class ExpertMLP(nn.Module):
    """One expert: ``down(glu(gate(x), up(x)))`` with its Linears named as on disk."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, glu, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inter, bias=bias, device=device, dtype=dtype))
        self.add_module(up, nn.Linear(hidden, inter, bias=bias, device=device, dtype=dtype))
        self.add_module(down, nn.Linear(inter, hidden, bias=bias, device=device, dtype=dtype))
        self.glu = glu
        # gate and up as one product (a ``kernels.siblings.Siblings``), set for fast inference
        self.gate_up = None

    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return tuple(getattr(self, n) for n in self.names)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.linears()
        g, u = self.gate_up(x) if self.gate_up is not None else (gate(x), up(x))
        return down(self.glu(g, u))


class LinearExperts(nn.ModuleList):
    """Routed experts as a list of ``ExpertMLP``; the fused module's call signature
    ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.calibration: str | None = None
        self.routed_counts: torch.Tensor | None = None
        # a kernel path computing the routed output in inference (kernels.moe.attach_grouped)
        self.runner = None
        # a few rows' routed output in one kernel call (kernels.cpu_moe.attach_cpu_token), up to
        # its max_rows rows
        self.token_runner = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.runner is not None and self.calibration is None and self.routed_counts is None:
            return self.runner(hidden_states, top_k_index, top_k_weights)
        n, rows = len(self), hidden_states.shape[0]
        if self.calibration is None and self.routed_counts is None:
            runner = self.token_runner
            # the token runner's layouts stay on CPU
            if runner is not None and 0 < rows <= runner.max_rows and hidden_states.is_cpu:
                return runner(hidden_states, top_k_index, top_k_weights)
            if rows == 1:
                return self._one_token(hidden_states, top_k_index[0].tolist(), top_k_weights[0])
        tokens, slots, counts = routing_order(top_k_index, n)
        if self.routed_counts is not None:
            self.routed_counts += torch.tensor(counts, device=self.routed_counts.device)
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        mode, start = self.calibration, 0
        for e, c in enumerate(counts):
            tok, slot = tokens[start : start + c], slots[start : start + c]
            start += c
            if c == 0 and mode is None:
                continue
            if mode == "all":  # every expert reads the same tensor: shared statistics
                y = self[e](hidden_states)[tok]
            else:
                y = self[e](hidden_states if c == rows == 1 else hidden_states[tok])
            y = y.float() * top_k_weights[tok, slot, None].float()
            if rows == 1:  # decoding one token: a plain add (index_add_ costs ~100x more here)
                if c:
                    out.add_(y)
            else:
                out.index_add_(0, tok, y)
        return out.to(hidden_states.dtype)

    def _one_token(self, x: torch.Tensor, chosen: list[int], weights: torch.Tensor) -> torch.Tensor:
        """Decoding one token: its k experts' outputs, weighted and summed (fp32), without the
        grouping ops of the general path (a few dozen small ops per block, most of a step's time
        at batch 1)."""
        out = None
        for j, e in enumerate(chosen):
            if 0 <= e < len(self):
                y = self[e](x).float() * weights[j].float()
                out = y if out is None else out.add_(y)
        return torch.zeros_like(x) if out is None else out.to(x.dtype)


def routing_order(top_k_index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, slot) pairs of a top-k routing [T, k] grouped by expert: (tokens, slots,
    counts), expert e's pairs being the ``counts[e]`` after the first ``sum(counts[:e])``;
    indices outside [0, n) (dropped tokens) are left out."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    keep = (flat >= 0) & (flat < n)
    order = torch.argsort(torch.where(keep, flat, n), stable=True)[: int(keep.sum())]
    counts = torch.bincount(flat[keep], minlength=n).tolist()
    return order // k, order % k, counts


def linearize(fused: nn.Module, layout: ExpertLayout) -> LinearExperts:
    """A ``LinearExperts`` with ``fused``'s weights (copied; meta stays meta)."""
    w, d = fused.gate_up_proj, fused.down_proj
    gpt_oss = layout.fused == "gpt_oss"
    if gpt_oss:
        e, h, two_i = w.shape
        glu = ClampedSwiGLU(float(fused.alpha), float(fused.limit))
    else:
        e, two_i, h = w.shape
        glu = SiluGLU(fused.act_fn)
    inter = two_i // 2
    experts = []
    for i in range(e):
        mlp = ExpertMLP(layout.names, h, inter, glu, bias=gpt_oss, device=w.device, dtype=w.dtype)
        if not w.is_meta:
            gate, up, down = mlp.linears()
            with torch.no_grad():
                if gpt_oss:
                    gate.weight.copy_(w[i][:, 0::2].t())
                    up.weight.copy_(w[i][:, 1::2].t())
                    down.weight.copy_(d[i].t())
                    gate.bias.copy_(fused.gate_up_proj_bias[i][0::2])
                    up.bias.copy_(fused.gate_up_proj_bias[i][1::2])
                    down.bias.copy_(fused.down_proj_bias[i])
                else:
                    gate.weight.copy_(w[i, :inter])
                    up.weight.copy_(w[i, inter:])
                    down.weight.copy_(d[i])
        experts.append(mlp)
    return LinearExperts(experts)


def linearize_experts(model: nn.Module, calibration: str | None = None) -> list[str]:
    """Replace every fused experts module of ``model`` that its family's layout supports by a
    ``LinearExperts`` (in place, weights copied, fused parameters freed); returns their names.
    ``calibration``: the mode set on each (module docstring)."""
    if calibration not in (None, *CALIBRATION_MODES):
        raise ValueError(f"calibration mode {calibration!r}: choose from {CALIBRATION_MODES}")
    layout = layout_of(model)
    done = []
    if layout.unsupported:
        return done
    for name, mod in list(model.named_modules()):
        if not is_fused_experts(mod) or _layout_problem(mod, layout) is not None:
            continue
        linear = linearize(mod, layout)
        linear.calibration = calibration
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
        done.append(name)
    return done


def fused_experts_left(model: nn.Module) -> dict[str, str]:
    """{name: reason} of the fused experts modules that stay as they are (dense)."""
    layout = layout_of(model)
    out = {}
    for name, mod in model.named_modules():
        if is_fused_experts(mod):
            model_type = getattr(model.config, "model_type", "?")
            why = layout.unsupported or _layout_problem(mod, layout) or "not linearized"
            out[name] = f"fused routed experts of {model_type!r} kept dense: {why}"
    return out


def router_names(model: nn.Module) -> dict[str, str]:
    """{name: reason} of the routers (and shared-expert gates) beside each experts module: the
    router itself, or where it is a module of its own (HunYuan's gate holds a Linear ``wg``),
    every Linear inside it."""
    layout = layout_of(model)
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LinearExperts) or is_fused_experts(mod):
            parent = name.rpartition(".")[0]
            for r in layout.routers:
                full = f"{parent}.{r}" if parent else r
                try:
                    router = model.get_submodule(full)
                except AttributeError:
                    continue
                inner = [f"{full}.{n}" if n else full for n, m in router.named_modules() if isinstance(m, nn.Linear)]
                for n in inner or [full]:
                    out[n] = "MoE router: kept dense (it picks the experts; engines keep it unquantized)"
    return out


def experts_modules(module: nn.Module) -> dict[str, LinearExperts]:
    """{name: LinearExperts} inside ``module``."""
    return {n: m for n, m in module.named_modules() if isinstance(m, LinearExperts)}


def set_calibration(model: nn.Module, mode: str | None) -> None:
    """Set every LinearExperts' calibration mode (None: inference routing)."""
    for mod in experts_modules(model).values():
        mod.calibration = mode


@dataclass(frozen=True)
class KeyMap:
    """Tensor names in memory <-> on disk (identity for families without renames)."""

    renames: tuple[tuple[str, str], ...] = ()

    def to_disk(self, key: str) -> str:
        for mem, disk in self.renames:
            key = key.replace(mem, disk)
        return key

    def to_memory(self, key: str) -> str:
        for mem, disk in self.renames:
            key = key.replace(disk, mem)
        return key

    def state_to_disk(self, state: dict) -> dict:
        return {self.to_disk(k): v for k, v in state.items()} if self.renames else state

    def pattern_to_disk(self, pattern: str) -> str:
        """A regex over names (as quantization configs hold) renamed like ``to_disk``."""
        for mem, disk in self.renames:
            pattern = pattern.replace(re.escape(mem), re.escape(disk)).replace(mem, disk)
        return pattern


def key_map(model: nn.Module) -> KeyMap:
    """The memory <-> disk renames of ``model``'s family (only when its experts are linearized)."""
    layout = layout_of(model)
    if not layout.disk_renames or not experts_modules(model):
        return KeyMap()
    return KeyMap(layout.disk_renames)
