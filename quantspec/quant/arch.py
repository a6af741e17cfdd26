"""Architecture declarations: where the decoder blocks are and how their Linears are ordered.

One frozen ``ArchSpec`` per family, declared as data (as llm-compressor's AWQMapping and
GPTQModel's module_tree do), looked up by ``config.model_type`` (``arch_infer.get_arch``, which
finds the parts of an undeclared family by structure). Names inside a block are
relative to the block (``self_attn.q_proj``); names of the blocks, embedding, final norm and
lm_head are relative to the model (``model.layers``).

``sequential`` lists the block's Linears in true-sequential order: Linears of one group read
the same input (q/k/v), and a group runs after every group before it (GPTQ quantizes group by
group so later groups see already-quantized predecessors).

``smooth`` lists the smoothing pairs of AWQ (Lin et al. 2023, arXiv 2306.00978) and
SmoothQuant (Xiao et al. 2022, arXiv 2211.10438): a per-channel scale ``s`` divides the output
channels of ``prev`` and multiplies the input columns of ``linears``. Consumers must check
shapes and skip a pair that does not fit: with grouped-query attention ``v_proj``'s output
(n_kv_heads * head_dim) is narrower than ``o_proj``'s input, so v -> o cannot be smoothed.
``prev_parts`` > 1 marks a fused ``prev`` (Phi-3's qkv_proj, gate_up_proj) whose output is
``prev_parts`` chunks of which the balanced Linears read only the last; usable only when
``prev.out_features == prev_parts * linear.in_features``.

``followers`` of a pair read ``prev``'s output but are not quantized (a MoE router, a shared
expert's gate): folding multiplies their weight's input columns by ``s`` too, so their outputs
(the routing) stay unchanged.

``patterns`` (mixture-of-experts families): every name is a glob whose ``*`` stands for one
name part (an expert index), and may match nothing in a given block (DeepSeek's first blocks
are dense MLPs, the rest sparse). ``groups_in`` and ``pairs_in`` give a block's concrete names;
a pair whose ``prev`` has a ``*`` pairs each match with the Linears of the same index
(``mlp.experts.*.up_proj`` -> ``mlp.experts.*.down_proj``: expert e's up with expert e's down).

``norm_offset``: Gemma's RMSNorm computes ``x * (offset + weight)`` with offset 1.0, so folding
a scale ``s`` into it means ``weight' = (offset + weight) / s - offset``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from torch import nn


@dataclass(frozen=True)
class SmoothPair:
    """prev op (a norm or a Linear, block-relative) -> the Linears whose inputs it feeds."""

    prev: str
    linears: tuple[str, ...]
    prev_parts: int = 1
    followers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArchSpec:
    """Where a decoder-only family keeps its parts. See the module docstring."""

    name: str
    blocks: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    sequential: tuple[tuple[str, ...], ...] = ()
    smooth: tuple[SmoothPair, ...] = ()
    norm_offset: float = 0.0
    patterns: bool = False
    # the block-relative attention module whose keys and values the KV cache holds; its
    # checkpoint KV scales are ``{block}.{attention}.k_scale`` / ``v_scale``. None: the family
    # caches something per-head scales do not describe (MLA's compressed latent). Not part of
    # the repr (resume fingerprints): it names KV scales only, never changes a block's rounding.
    attention: str | None = field(default="self_attn", repr=False)

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        """The decoder blocks of ``model``."""
        return model.get_submodule(self.blocks)  # type: ignore[return-value]

    def block_name(self, index: int) -> str:
        return f"{self.blocks}.{index}"

    def linear_names(self) -> tuple[str, ...]:
        """Block-relative Linear names in true-sequential order."""
        return tuple(n for group in self.sequential for n in group)

    def groups_in(self, block: nn.Module) -> list[tuple[str, ...]]:
        """The block's Linears (block-relative names) in ``sequential``'s groups; empty groups
        left out."""
        if not self.patterns:
            return [g for g in self.sequential if g]
        names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        groups = [tuple(n for p in g for n in names if _glob(p).fullmatch(n)) for g in self.sequential]
        return [g for g in groups if g]

    def pairs_in(self, block: nn.Module) -> list[SmoothPair]:
        """``smooth`` with this block's concrete names (a pattern pair expanded per match)."""
        if not self.patterns:
            return list(self.smooth)
        names = [n for n, _ in block.named_modules() if n]
        out = []
        for p in self.smooth:
            prevs = [(n, m.groups()) for n in names if (m := _glob(p.prev).fullmatch(n))]
            for prev, parts in prevs:
                fill = lambda pat: _fill(pat, parts)  # noqa: E731
                linears = tuple(n for pat in p.linears for n in names if _glob(fill(pat)).fullmatch(n))
                followers = tuple(n for pat in p.followers for n in names if _glob(fill(pat)).fullmatch(n))
                if linears:
                    out.append(SmoothPair(prev, linears, p.prev_parts, followers))
        return out


