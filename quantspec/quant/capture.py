"""Capture of the decoder blocks' inputs for the block engine (``calibrate.py``).

Every block is swapped for a ``_Catcher`` that records its call (hidden states and keyword
arguments) and passes the hidden states on, so no block computes anything; only the modules
outside the blocks (embedding, rotary embedding) run, on the processing device.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

from ..errors import QuantspecError, one_line
from .arch import ArchSpec

# Keyword arguments that carry a KV cache: never replayed into a block.
_CACHE_KWARGS = ("past_key_value", "past_key_values", "cache", "layer_past")


class StopBlock(Exception):
    """Ends a forward early from a hook; caught by the function that raised it."""


class _Catcher(nn.Module):
    """Stands in for a decoder block while inputs are captured; passes hidden states on."""

    def __init__(self, block: nn.Module, index: int, store: dict, stop: bool, outputs: int = 1):
        super().__init__()
        self.block = block
        self.index = index
        self.store = store
        self.stop = stop
        self.outputs = outputs  # a loop that unpacks ``hidden, *rest = layer(...)`` gets a tuple this long

    def __getattr__(self, name: str):  # the model loop may read attributes of its blocks
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)

    def forward(self, hidden_states=None, *args, **kwargs):
        if args:  # GPT-2 passes cache and mask positionally: name them by the block's signature
            kwargs = {**self._named(args), **kwargs}
        if hidden_states is None:
            hidden_states = kwargs.pop("hidden_states")
        if self.index == 0:
            self.store.setdefault("hidden", []).append(hidden_states)
        self.store.setdefault("kwargs", {}).setdefault(self.index, kwargs)
        if self.stop:
            raise StopBlock
        return hidden_states if self.outputs == 1 else (hidden_states, *[None] * (self.outputs - 1))

    def _named(self, args: tuple) -> dict[str, Any]:
        params = [p for p in inspect.signature(self.block.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(params) - 1 or any(p.kind == p.POSITIONAL_ONLY for p in params[1:]):
            raise QuantspecError(
                "a decoder block was called with positional arguments its signature does not name.",
                "declare this architecture or call its blocks with keyword arguments.",
            )
        return {p.name: a for p, a in zip(params[1:], args)}


def _move_outside_blocks(model: nn.Module, arch: ArchSpec, device: torch.device) -> dict:
    """Move every direct parameter/buffer outside the blocks and lm_head to ``device``.

    Returns {(module, kind, key): original device} for ``_restore_outside``.
    """
    moved: dict = {}
    skip = (arch.blocks, arch.lm_head)
    for name, mod in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip if s):
            continue
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(mod, kind).items():
                if t is not None and t.device != device:
                    moved[(mod, kind, key)] = t.device
                    t.data = t.data.to(device)
    return moved


def _restore_outside(moved: dict) -> None:
    for (mod, kind, key), dev in moved.items():
        t = getattr(mod, kind)[key]
        t.data = t.data.to(dev)


def capture_inputs(
    model: nn.Module, arch: ArchSpec, calib_ids: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Hidden states entering block 0 ([n, L, H] on ``device``) and each block's kwargs.

    One forward per sample up to block 0 (the embedding only); sample 0 runs through all
    catchers so blocks whose kwargs differ (Gemma's sliding/full attention) get their own.
    """
    blocks = arch.block_list(model)
    originals = list(blocks)
    moved = _move_outside_blocks(model, arch, device)
    try:
        outputs = 1
        while True:
            store: dict = {}
            try:
                _capture(model, blocks, originals, store, calib_ids, device, outputs)
                break
            except ValueError as exc:  # the loop unpacked its blocks' outputs: hand it as many
                wanted = re.search(r"not enough values to unpack \(expected (\d+), got 1\)", str(exc))
                if outputs > 1 or wanted is None:
                    raise _refusal(model, exc) from exc
                outputs = int(wanted.group(1))
            except torch.OutOfMemoryError:
                raise
            except (TypeError, IndexError, AttributeError, RuntimeError) as exc:
                raise _refusal(model, exc) from exc
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
        _restore_outside(moved)
    kwargs = [_clean_kwargs(store["kwargs"][i]) for i in range(len(originals))]
    return torch.cat(store["hidden"], dim=0), kwargs


def _capture(model, blocks, originals, store, calib_ids, device, outputs: int) -> None:
    for j in range(calib_ids.shape[0]):
        for i, block in enumerate(originals):
            last = i == len(originals) - 1
            blocks[i] = _Catcher(block, i, store, stop=last if j == 0 else i == 0, outputs=outputs)
        try:
            model(input_ids=calib_ids[j : j + 1].to(device), use_cache=False)
        except StopBlock:
            pass


def _refusal(model: nn.Module, exc: Exception) -> QuantspecError:
    return QuantspecError(
        f"{type(model).__name__}'s forward failed with stand-ins for its decoder blocks "
        f"({type(exc).__name__}: {one_line(exc, 200)}): calibration passes each block's input on "
        "as its output, "
        "and this family's layer loop expects another return value from its blocks.",
        "quantize it with a data-free method (--method rtn), or declare its architecture "
        "(quantspec/quant/arch.py).",
    )


def _clean_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in kwargs.items() if k not in _CACHE_KWARGS}
    if "use_cache" in out:
        out["use_cache"] = False
    return out
