"""Which model families the static decoder runs, declared as data.

A family runs when its block is the Llama block: ``x + o(attn(rope(q), rope(k), v))`` then
``x + down(silu(gate) * up)``, each half behind an RMSNorm (``weight * normalized``, offset 0),
with rotary embeddings from the model's own ``rotary_emb`` (so every rope scaling that
transformers implements is honoured). ``qk_norm`` adds Qwen3's per-head RMSNorm of q and k
before rope. Names are those of ``quant.arch`` (blocks, embedding, final norm, lm_head) plus the
block-relative ones below. Gemma (offset norms, scaled embeddings, soft-capping) and Phi-3 (fused
projections) are not declared: they run through transformers.

Mixture-of-experts families (Qwen3-MoE, Mixtral): a block whose ``moe`` module holds routed
experts (``models.experts.LinearExperts``) runs that module as its MLP half (the model's own
router, then each active expert's packed product, results weighted back; dense blocks keep
gate/up/down).

GPT-OSS declares what its block adds to the Llama block (each checked against transformers'
``modeling_gpt_oss``): learned attention ``sinks`` (one logit per head in the softmax's
denominator, with no value), biased q/k/v/o (any Linear's bias is applied as the layer has it),
sliding-window and full blocks alternating (each block's window is its attention module's
``sliding_window``), rotary cos/sin of half the head width (``rotary_half``: its rotation of
the two halves equals Llama's ``rotate_half`` with cos and sin repeated), an RMSNorm that
multiplies by its weight in fp32 and rounds once (``norm_rounds_once``; transformers keeps those
weights in fp32 in a bf16 checkpoint), and no dense MLP (``gate_up`` None): every block's ``mlp``
(router, then experts with biases and a clamped SwiGLU) runs as a whole and returns
``(hidden, router_scores)`` (``moe_returns_scores``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import QuantspecError
from ..quant.arch import ARCHS, ArchSpec, submodule_or_none


@dataclass(frozen=True)
class DecoderFamily:
    arch: ArchSpec
    qkv: tuple[str, str, str] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    out: str = "self_attn.o_proj"
    # a dense block's MLP; None: the family has no dense MLP, every block runs ``moe`` whole
    gate_up: tuple[str, str] | None = ("mlp.gate_proj", "mlp.up_proj")
    down: str | None = "mlp.down_proj"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    rotary: str = "model.rotary_emb"
    qk_norm: tuple[str, str] | None = None  # per-head norms of q and k (Qwen3)
    moe: str | None = None  # the sparse MLP module of a MoE block (called as a whole)
    moe_returns_scores: bool = False  # ``moe`` returns (hidden, router_scores) (GPT-OSS)
    sinks: str | None = None  # the attention's per-head sink logits [H] (GPT-OSS)
    rotary_half: bool = False  # rotary cos/sin are [.., head_dim / 2] (GPT-OSS)
    norm_rounds_once: bool = False  # RMSNorm is (w * normed32).to(dtype), not w * normed.to(dtype)


FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(ARCHS["llama"]),
    "mistral": DecoderFamily(ARCHS["mistral"]),
    "qwen2": DecoderFamily(ARCHS["qwen2"]),
    "qwen3": DecoderFamily(ARCHS["qwen3"], qk_norm=("self_attn.q_norm", "self_attn.k_norm")),
    "qwen3_moe": DecoderFamily(ARCHS["qwen3_moe"], qk_norm=("self_attn.q_norm", "self_attn.k_norm"), moe="mlp"),
    "mixtral": DecoderFamily(ARCHS["mixtral"], moe="mlp"),
    "gpt_oss": DecoderFamily(ARCHS["gpt_oss"], gate_up=None, down=None, moe="mlp", moe_returns_scores=True,
                             sinks="self_attn.sinks", rotary_half=True, norm_rounds_once=True),
}


def is_moe_block(block: nn.Module, family: DecoderFamily) -> bool:
    """Whether ``block``'s MLP half is the family's sparse MoE module (routed experts, fused or
    one Linear per expert; in a family without dense MLPs, whatever the module holds)."""
    from ..models.experts import experts_modules, is_fused_experts

    mlp = submodule_or_none(block, family.moe) if family.moe else None
    if family.gate_up is None:
        return mlp is not None
    return mlp is not None and (bool(experts_modules(mlp)) or any(is_fused_experts(m) for m in mlp.modules()))


def family_of(model: nn.Module) -> DecoderFamily:
    """The declared family of ``model``; QuantspecError naming what does not fit otherwise."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type or "")
    fix = "run it through transformers (the static decoder covers " + ", ".join(FAMILIES) + ")."
    if family is None:
        raise QuantspecError(f"the static decoder has no declaration for model_type {model_type!r}", fix)
    act = getattr(config, "hidden_act", "silu")
    if family.gate_up is not None and act != "silu":
        raise QuantspecError(f"{model_type} with hidden_act={act!r} (the static decoder runs silu)", fix)
    arch = family.arch
    missing = [n for n in (arch.blocks, arch.embed, arch.final_norm, arch.lm_head, family.rotary)
               if submodule_or_none(model, n) is None]
    names = [*family.qkv, family.out, family.attn_norm, family.mlp_norm, *(family.qk_norm or ())]
    blocks = submodule_or_none(model, arch.blocks)
    heads = getattr(config, "num_attention_heads", None)
    for i, block in enumerate(blocks if isinstance(blocks, nn.ModuleList) else []):
        if is_moe_block(block, family):
            mlp = []
        else:
            mlp = [family.moe] if family.gate_up is None else [*family.gate_up, family.down]
        missing += [f"{arch.block_name(i)}.{n}" for n in names + mlp if n and submodule_or_none(block, n) is None]
        if family.sinks and _shape(block, family.sinks) != (heads,):
            missing.append(f"{arch.block_name(i)}.{family.sinks} (a parameter [{heads}]: one sink per head)")
    if missing:
        raise QuantspecError(f"{model_type} model lacks {', '.join(missing)}", fix)
    return family


def _shape(module: nn.Module, name: str) -> tuple[int, ...] | None:
    """The shape of ``module``'s parameter ``name``, or None when there is none."""
    try:
        return tuple(module.get_parameter(name).shape)
    except AttributeError:
        return None