def _glob(pattern: str) -> re.Pattern:
    """``mlp.experts.*.up_proj`` as a regex whose ``*`` captures one name part."""
    return re.compile(re.escape(pattern).replace(r"\*", r"([^.]+)"))


def _fill(pattern: str, parts: tuple[str, ...]) -> str:
    """``pattern`` with its first ``len(parts)`` stars replaced by ``parts``."""
    for part in parts:
        pattern = pattern.replace("*", part, 1)
    return pattern


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")
_LLAMA_SEQUENTIAL = (_ATTN, ("self_attn.o_proj",), _MLP, ("mlp.down_proj",))


def _llama_like_smooth(mlp_norm: str) -> tuple[SmoothPair, ...]:
    return (
        SmoothPair("input_layernorm", _ATTN),
        SmoothPair("self_attn.v_proj", ("self_attn.o_proj",)),
        SmoothPair(mlp_norm, _MLP),
        SmoothPair("mlp.up_proj", ("mlp.down_proj",)),
    )


LLAMA = ArchSpec(
    name="llama", sequential=_LLAMA_SEQUENTIAL, smooth=_llama_like_smooth("post_attention_layernorm")
)
QWEN2 = replace(LLAMA, name="qwen2")
QWEN3 = replace(LLAMA, name="qwen3")
MISTRAL = replace(LLAMA, name="mistral")
GEMMA2 = replace(
    LLAMA, name="gemma2", smooth=_llama_like_smooth("pre_feedforward_layernorm"), norm_offset=1.0
)
GEMMA3_TEXT = replace(GEMMA2, name="gemma3_text")
PHI3 = ArchSpec(
    name="phi3",
    sequential=(
        ("self_attn.qkv_proj",),
        ("self_attn.o_proj",),
        ("mlp.gate_up_proj",),
        ("mlp.down_proj",),
    ),
    smooth=(
        SmoothPair("input_layernorm", ("self_attn.qkv_proj",)),
        SmoothPair("self_attn.qkv_proj", ("self_attn.o_proj",), prev_parts=3),
        SmoothPair("post_attention_layernorm", ("mlp.gate_up_proj",)),
        SmoothPair("mlp.gate_up_proj", ("mlp.down_proj",), prev_parts=2),
    ),
)


def _moe(name: str, attn: tuple[tuple[str, ...], ...], attn_smooth: tuple[SmoothPair, ...],
         expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), mlp: str = "mlp",
         routers: tuple[str, ...] = ("gate", "shared_expert_gate")) -> ArchSpec:
    """A mixture-of-experts family: routed experts (``models/experts.py``'s per-expert Linears)
    under ``mlp``, shared experts and dense MLP blocks, as patterns. The post-attention norm
    feeds the ``routers``, every expert's gate/up and the shared experts' gate/up; each expert's
    up feeds its down."""
    gate, up, down = expert
    mlps = (mlp, f"{mlp}.shared_expert", f"{mlp}.shared_experts")
    mlp_in = tuple(f"{m}.{p}" for m in mlps for p in ("gate_proj", "up_proj"))
    mlp_in += (f"{mlp}.experts.*.{gate}", f"{mlp}.experts.*.{up}")
    downs = tuple(f"{m}.down_proj" for m in mlps) + (f"{mlp}.experts.*.{down}",)
    up_down = tuple(SmoothPair(f"{m}.up_proj", (f"{m}.down_proj",)) for m in mlps)
    return ArchSpec(
        name=name, patterns=True, sequential=(*attn, mlp_in, downs),
        smooth=(*attn_smooth,
                SmoothPair("post_attention_layernorm", mlp_in, followers=tuple(f"{mlp}.{r}" for r in routers)),
                *up_down, SmoothPair(f"{mlp}.experts.*.{up}", (f"{mlp}.experts.*.{down}",))),
    )


