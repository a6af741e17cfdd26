"""An EAGLE head as vLLM's EAGLE-1 draft (``--speculative-config '{"method": "eagle", "model": DIR}'``).

vLLM's ``EagleLlamaForCausalLM`` (vllm/model_executor/models/llama_eagle.py) reads a Llama config
with one hidden layer and the weights ``fc.weight`` [H, 2H] and ``layers.0.*`` (q/k/v/o, the
post-attention norm, gate/up/down; layer 0 has no input norm), concatenates the token
embedding before the target's feature, and shares the target's embedding and LM head when the
folder has none. That is ``EagleHead`` exactly, so the export renames nothing but the layer
prefix. The head's draft-vocabulary LM head is not exported: vLLM's EAGLE-1 drafts over the
target's whole vocabulary with the target's LM head (the rows are the same, so the draft of a
token in the draft vocabulary scores the same; vLLM may also draft tokens outside it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint.atomic import atomic_folder
from .head import EagleHead

LAYER = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def vllm_tensors(head: EagleHead, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's trained weights under vLLM's EAGLE-1 names."""
    out = {"fc.weight": head.fc.weight}
    out.update({f"layers.0.{name}.weight": getattr(head, ours).weight for ours, name in LAYER.items()})
    out["layers.0.post_attention_layernorm.weight"] = head.post_attention_layernorm
    return {k: v.detach().to(dtype).contiguous().cpu() for k, v in out.items()}


def vllm_config(head: EagleHead, target_config):
    """A one-layer ``LlamaConfig`` of the head's widths, with the target's vocabulary, positions
    and special tokens."""
    from transformers import LlamaConfig

    c = head.config
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_eps, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
        bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=getattr(text, "eos_token_id", None),
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="bfloat16",
    )


def export_vllm(head: EagleHead, target_config, out: str | Path, overwrite: bool = False) -> Path:
    """Write the head as a vLLM EAGLE-1 draft folder (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    with atomic_folder(out, overwrite=overwrite) as tmp:
        vllm_config(head, target_config).save_pretrained(tmp)
        save_file(vllm_tensors(head), str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
    return Path(out)
