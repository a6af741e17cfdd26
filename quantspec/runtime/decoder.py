"""A static-cache decoder for Llama-block models: the forward pass without transformers' overhead.

On a CPU, one decode step of a small model through transformers costs about 0.5 ms per block in
Python and small ops (norms as eight ops, rotary as six per tensor, a growing KV cache
concatenated every step) before any weight is read; with 4-bit weights that overhead is most of
the step. ``StaticDecoder`` runs the same computation from the model's own modules and weights
(nothing is copied; q/k/v and gate/up of quantized layers run as one product each, see
``kernels.siblings``), with a preallocated KV cache that grows by doubling, and RMSNorm, rotary
and SwiGLU as one op each (``kernels.small_ops``; dense bf16 layers through ``kernels.dense``).

Where every block allows it (dense MLPs, the CPU extension's products and attention), the
blocks of a step without holes in the cache run as one C++ loop (``decode_plan``: the same op
calls, the same bits), which removes the Python between the ops: a quarter of a 4-bit draft
step of SmolLM2-135M.

It is a ``runtime.protocol.Decoder``, like ``runtime.kv.KVDecoder``: a batch of rows that
advance unevenly, each row's new tokens right-aligned in a chunk, ``drop_last`` forgetting a
row's last tokens by masking their cache columns (a batch of one just shortens its cache).
Logits agree with transformers' within rounding (fp32: 1e-4 relative; bf16: the roundings of
two fused ops differ).

Token trees (``forward_tree`` / ``keep_path``, declared in ``runtime.protocol``) run through
the masked attention path: each node's mask row is the committed columns plus its ancestors'
columns, and ``keep_path`` copies the kept nodes' keys and values next to the committed ones.
Blocks with a sliding window refuse trees once the window would cut the cache; ``tree_columns``
says so before a run starts (``specdec.loop`` refuses such runs up front).

GPT-OSS (``families``: attention sinks, half-width rotary, a norm rounded once, MoE-only
blocks) runs the same way: its sinks go into the softmax of both attention paths (the
extension's ``attend`` and the fp32 ``small_ops.attention``), and a block's sliding window is
applied by ``attend`` too as long as the cache has no holes.

A checkpoint with KV-cache scales (``runtime.kv_quant.kv_quantizer``) has every key (after
RoPE) and value rounded to its grid as it is written, as ``QuantKVCache`` does on the
transformers path, so both decoders compute attention on what a quantized cache holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import QuantspecError
from ..kernels.cpu import DENSE_FROM_M
from ..kernels.dense import fast_linear
from ..kernels.output_head import OutputHead
from ..kernels.siblings import Siblings
from ..kernels.small_ops import (
    attend,
    attention,
    rms_norm,
    rms_norm_rounded_once,
    rope,
    signed_sin,
    silu_mul,
)
from .families import DecoderFamily, family_of, is_moe_block
from .kv_quant import kv_quantizer
from .protocol import Decoder, TreeRegion, kept_columns


def _eps(norm: nn.Module, default: float) -> float:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return default


@dataclass
class _Block:
    attn_norm: torch.Tensor
    qkv: Siblings
    out: Callable[[torch.Tensor], torch.Tensor]
    out_module: nn.Module  # what ``out`` computes (``decode_plan`` reads its weights)
    mlp_norm: torch.Tensor
    gate_up: Siblings | None
    down: Callable[[torch.Tensor], torch.Tensor] | None
    down_module: nn.Module | None
    moe: nn.Module | None  # a MoE block's sparse MLP (router + experts), called as a whole
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    window: int | None  # sliding-window attention of this block, in positions
    sinks: torch.Tensor | None  # fp32 [H]: each head's sink logit (GPT-OSS)


class StaticDecoder(Decoder):
    """Incremental forward passes of ``model`` (a declared family) for a batch of B rows.

    ``lengths[b]``: the real tokens row b holds in the cache.
    """

    def __init__(self, model: nn.Module, family: DecoderFamily | None = None, fuse: bool = True,
                 plan: bool = True, screen: bool = True):
        """fuse: run q/k/v and gate/up of quantized layers as one product each (``Siblings``;
        the layers' own layouts are released until they are called directly). plan: run the
        blocks of a step as one C++ loop where they allow it (``decode_plan``; built on the
        first forward, ``plan_refusal`` says why not). screen: ``forward_argmax`` screens the
        output head through its int8 copy where it can (``kernels.output_head``;
        ``lm_head.refusal`` says why not)."""
        self.fuse = fuse
        self._plan, self.plan_refusal = None, None if plan else "turned off (plan=False)"
        self.family = family or family_of(model)
        arch = self.family.arch
        config = model.config
        self.model = model
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.embed = model.get_submodule(arch.embed)
        self.rotary = model.get_submodule(self.family.rotary)
        final = model.get_submodule(arch.final_norm)
        self.final_norm, self.eps = final.weight, _eps(final, eps)
        self.norm = rms_norm_rounded_once if self.family.norm_rounds_once else rms_norm
        self.lm_head = OutputHead(model.get_submodule(arch.lm_head), screen=screen)
        self.blocks = [self._block(b, config) for b in arch.block_list(model)]
        self.kv = kv_quantizer(model)  # None: the cache stores keys and values as computed
        self._check_rotary()
        self.reset()

    def _check_rotary(self) -> None:
        """Refuse a rotary embedding narrower than the heads (partial rotary) or of another
        width than the family declares."""
        with torch.no_grad():
            cos, _ = self._rotary(self.embed.weight[:1].unsqueeze(0), torch.zeros(1, 1, dtype=torch.int64,
                                                                                   device=self.device))
        if cos.shape[-1] != self.head_dim:
            raise QuantspecError(f"{self.model.config.model_type}'s rotary embedding covers {cos.shape[-1]} of "
                                 f"{self.head_dim} head dimensions", "run it through transformers.")

    def _rotary(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, t, D] of positions ``pos`` [B, t] from the model's own rotary module
        (a half-width one's repeated: rotating the halves is rotate_half with cos, sin twice)."""
        cos, sin = self.rotary(x, pos)
        if self.family.rotary_half:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos, sin

    def _block(self, block: nn.Module, config) -> _Block:
        fam = self.family
        get = block.get_submodule
        qn, kn = (get(n).weight for n in fam.qk_norm) if fam.qk_norm else (None, None)
        window = getattr(get(fam.out.rsplit(".", 1)[0]), "sliding_window", None)
        if window is None and getattr(config, "model_type", "") in ("mistral", "mixtral"):
            window = getattr(config, "sliding_window", None)
        moe = get(fam.moe) if is_moe_block(block, fam) else None
        dense = moe is None and fam.gate_up is not None and fam.down is not None
        if moe is not None and self.fuse:  # each expert's gate and up as one product
            from ..models.experts import experts_modules

            for experts in experts_modules(moe).values():
                shared = experts.token_runner  # its stacked layouts hold each gate/up already
                for e, mlp in enumerate(experts):
                    gate, up, _ = mlp.linears()
                    layout = shared.gate_up_layout(e) if shared is not None else None
                    mlp.gate_up = Siblings([gate, up], fuse=True, prepared=layout)
        return _Block(
            attn_norm=get(fam.attn_norm).weight,
            qkv=Siblings([get(n) for n in fam.qkv], fuse=self.fuse),
            out=fast_linear(get(fam.out)),
            out_module=get(fam.out),
            mlp_norm=get(fam.mlp_norm).weight,
            gate_up=Siblings([get(n) for n in fam.gate_up], fuse=self.fuse) if dense else None,
            down=fast_linear(get(fam.down)) if dense else None,
            down_module=get(fam.down) if dense else None,
            moe=moe,
            q_norm=qn,
            k_norm=kn,
            window=int(window) if window else None,
            sinks=block.get_parameter(fam.sinks).detach().float() if fam.sinks else None,
        )

    @property
    def device(self) -> torch.device:
        return self.final_norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def reset(self) -> None:
        self.lengths: list[int] = []
        self.width = 0  # cache columns in use
        self.mask: torch.Tensor | None = None  # bool [B, width], once rows have holes or padding
        self.tree: TreeRegion | None = None  # the tree nodes fed since the last keep_path
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def _ensure(self, batch: int, need: int) -> None:
        if len(self.lengths) != batch:
            self.reset()
            self.lengths = [0] * batch
        cap = self._k[0].shape[2] if self._k else 0
        if need <= cap:
            return
        new_cap = max(2 * cap, need + 64)
        shape = (batch, self.n_kv, new_cap, self.head_dim)
        for cache in (self._k, self._v):
            old = list(cache)
            cache.clear()
            for i in range(len(self.blocks)):
                cache.append(torch.empty(shape, dtype=self.dtype, device=self.device))
                if old:
                    cache[i][:, :, : self.width] = old[i][:, :, : self.width]

    @property
    def columns(self) -> int:
        return self.width

    def copy_prefix_from(self, other: Decoder, start: int = 0) -> str | None:
        if not isinstance(other, StaticDecoder):
            return f"the source is a {type(other).__name__}, not a StaticDecoder"
        if other.tree is not None or not other.lengths:
            return "the source holds a token tree or nothing"
        shape = (len(self.blocks), self.n_kv, self.head_dim, [b.window for b in self.blocks])
        if shape != (len(other.blocks), other.n_kv, other.head_dim, [b.window for b in other.blocks]):
            return "the source's blocks, KV heads, head size or windows differ"
        if self.kv is not None:
            return "this decoder rounds its cache to KV-cache scales"
        if start and (self.tree is not None or len(self.lengths) != len(other.lengths)
                      or not start <= min(self.width, other.width)):
            return f"this decoder does not hold the first {start} columns of the source's rows"
        if not start:
            self.reset()
        self._ensure(len(other.lengths), other.width)
        for mine, theirs in zip(self._k + self._v, other._k + other._v):
            mine[:, :, start: other.width] = theirs[:, :, start: other.width]
        self.width, self.lengths = other.width, list(other.lengths)
        self.mask = None if other.mask is None else other.mask.clone()  # the rows' holes and padding
        return None

    def _columns(self, chunks: list[torch.Tensor], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, t] (right-aligned chunks) and position ids [B, t]; updates the masks."""
        batch, dev = len(chunks), self.device
        sizes = [int(c.numel()) for c in chunks]
        ragged = any(n != t for n in sizes)
        if ragged:
            ids = torch.zeros(batch, t, dtype=torch.int64, device=dev)
            for b, c in enumerate(chunks):
                if sizes[b]:
                    ids[b, t - sizes[b]:] = c.to(dev)
        else:
            ids = torch.stack(chunks).to(dev)
        for b, n in enumerate(sizes):
            self.lengths[b] += n
        if self.mask is None and not ragged:
            pos = torch.arange(self.width, self.width + t, device=dev)
            return ids, pos.unsqueeze(0).expand(batch, t)
        if self.mask is None:
            self.mask = torch.ones(batch, self.width, dtype=torch.bool, device=dev)
        new = torch.zeros(batch, t, dtype=torch.bool, device=dev)
        for b, c in enumerate(chunks):
            new[b, t - c.numel():] = True
        self.mask = torch.cat([self.mask, new], dim=1)
        pos = (self.mask.cumsum(dim=1) - 1).clamp(min=0)[:, -t:]
        return ids, pos

    def _attn_mask(self, t: int, pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
        """bool [B, 1, t, L] (True: attend), or None when every query sees every column."""
        total = self.width + t
        if self.mask is None and t == 1 and (window is None or total <= window):
            return None
        dev = self.device
        cols = torch.arange(total, device=dev)
        rows = torch.arange(self.width, total, device=dev)
        allowed = cols.unsqueeze(0) <= rows.unsqueeze(1)  # causal [t, L]
        allowed = allowed.unsqueeze(0)
        if self.mask is not None:
            allowed = allowed & self.mask.unsqueeze(1)
        if window is not None and total > window:
            col_pos = (self.mask.cumsum(1) - 1) if self.mask is not None else cols.unsqueeze(0)
            allowed = allowed & (col_pos.unsqueeze(1) > pos.unsqueeze(2) - window)
        allowed = allowed | (cols.unsqueeze(0) == rows.unsqueeze(1)).unsqueeze(0)  # padding rows
        return allowed.unsqueeze(1)

    @torch.inference_mode()
    def forward(self, chunks: list[torch.Tensor], keep: int = 0) -> torch.Tensor:
        """Feed ``chunks[b]`` (int64 [T_b]) to row b; returns logits [B, T, V] (``keep`` > 0:
        the last ``keep`` positions only), row b's in its last T_b positions."""
        return self.lm_head(self._features(chunks, keep))

    @torch.inference_mode()
    def forward_features(self, chunks: list[torch.Tensor], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self._features(chunks, keep)
        return self.lm_head(feats), feats

    def _features(self, chunks: list[torch.Tensor], keep: int) -> torch.Tensor:
        """The final-normed hidden states [B, T or keep, H] of ``forward``."""
        if self.tree is not None:
            raise ValueError("a token tree is held: call keep_path before a plain forward")
        t = max(int(c.numel()) for c in chunks)
        if t == 0:
            raise ValueError("forward needs at least one new token in some row")
        self._ensure(len(chunks), self.width + t)
        ids, pos = self._columns(chunks, t)
        x = self._blocks(ids, pos, None)
        if keep:
            x = x[:, -keep:]
        return self.norm(x, self.final_norm, self.eps)

    @torch.inference_mode()
    def forward_argmax(self, chunks: list[torch.Tensor], keep: int = 0, features: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        feats = self._features(chunks, keep)
        return self.lm_head.argmax(feats), feats if features else None

    @torch.inference_mode()
    def forward_tree(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]) -> torch.Tensor:
        return self.lm_head(self._tree_features(chunks, parents))

    @torch.inference_mode()
    def forward_tree_features(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self._tree_features(chunks, parents)
        return self.lm_head(feats), feats

    @torch.inference_mode()
    def forward_tree_argmax(self, chunks: list[torch.Tensor], parents: list[torch.Tensor],
                            features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        feats = self._tree_features(chunks, parents)
        return self.lm_head.argmax(feats), feats if features else None

    def tree_columns(self) -> int | None:
        """The shortest sliding window of the blocks (None: no block has one)."""
        return min((blk.window for blk in self.blocks if blk.window is not None), default=None)

    def _tree_features(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]) -> torch.Tensor:
        """The final-normed hidden states [B, T, H] of ``forward_tree``."""
        t = max(int(c.numel()) for c in chunks)
        if t == 0:
            raise ValueError("forward_tree needs at least one node in some row")
        limit = self.tree_columns()
        if limit is not None and self.width + t > limit:
            raise QuantspecError(f"token trees over {self.width + t} positions meet a sliding window "
                                 f"of {limit}, which they do not support.",
                                 "use chains (no tree) for this model.")
        self._ensure(len(chunks), self.width + t)
        batch, dev = len(chunks), self.device
        if self.tree is None:
            self.tree = TreeRegion(self.width, batch)
        if self.mask is None:
            self.mask = torch.ones(batch, self.width, dtype=torch.bool, device=dev)
        ids = torch.zeros(batch, t, dtype=torch.int64, device=dev)
        real = torch.zeros(batch, t, dtype=torch.bool, device=dev)
        for b, c in enumerate(chunks):
            if c.numel():
                ids[b, t - c.numel():] = c.to(dev)
                real[b, t - c.numel():] = True
        depth, sees = self.tree.add(parents, t)
        start = self.tree.start
        pos = torch.tensor(self.lengths, dtype=torch.int64, device=dev).unsqueeze(1) + depth.to(dev)
        committed = self.mask[:, :start].unsqueeze(1).expand(batch, t, start)
        allowed = torch.cat([committed, sees.to(dev)], dim=2).unsqueeze(1)  # [B, 1, t, width + t]
        self.mask = torch.cat([self.mask, real], dim=1)
        return self.norm(self._blocks(ids, pos, allowed), self.final_norm, self.eps)

    @torch.inference_mode()
    def keep_path(self, paths) -> None:
        kept = kept_columns(self.tree, paths, self.device)
        self.tree = None
        if kept is None:
            return
        start, idx, real = kept
        n = idx.shape[1]
        if n:
            for cache in (self._k, self._v):
                for kc in cache:
                    sel = idx[:, None, :, None].expand(kc.shape[0], kc.shape[1], n, kc.shape[3])
                    kc[:, :, start:start + n] = kc.gather(2, sel)
        self.mask = torch.cat([self.mask[:, :start], real], dim=1)
        for b in range(len(self.lengths)):
            self.lengths[b] += int(real[b].sum())
        self.width = start + n
        if bool(self.mask.all()):
            self.mask = None  # no holes left (a batch of one): the unmasked fast path again

    def _blocks(self, ids: torch.Tensor, pos: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
        """Run every block over new columns [width, width + t) (``ids`` [B, t] at positions
        ``pos`` [B, t]), writing their keys and values to the cache; returns the last hidden
        states [B, t, H] before the final norm. ``tree_mask``: bool [B, 1, t, width + t], the
        attention of a tree forward (else the causal one over the row masks)."""
        t = ids.shape[1]
        x = self.embed(ids)
        cos, sin = self._rotary(x, pos)
        sin = signed_sin(sin)
        b, h, kv, d = ids.shape[0], self.n_heads, self.n_kv, self.head_dim
        masks: dict[int | None, torch.Tensor | None] = {}
        lo, hi = self.width, self.width + t
        if self.kv is None and tree_mask is None and self.mask is None and b * t < DENSE_FROM_M:
            plan = self._step_plan()
            if plan is not None and x.dtype == cos.dtype == sin.dtype == self.dtype:
                x = plan.run(x, cos, sin, self._k, self._v, lo)  # the loop below, in C++
                self.width = hi
                return x
        for i, blk in enumerate(self.blocks):
            y = self.norm(x, blk.attn_norm, self.eps)
            q, k, v = blk.qkv(y)
            q, k, v = q.view(b, t, h, d), k.view(b, t, kv, d), v.view(b, t, kv, d)
            if blk.q_norm is not None:
                q, k = rms_norm(q, blk.q_norm, self.eps), rms_norm(k, blk.k_norm, self.eps)
            kc, vc = self._k[i], self._v[i]
            if self.kv is None and tree_mask is None and self.mask is None:
                o = attend(q, k, v, cos, sin, kc, vc, lo, blk.sinks, blk.window)  # no holes: causal
            else:
                if blk.window not in masks:
                    masks[blk.window] = tree_mask if tree_mask is not None else self._attn_mask(t, pos, blk.window)
                q, k = rope(q, cos, sin), rope(k, cos, sin)
                k, v = k.transpose(1, 2), v.transpose(1, 2)
                if self.kv is not None:
                    k, v = self.kv(k, i, 0), self.kv(v, i, 1)
                kc[:, :, lo:hi] = k
                vc[:, :, lo:hi] = v
                o = attention(q.transpose(1, 2), kc[:, :, :hi], vc[:, :, :hi], masks[blk.window], blk.sinks)
                o = o.transpose(1, 2).reshape(b, t, h * d)
            x = x + blk.out(o)
            y = self.norm(x, blk.mlp_norm, self.eps)
            if blk.moe is not None:
                out = blk.moe(y)
                x = x + (out[0] if self.family.moe_returns_scores else out)
            else:
                gate, up = blk.gate_up(y)
                x = x + blk.down(silu_mul(gate, up))
        self.width = hi
        return x

    def _step_plan(self):
        """The blocks' DecodePlan, built on first use (None where ``plan_refusal`` says why)."""
        if self._plan is None and self.plan_refusal is None:
            from .decode_plan import build_plan

            self._plan, self.plan_refusal = build_plan(self)
        return self._plan

    def drop_last(self, counts: list[int]) -> None:
        """Forget the last ``counts[b]`` real tokens of each row (rejected drafts)."""
        if self.tree is not None:
            raise ValueError("a token tree is held: call keep_path before drop_last")
        for b, c in enumerate(counts):
            if c > self.lengths[b]:
                raise ValueError(f"row {b} holds {self.lengths[b]} tokens, cannot drop {c}")
        if not any(counts):
            return
        if len(counts) == 1 and self.mask is None:
            self.width -= counts[0]
            self.lengths[0] -= counts[0]
            return
        if self.mask is None:
            self.mask = torch.ones(len(counts), self.width, dtype=torch.bool, device=self.device)
        for b, c in enumerate(counts):
            if c > 0:
                cols = self.mask[b].nonzero().squeeze(1)[-c:]
                self.mask[b, cols] = False
                self.lengths[b] -= c
        used = self.mask.any(dim=0).nonzero()
        self.width = int(used[-1]) + 1 if used.numel() else 0
        self.mask = self.mask[:, : self.width]


def fast_decoder(model: nn.Module, fuse: bool = True, plan: bool = True, screen: bool = True) -> Decoder:
    """A StaticDecoder for a declared family, else transformers' forward (``runtime.kv.KVDecoder``)."""
    try:
        return StaticDecoder(model, fuse=fuse, plan=plan, screen=screen)
    except QuantspecError:
        from .kv import KVDecoder

        return KVDecoder(model)
