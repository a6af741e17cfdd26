"""The EAGLE draft head: one decoder layer that predicts the target's next features.

EAGLE (Li et al. 2024, arXiv:2401.15077) drafts from the target's own features rather than from
tokens alone. At position t the head reads the target's feature ``f_t`` (the final-normed
hidden state its LM head reads, which predicts token ``x_{t+1}``) and the embedding of the
token ``x_{t+1}`` that was actually chosen, and predicts ``f_{t+1}``; the target's LM head on
that prediction gives the draft distribution of ``x_{t+2}``. Drafting further feeds the
head's own predicted feature back in.

The layer is EAGLE-1's, as vLLM's ``EagleLlamaForCausalLM`` reads it (``export.py``):
``fc`` [H, 2H] over ``cat(embedding, feature)``, then one Llama decoder layer without its
input norm (attention with rotary positions, post-attention RMSNorm, SwiGLU MLP, residuals),
and no final norm. The head keeps its own copy of the target's LM head rows for a *draft
vocabulary* (``token_ids``: the most frequent next tokens of the training text, EAGLE-3's
``d2t`` idea): a draft step then reads N x H of the LM head instead of V x H, which on a small
target is most of a draft step's cost. Those rows are frozen; everything else is trained.

Pure module: no state between calls. The proposer (``proposer.py``) keeps the KV cache.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import QuantspecError
from ...kernels.small_ops import rms_norm_reference, rope_reference, signed_sin
from ...strict import reject_unknown

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle_head.safetensors"


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape (the target's widths) and where it came from."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target: str = ""  # the target's name or folder, for the record
    target_features: str = "dense"  # "dense" or the quantized checkpoint the features came from

    @classmethod
    def for_target(cls, config, draft_vocab_size: int, target: str = "", target_features: str = "dense"
                   ) -> "EagleConfig":
        """The head of a transformers ``config`` (any family with the usual width fields)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        missing = [f for f in ("hidden_size", "num_attention_heads", "vocab_size") if getattr(text, f, None) is None]
        if missing:
            raise QuantspecError(f"the target's config has no {', '.join(missing)}: an EAGLE head copies a "
                                 "decoder layer's widths from them.", "use a draft model or n-gram draft for it.")
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        rope = getattr(text, "rope_parameters", None)
        # the head's own rotary base: the target's where it declares one (a NoPE or ALiBi target declares none)
        theta = float((rope.get("rope_theta") if isinstance(rope, dict) else None)
                      or getattr(text, "rope_theta", None) or 10000.0)
        vocab = int(text.vocab_size)
        # fields a family may leave None (Cohere's LayerNorm targets have no RMSNorm epsilon): the head's own defaults
        eps = getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None) or 1e-6
        return cls(hidden_size=hidden, intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
                   num_heads=heads, num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim=head_dim, rope_theta=theta, rms_eps=float(eps),
                   vocab_size=vocab, draft_vocab_size=min(int(draft_vocab_size), vocab), target=target,
                   target_features=target_features)

    @classmethod
    def from_dict(cls, data: dict) -> "EagleConfig":
        reject_unknown(cls, data, "eagle head config")
        return cls(**data)


def check_target(model: nn.Module) -> None:
    """Refuse in one line a target no head can serve, before training starts (``train_head``;
    ``eagle_proposer`` checks a saved head's widths). The head reads ``cat(embedding, feature)`` through ``fc`` [H, 2H], so the token embeddings
    must be as wide as the hidden states (ELECTRA- and RemBERT-style factorized embeddings are not)."""
    config = EagleConfig.for_target(model.config, 1)
    width = int(model.get_input_embeddings().weight.shape[1])
    if width != config.hidden_size:
        raise QuantspecError(f"the target's token embeddings are {width} wide and its hidden states "
                             f"{config.hidden_size}: an EAGLE head needs them equal.",
                             "use a draft model or n-gram draft for it.")