_GQA = (_ATTN, ("self_attn.o_proj",))
_GQA_SMOOTH = _llama_like_smooth("post_attention_layernorm")[:2]
_MLA_Q = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
_MLA = (_MLA_Q, ("self_attn.q_b_proj",), ("self_attn.kv_b_proj",), ("self_attn.o_proj",))
_MLA_SMOOTH = (
    SmoothPair("input_layernorm", _MLA_Q),
    SmoothPair("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
    SmoothPair("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
)
QWEN3_MOE = _moe("qwen3_moe", _GQA, _GQA_SMOOTH)
MOE_ARCHS = {
    "qwen2_moe": replace(QWEN3_MOE, name="qwen2_moe"),
    "qwen3_moe": QWEN3_MOE,
    "olmoe": replace(QWEN3_MOE, name="olmoe"),
    "glm4_moe": replace(QWEN3_MOE, name="glm4_moe"),
    "mixtral": _moe("mixtral", _GQA, _GQA_SMOOTH, ("w1", "w3", "w2")),
    "deepseek_v2": replace(_moe("deepseek_v2", _MLA, _MLA_SMOOTH), attention=None),
    "deepseek_v3": replace(_moe("deepseek_v3", _MLA, _MLA_SMOOTH), attention=None),
    "granitemoe": _moe("granitemoe", _GQA, _GQA_SMOOTH, mlp="block_sparse_moe", routers=("router",)),
    # GPT-OSS: biased experts behind a clamped SwiGLU (up -> down is not linear: no pair there)
    "gpt_oss": ArchSpec(
        name="gpt_oss", patterns=True,
        sequential=(*_GQA, ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), ("mlp.experts.*.down_proj",)),
        smooth=(*_GQA_SMOOTH, SmoothPair("post_attention_layernorm", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"),
                                         followers=("mlp.router",))),
    ),
}

ARCHS: dict[str, ArchSpec] = {
    **MOE_ARCHS,
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "mistral": MISTRAL,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3_TEXT,
    "phi3": PHI3,
}


def check_arch(model: nn.Module, spec: ArchSpec) -> list[str]:
    """Problems with ``spec`` on ``model`` (missing names, wrong types); [] when it fits."""
    problems: list[str] = []

    def find(name: str) -> nn.Module | None:
        return submodule_or_none(model, name)

    blocks = find(spec.blocks)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return [f"{spec.blocks} is not a non-empty ModuleList"]
    if not isinstance(find(spec.embed), nn.Embedding):
        problems.append(f"{spec.embed} is not an Embedding")
    if find(spec.final_norm) is None:
        problems.append(f"{spec.final_norm} is missing")
    if not isinstance(find(spec.lm_head), nn.Linear):
        problems.append(f"{spec.lm_head} is not a Linear")
    for i, block in enumerate(blocks):
        if spec.attention is not None and submodule_or_none(block, spec.attention) is None:
            problems.append(f"{spec.block_name(i)}.{spec.attention} is missing")
        if spec.patterns:
            if not spec.groups_in(block):
                problems.append(f"{spec.block_name(i)} has no Linear that {spec.name}'s patterns name")
            continue
        for rel in spec.linear_names():
            if not isinstance(submodule_or_none(block, rel), nn.Linear):
                problems.append(f"{spec.block_name(i)}.{rel} is not a Linear")
        for pair in spec.smooth:
            if submodule_or_none(block, pair.prev) is None:
                problems.append(f"{spec.block_name(i)}.{pair.prev} is missing")
    return problems


def head_name(model: nn.Module) -> str | None:
    """The module name of ``model``'s output embeddings (the LM head), or None."""
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def submodule_or_none(module: nn.Module, name: str) -> nn.Module | None:
    """``module.get_submodule(name)``, or None when there is no such submodule."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def block_linears(model: nn.Module, arch: ArchSpec) -> dict[str, nn.Linear]:
    """Every Linear inside the decoder blocks, by full name, in module order."""
    out: dict[str, nn.Linear] = {}
    for i, block in enumerate(arch.block_list(model)):
        for rel, mod in block.named_modules():
            if isinstance(mod, nn.Linear):
                out[f"{arch.block_name(i)}.{rel}"] = mod
    return out
