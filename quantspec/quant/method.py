"""The interface between the calibration engine (``calibrate.py``) and a quantization method.

A method works on one decoder block at a time. It subclasses ``BlockMethod``, declares what it
needs (class attributes) and overrides ``process_block``; the other hooks have no-op defaults,
so a method overrides only what it uses. The engine calls, in order::

    for each block i:  process_block(BlockContext) -> BlockOutput
                       (resumed runs, for each block read back instead:
                        restore_block(BlockContext, BlockOutput.state))
    at the end:        finish(FinishContext) -> Finish     (a post-pass on the whole model)

Contract of ``process_block``: it returns a QuantResult for every planned name, and when it
returns, every planned Linear's ``.weight`` holds the dense weight its QuantResult approximates
(smoothing methods leave the smoothed weight); the engine then swaps the dequantized values in.
Other tensors of the block (e.g. a norm a smoothing scale was folded into) may change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .arch import ArchSpec
from .distributed import Reducer
from ..core.scheme import QuantResult, QuantScheme


@dataclass
class BlockContext:
    """One decoder block as the engine hands it to a method.

    block: the module, on the processing device; name: its full name (``model.layers.3``);
    inputs: the hidden states entering it [n, L, H], one row per calibration sample (None for
    a method that needs no calibration); kwargs: what the block is called with (attention mask,
    position embeddings); plan: its planned Linears (full names) -> QuantScheme, the other
    Linears stay dense.
    """

    block: nn.Module
    name: str
    index: int
    inputs: torch.Tensor | None
    kwargs: dict[str, Any]
    plan: dict[str, QuantScheme]
    arch: ArchSpec
    reducer: Reducer = field(default_factory=Reducer)  # data-parallel statistics (distributed.py)

    def relative_plan(self) -> dict[str, QuantScheme]:
        """The plan by name relative to the block (``mlp.up_proj``)."""
        return {n[len(self.name) + 1 :]: s for n, s in self.plan.items()}


@dataclass
class BlockOutput:
    """What a method returns for one block.

    results: a QuantResult per planned name. info: per-layer details merged into the report
    (a ``rel_mse`` there replaces the engine's measurement). next_inputs: the next block's
    inputs when the method computed them (GPTQ's single pass, AWQ's float block output); else
    the engine replays the block with the dequantized weights. state: tensors the method needs
    back for this block when a run resumes (journaled with the block, given to
    ``restore_block``).
    """

    results: dict[str, QuantResult]
    info: dict[str, dict] = field(default_factory=dict)
    next_inputs: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class FinishContext:
    """The whole model after the last block. logits(h): the final norm and head on hidden
    states [n, L, H] (None when the model lacks either or the head was not read); reducer: as
    in ``BlockContext``."""

    logits: Callable[[torch.Tensor], torch.Tensor] | None
    n_blocks: int
    reducer: Reducer = field(default_factory=Reducer)


@dataclass
class Finish:
    """A method's post-pass: results that replace earlier ones, and report details."""

    replace: dict[str, QuantResult] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)


class BlockMethod:
    """Base class of the methods the calibration engine runs.

    Declarations: ``needs_calibration`` (False: no data is captured or replayed, inputs are
    None); ``needs_smoothing`` (the method folds scales into smoothing pairs: a model without
    any is refused before calibrating); ``data_parallel`` (its statistics go through
    ``BlockContext.reducer``, so it runs under torchrun with the samples split across
    processes). ``options`` (the method's typed settings) and ``scale_dtype`` identify its
    behaviour (``describe``, the resume fingerprint).
    """

    needs_calibration: ClassVar[bool] = True
    needs_smoothing: ClassVar[bool] = False
    data_parallel: ClassVar[bool] = False

    def __init__(self, options: Any = None, scale_dtype: torch.dtype = torch.float16):
        self.options = options
        self.scale_dtype = scale_dtype

    def describe(self) -> str:
        """What identifies the method's behaviour: its class and its options."""
        return f"{type(self).__qualname__}({self.options!r}, {self.scale_dtype})"

    def process_block(self, ctx: BlockContext) -> BlockOutput:
        raise NotImplementedError

    def uses_model_head(self, plan: dict[str, QuantScheme]) -> bool:
        """Whether ``finish`` will need the model's logits for this plan (the streaming path
        then reads the output head up front)."""
        return False

    def restore_block(self, ctx: BlockContext, state: dict[str, torch.Tensor]) -> None:
        """A resumed run read block ``ctx.index`` back from its journal: ``state`` is what
        ``process_block`` put in ``BlockOutput.state`` for it."""

    def carry(self) -> dict[str, torch.Tensor]:
        """Tensors the method carries from block to block (journaled with the next inputs)."""
        return {}

    def restore_carry(self, state: dict[str, torch.Tensor]) -> None:
        """A resumed run continues with what ``carry`` returned after the last finished block."""

    def finish(self, ctx: FinishContext) -> Finish:
        """A post-pass over the whole model after the last block (default: none)."""
        return Finish()


class Smoother(BlockMethod):
    """A method that changes a block so that it quantizes better (folds scales) without
    rounding it: ``smooth`` returns per-layer report details. Composed with a rounding method
    (``compose.py``), or rounding the block itself in ``process_block``."""

    needs_smoothing: ClassVar[bool] = True

    def smooth(self, ctx: BlockContext) -> dict[str, dict]:
        raise NotImplementedError


def merge_info(*infos: dict[str, dict]) -> dict[str, dict]:
    """Per-layer report details of several steps, later ones winning on a shared key."""
    out: dict[str, dict] = {}
    for info in infos:
        for name, entry in info.items():
            out.setdefault(name, {}).update(entry)
    return out