class EagleHead(nn.Module):
    """``forward(features, embeddings, positions, past=None) -> (predicted features, (k, v))``.

    features, embeddings: [B, T, H]; positions: int64 [B, T] (the feature's own position t);
    past: the keys and values [B, KV, L, D] of earlier positions (or None) and an optional bool
    mask [B, 1, T, L + T] (True: attend; default causal over past + new). ``logits(f)`` scores
    the draft vocabulary; ``token_ids`` maps its columns to the target's token ids.
    """

    def __init__(self, config: EagleConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        c = config
        self.config = c
        h, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.fc = lin(2 * c.hidden_size, c.hidden_size)
        self.q_proj, self.k_proj, self.v_proj = lin(c.hidden_size, h), lin(c.hidden_size, kv), lin(c.hidden_size, kv)
        self.o_proj = lin(h, c.hidden_size)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size, dtype=dtype))
        self.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.down_proj = lin(c.intermediate_size, c.hidden_size)
        self.lm_head = nn.Parameter(torch.zeros(c.draft_vocab_size, c.hidden_size, dtype=dtype), requires_grad=False)
        # the LM-head rows as a quantized layer, for drafting only (``draft_weights.quantize_head``)
        self.logits_layer: nn.Module | None = None
        self.register_buffer("token_ids", torch.arange(c.draft_vocab_size, dtype=torch.int64))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), signed_sin(emb.sin()).to(dtype)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        b, t, _ = features.shape
        x = self.fc(torch.cat([embeddings, features], dim=-1))
        cos, sin = self._rotary(positions, x.dtype)
        q = rope_reference(self.q_proj(x).view(b, t, c.num_heads, c.head_dim), cos, sin)
        k = rope_reference(self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if mask is None:
            total = k.shape[2]
            cols = torch.arange(total, device=x.device)
            mask = cols.unsqueeze(0) <= torch.arange(total - t, total, device=x.device).unsqueeze(1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))
        y = rms_norm_reference(x, self.post_attention_layernorm, c.rms_eps)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return x, (k, v)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N]: the draft vocabulary's logits (column j is token ``token_ids[j]``)."""
        if self.logits_layer is not None:
            return self.logits_layer(features)
        return F.linear(features, self.lm_head)

    def set_vocabulary(self, token_ids: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Keep the target's LM head rows [V, H] of ``token_ids`` (int64 [N])."""
        ids = token_ids.to(torch.int64).cpu()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{ids.numel()} token ids for a draft vocabulary of {self.config.draft_vocab_size}")
        self.token_ids.copy_(ids)
        self.lm_head.data.copy_(lm_head_weight.detach()[ids.to(lm_head_weight.device)].to(self.lm_head.dtype))

    def save(self, folder: str | Path) -> Path:
        """Write ``eagle_config.json`` and ``eagle_head.safetensors`` into ``folder``."""
        from ...checkpoint.atomic import atomic_save_file, atomic_write_text

        if any(not isinstance(m, nn.Linear) for m in self.children()):  # ``draft_weights`` swapped some
            raise ValueError("a head quantized for drafting is not saved: save the trained one")
        folder = Path(folder)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_save_file(tensors, folder / WEIGHTS_FILE)
        atomic_write_text(folder / CONFIG_FILE, json.dumps(asdict(self.config), indent=1) + "\n")
        return folder


def head_files(folder: str | Path) -> tuple[Path, Path]:
    """(config, weights) of the head saved in ``folder``; QuantspecError where there is none
    (checked before any model loads: ``specdec.factory.check_spec``)."""
    folder = Path(folder).expanduser()
    cfg_path, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_path.is_file() or not weights.is_file():
        raise QuantspecError(f"{folder} is not an EAGLE head (no {CONFIG_FILE} / {WEIGHTS_FILE}).",
                             "train one with `quantspec train-draft TARGET --out DIR`.")
    return cfg_path, weights


def load_head(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> EagleHead:
    """An ``EagleHead`` saved by ``EagleHead.save`` (or ``quantspec train-draft``)."""
    from safetensors.torch import load_file

    cfg_path, weights = head_files(folder)
    head = EagleHead(EagleConfig.from_dict(json.loads(cfg_path.read_text())), dtype=dtype)
    state = load_file(str(weights))
    head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
    return head.to(device).eval()
