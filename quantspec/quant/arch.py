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

``norm_offset``: Gemma's RMSNorm computes ``x * (offset + weight)`` with offset 1.0, so folding
a scale ``s`` into it means ``weight' = (offset + weight) / s - offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn


@dataclass(frozen=True)
class SmoothPair:
    """prev op (a norm or a Linear, block-relative) -> the Linears whose inputs it feeds."""

    prev: str
    linears: tuple[str, ...]
    prev_parts: int = 1


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

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        """The decoder blocks of ``model``."""
        return model.get_submodule(self.blocks)  # type: ignore[return-value]

    def block_name(self, index: int) -> str:
        return f"{self.blocks}.{index}"

    def linear_names(self) -> tuple[str, ...]:
        """Block-relative Linear names in true-sequential order."""
        return tuple(n for group in self.sequential for n in group)


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

ARCHS: dict[str, ArchSpec] = {
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
