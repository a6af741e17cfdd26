"""A causal LM with its own KV cache over a batch of sequences that advance unevenly.

The cache stays rectangular ([B, L] columns) while each row holds its own number of real
tokens: a row's new tokens are right-aligned in each forward chunk (left-padded inside the
chunk), and dropping a row's last tokens masks their columns out instead of moving the others.
Columns that no row uses any more at the right end are cropped (``DynamicCache.crop(-n)``).
Masked columns are holes: the 2D attention mask hides them and the position ids count only
real tokens, so each row computes what it would compute alone. Nothing is ever recomputed.

Token trees (``forward_tree`` / ``keep_path``, declared in ``runtime.protocol``) hand
transformers a 4-D additive float mask [B, 1, t, L + t] (taken as given, in every attention
implementation) with each node's position ids; ``keep_path`` moves the kept nodes' keys and
values (``cache.layers[i].keys/values``, [B, heads, L, D]) next to the committed ones and cuts
the rest off. Sliding-window cache layers, recurrent (linear-attention, state-space) ones, and
models whose forward takes no position ids (ALiBi), refuse trees (``tree_refusal``).

Rolling back a sliding-window layer past its window, or a recurrent layer at all, needs the
states before the dropped tokens: after the first forward (the prefill, which keeps only what
the next forward needs) such caches record them (``activate_past_recording``, as transformers'
assisted generation does) and every ``drop_last`` crops them back. Their windows and states
count columns, not real tokens, so those models, and the ones without position ids, decode the
rows of a batch one at a time (``rows_alone``).

``PlainDecoder`` is the same forward with nothing added, for rows that advance together: no
attention mask, no position ids, what a plain greedy loop over transformers does.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import QuantspecError, one_line
from .kv_quant import new_cache
from .protocol import Decoder, TreeRegion, kept_columns


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: transformers renamed past_key_values to
    cache (5.x); whichever ``model`` (or the model a torch.compile'd module wraps) takes."""
    params = inspect.signature(getattr(model, "_orig_mod", model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# the most tokens one forward may add and a drop_last take back on a recording cache (a recurrent layer
# keeps a state per token of a forward, up to this many; a verification feeds k + 1, k <= the loop's k_max 16)
ROLLBACK = 64


class KVDecoder(Decoder):
    """Incremental forward passes of ``model`` for a batch of B rows.

    ``lengths[b]`` is the number of real tokens row b holds in the cache.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # int64 [B, L]
        self.lengths: list[int] = []
        self.tree: TreeRegion | None = None  # the tree nodes fed since the last keep_path
        self._cache_kw = cache_kwarg(model)
        self._recording = False  # the cache keeps the states a rollback needs (see the module docstring)
        self._must_record = False  # its cache has sliding-window or recurrent layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def columns(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def reset(self) -> None:
        self.cache, self.mask, self.lengths, self.tree, self._recording = None, None, [], None, False

    def _ensure(self, batch_size: int) -> None:
        if self.mask is None or self.mask.shape[0] != batch_size:
            self.tree, self._recording = None, False
            self.cache = new_cache(self.model)
            self._must_record = _sliding(self.cache) or _recurrent(self.cache)
            self.mask = torch.zeros(batch_size, 0, dtype=torch.int64, device=self.device)
            self.lengths = [0] * batch_size

    def copy_prefix_from(self, other: Decoder, start: int = 0) -> str | None:
        """Takes ``other``'s keys and values by reference, whatever ``start`` (a DynamicLayer never
        changes a tensor in place: ``update`` concatenates, ``crop`` and ``keep_path`` rebind), cast
        to this model's dtype. Plain caches only: a sliding-window, recurrent or quantized layer
        keeps state that columns do not describe."""
        if not isinstance(other, KVDecoder) or other.cache is None or other.tree is not None:
            return f"the source is a {type(other).__name__}, not a KVDecoder holding a cache without a token tree"
        if _kv_shape(self.model) != _kv_shape(other.model):
            return "the source's layers, heads or head size differ"
        mine = new_cache(self.model)
        if not (_plain(mine) and _plain(other.cache)) or len(mine.layers) != len(other.cache.layers):
            return "a cache with sliding-window, recurrent or quantized layers, or layers made as they come"
        dtype = self.model.get_input_embeddings().weight.dtype
        for layer, theirs in zip(mine.layers, other.cache.layers):
            if theirs.is_initialized:
                keys, values = theirs.keys.to(dtype), theirs.values.to(dtype)
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
        self.cache, self.mask, self.lengths = mine, other.mask.clone(), list(other.lengths)
        self.tree, self._recording, self._must_record = None, False, False
        return None

    def forward(self, chunks: list[torch.Tensor], keep: int = 0) -> torch.Tensor:
        """Feed ``chunks[b]`` (int64 [T_b], T_b may be 0) to row b; returns logits [B, T, V].

        T = max T_b; row b's logits are the last T_b positions (right-aligned). ``keep`` > 0
        computes only the last ``keep`` positions' logits.
        """
        return self._run(chunks, keep, features=False).logits

    def forward_features(self, chunks: list[torch.Tensor], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the last hidden states (transformers' last ``hidden_states``: after
        the final norm, what the LM head reads), of the same positions."""
        out = self._run(chunks, keep, features=True)
        feats = out.hidden_states[-1]
        return out.logits, feats[:, -keep:] if keep else feats

    def _run(self, chunks: list[torch.Tensor], keep: int, features: bool):
        if self.tree is not None:
            raise ValueError("a token tree is held: call keep_path before a plain forward")
        self._ensure(len(chunks))
        t = max(int(c.numel()) for c in chunks)
        if t == 0:
            raise ValueError("forward needs at least one new token in some row")
        if self._recording and t > ROLLBACK:  # before the cache changes: a draft this long could not roll back
            raise QuantspecError(f"{self._name()}'s cache (sliding-window or recurrent layers) rolls back at most "
                                 f"{ROLLBACK} tokens per forward, and this one feeds {t}.",
                                 f"use a draft length (--k) of {ROLLBACK - 1} or less.")
        dev = self.device
        ids = torch.zeros(len(chunks), t, dtype=torch.int64, device=dev)
        new_mask = torch.zeros(len(chunks), t, dtype=torch.int64, device=dev)
        for b, c in enumerate(chunks):
            if c.numel():
                ids[b, t - c.numel() :] = c.to(dev)
                new_mask[b, t - c.numel() :] = 1
                self.lengths[b] += int(c.numel())
        mask = torch.cat([self.mask, new_mask], dim=1)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -t:]
        first = self.mask.shape[1] == 0
        # e.g. MiniMax (a cache class of its own), XLM (a mask over the new tokens only), Dory (looped layers)
        out = self._call("incremental decoding over a KV cache with a per-row mask", "generate without a draft",
                         input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=keep, output_hidden_states=features)
        self.mask = mask
        if first and self.cache.get_seq_length() == 0:  # e.g. RWKV: its state lives elsewhere, nothing can roll back
            raise QuantspecError(f"{self._name()}'s forward kept nothing in the KV cache it was given, so rejected "
                                 "drafts cannot be rolled back.", "generate without a draft for this model.")
        if self._must_record and not self._recording:
            self.cache.activate_past_recording(recurrent_states_to_keep=ROLLBACK)
            self._recording = True
        return out

    def forward_tree(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]) -> torch.Tensor:
        return self._tree_run(chunks, parents, features=False).logits

    def forward_tree_features(self, chunks: list[torch.Tensor], parents: list[torch.Tensor]
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._tree_run(chunks, parents, features=True)
        return out.logits, out.hidden_states[-1]

    def tree_refusal(self) -> str | None:
        """What makes rows decode alone (``rows_alone``) rules trees out too: a sliding window or a
        recurrent state cannot follow a tree's branches, and without ``position_ids`` a node can be
        put neither at its depth nor under a 4-D mask."""
        why = self.rows_alone()
        return None if why is None else f"{why}, which token trees do not support"

    def rows_alone(self) -> str | None:
        """Sliding windows and recurrent states count cache columns, and so do positions where the
        forward takes none (ALiBi, learned absolute ones): masked holes would shift them."""
        cache = new_cache(self.model)
        if _sliding(cache):
            return "this model's KV cache has sliding-window layers"
        if _recurrent(cache):
            return "this model's cache has recurrent (linear-attention or state-space) layers"
        if not self._takes_positions():
            return (f"{self._name()}'s forward takes no position ids (its positions come from the cache's "
                    "columns or the 2-D attention mask, e.g. ALiBi)")
        return None

    def _name(self) -> str:
        return type(getattr(self.model, "_orig_mod", self.model)).__name__

    def _call(self, what: str, fix: str, **kw):
        """The model's forward over the cache; an error it raises on these inputs (not out of
        memory) is a one-line QuantspecError saying it refuses ``what``, with ``fix``."""
        try:
            return self.model(**kw, **{self._cache_kw: self.cache})
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError, AssertionError, NotImplementedError) as exc:
            from ..models.source import check_context

            mask = kw.get("attention_mask")
            if mask is not None:  # past the positions it has: that, not the cache, is the cause
                check_context(getattr(self.model, "config", None), int(mask.shape[-1]), "the sequence",
                              "shorten the prompt or generate fewer tokens (together at most {context}).")
            why = one_line(exc, 200) or "no message"
            raise QuantspecError(f"{self._name()}'s forward refuses {what} ({type(exc).__name__}: {why}).",
                                 f"{fix} for this model.") from exc

    def _takes_positions(self) -> bool:
        return "position_ids" in inspect.signature(getattr(self.model, "_orig_mod", self.model).forward).parameters

    def _tree_run(self, chunks: list[torch.Tensor], parents: list[torch.Tensor], features: bool):
        self._ensure(len(chunks))
        if self.tree is None and (why := self.tree_refusal()):
            raise QuantspecError(f"{why}.", "use chains (no tree) for this model.")
        t = max(int(c.numel()) for c in chunks)
        if t == 0:
            raise ValueError("forward_tree needs at least one node in some row")
        batch, dev = len(chunks), self.device
        if self.tree is None:
            self.tree = TreeRegion(self.mask.shape[1], batch)
        ids = torch.zeros(batch, t, dtype=torch.int64, device=dev)
        real = torch.zeros(batch, t, dtype=torch.int64, device=dev)
        for b, c in enumerate(chunks):
            if c.numel():
                ids[b, t - c.numel():] = c.to(dev)
                real[b, t - c.numel():] = 1
        depth, sees = self.tree.add(parents, t)
        start = self.tree.start
        committed = self.mask[:, :start].bool().unsqueeze(1).expand(batch, t, start)
        allowed = torch.cat([committed, sees.to(dev)], dim=2).unsqueeze(1)  # [B, 1, t, L + t]
        dtype = next(self.model.parameters()).dtype
        bias = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, torch.finfo(dtype).min)
        pos = torch.tensor(self.lengths, dtype=torch.int64, device=dev).unsqueeze(1) + depth.to(dev)
        out = self._call("a token tree's 4-D attention mask", "use chains (drop --tree)", input_ids=ids,
                         attention_mask=bias, position_ids=pos, use_cache=True, output_hidden_states=features)
        self.mask = torch.cat([self.mask, real], dim=1)
        return out

    def keep_path(self, paths) -> None:
        kept = kept_columns(self.tree, paths, self.device)
        self.tree = None
        if kept is None:
            return
        start, idx, real = kept
        n = idx.shape[1]
        for layer in self.cache.layers:
            for name, (dim, view) in _COLUMNS.items():
                x = getattr(layer, name, None)
                if not isinstance(x, torch.Tensor) or x.dim() != len(view):  # holds nothing (shared KV)
                    continue
                sel = idx.to(x.device)[view].expand(*[n if d == dim else size for d, size in enumerate(x.shape)])
                setattr(layer, name, torch.cat([x.narrow(dim, 0, start), x.gather(dim, sel)], dim=dim))
        self.mask = torch.cat([self.mask[:, :start], real.to(self.mask.dtype)], dim=1)
        for b in range(len(self.lengths)):
            self.lengths[b] += int(real[b].sum())

    def drop_last(self, counts: list[int]) -> None:
        """Forget the last ``counts[b]`` real tokens of each row (rejected drafts)."""
        assert self.mask is not None and self.cache is not None
        if self.tree is not None:
            raise ValueError("a token tree is held: call keep_path before drop_last")
        if self._recording and max(counts, default=0) > ROLLBACK:
            raise ValueError(f"a recording cache takes back at most {ROLLBACK} tokens at once, not {max(counts)}")
        for b, c in enumerate(counts):
            if c <= 0:
                continue
            if c > self.lengths[b]:
                raise ValueError(f"row {b} holds {self.lengths[b]} tokens, cannot drop {c}")
            cols = self.mask[b].nonzero().squeeze(1)[-c:]
            self.mask[b, cols] = 0
            self.lengths[b] -= c
        used = self.mask.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        if width < self.mask.shape[1] or self._recording:  # a recording cache also crops back what it kept
            self.cache.crop(width - self.mask.shape[1])  # negative: tokens to remove
            self.mask = self.mask[:, :width]


# the tensors a cache layer holds per column: name -> (column dim, index [B, n] viewed to its rank);
# keys and values [B, heads, L, D]; a sparse-attention (DSA) layer's indexer keys [B, L, D] and
# indexer positions [P, B, L] (transformers' DynamicIndexedLayer)
_COLUMNS = {"keys": (2, (slice(None), None, slice(None), None)), "values": (2, (slice(None), None, slice(None), None)),
            "indexer_keys": (1, (slice(None), slice(None), None)),
            "indexer_position_ids": (2, (None, slice(None), slice(None)))}


def _plain(cache) -> bool:
    """A DynamicCache of plain DynamicLayers (no window, no recurrent state, no KV-cache scales)."""
    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


def _kv_shape(model) -> tuple:
    """What makes two models' caches interchangeable: layers, heads, KV heads, widths."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return tuple(getattr(cfg, name, None) for name in
                 ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim"))


def _sliding(cache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", []))


def _recurrent(cache) -> bool:
    """A linear-attention or state-space layer (transformers' ``LinearAttentionCacheLayerMixin``
    keeps conv and recurrent states, not keys and values)."""
    return any(hasattr(layer, "recurrent_states") for layer in getattr(cache, "layers", []))


class PlainDecoder(Decoder):
    """transformers' forward over a ``DynamicCache`` for rows that advance together: ``step``
    is ``model(input_ids=ids, use_cache=True, logits_to_keep=keep, cache)`` and nothing more.

    The chunks of a ``forward`` have one length (ragged ones fail in ``torch.stack``) and all
    ids are on the model's device; ``drop_last`` drops one count from every row (else a
    ValueError). ``KVDecoder`` takes both. ``model`` may be a torch.compile'd module.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._cache_kw = cache_kwarg(model)
        self.reset()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def lengths(self) -> list[int]:
        return [self._length] * self._rows

    def reset(self) -> None:
        # the cache is made here, not in the first forward: a timed run starts with it ready
        self.cache = new_cache(self.model)
        self._rows = self._length = 0

    def forward(self, chunks: list[torch.Tensor], keep: int = 0) -> torch.Tensor:
        return self.step(torch.stack(chunks), keep)

    def step(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        if self._length and ids.shape[0] != self._rows:
            self.reset()
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self._cache_kw: self.cache})
        self._rows, self._length = ids.shape[0], self._length + ids.shape[1]
        return out.logits

    def drop_last(self, counts: list[int]) -> None:
        if len(set(counts)) > 1:
            raise ValueError(f"rows advance together here; cannot drop {counts} (use KVDecoder)")
        n = counts[0] if counts else 0
        if n > self._length:
            raise ValueError(f"rows hold {self._length} tokens, cannot drop {n}")
        if n:
            self.cache.crop(-n)  # negative: tokens to remove
            self._length -= n
