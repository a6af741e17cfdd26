"""AWQ's model-level clip check: after the per-pair and per-block checks, a block's kept clips
are judged once more on the whole model. Held-out calibration sequences run through every block
three times (float, quantized without clips, quantized with the kept clips); after the last
block, the clips are kept model-wide only if they bring the next-token distribution closer (KL)
to the float model's. Block-local errors do not add up to the model's (see
docs/decisions/awq-defaults.md). Under data-parallel calibration each process streams the
held-out sequences it holds, and the KL sums and token counts are reduced.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch
from torch import nn

from ..block_ops import block_forward
from ...core.scheme import QuantScheme
from ..distributed import Reducer
from .objective import fake_quantized


@torch.no_grad()
def mean_kl(logits: Callable[[torch.Tensor], torch.Tensor], ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(logits(ref)) || softmax(logits(other))), hidden states
    [n, L, H] each, 256 tokens at a time (the logits of a large vocabulary are big)."""
    total, count = kl_sum(logits, ref, other)
    return total / max(count, 1)


@torch.no_grad()
def kl_sum(logits: Callable[[torch.Tensor], torch.Tensor], ref: torch.Tensor, other: torch.Tensor) -> tuple[float, int]:
    """``mean_kl``'s (sum over tokens, number of tokens)."""
    total, count = 0.0, 0
    a_all, b_all = ref.reshape(-1, 1, ref.shape[-1]), other.reshape(-1, 1, other.shape[-1])
    for a, b in zip(a_all.split(256), b_all.split(256)):
        lp = torch.log_softmax(logits(a.transpose(0, 1)).float(), dim=-1)
        lq = torch.log_softmax(logits(b.transpose(0, 1)).float(), dim=-1)
        total += float((lp.exp() * (lp - lq)).sum())
        count += a.shape[0]
    return total, count


def reduced_mean_kl(logits: Callable[[torch.Tensor], torch.Tensor], ref: torch.Tensor, other: torch.Tensor,
                    reducer: Reducer) -> float:
    """``mean_kl`` over every process's tokens (``ref``, ``other``: this process's)."""
    total, count = kl_sum(logits, ref, other)
    return reducer.sum_float(total) / max(reducer.sum_int(count), 1)



class ModelClipCheck:
    """The three streams of held-out sequences, advanced block by block (``advance``), and the
    decision after the last block (``decide``). ``carry``/``restore`` for resumed runs."""

    def __init__(self) -> None:
        self.streams: dict[str, torch.Tensor] | None = None
        self.blocks, self.seconds = 0, 0.0
        self.clipped: list[str] = []  # full names of the Linears with kept clips

    @property
    def started(self) -> bool:
        return self.streams is not None

    @torch.no_grad()
    def advance(self, block: nn.Module, block_name: str, held: torch.Tensor, kwargs: dict[str, Any],
                rel: dict[str, QuantScheme], clips: dict[str, torch.Tensor], precision,
                float_out: torch.Tensor | None) -> None:
        """Run the streams through ``block``: float, quantized without clips, and quantized with
        this block's kept ``clips`` (by full name); ``held``: the held-out rows of the block's
        inputs (the streams start there at the first block); ``float_out``: the float block's
        output on them when the caller has it."""
        t0 = time.perf_counter()
        if self.streams is None:
            self.streams = {k: held for k in ("float", "plain", "clipped")}
        if float_out is not None:
            new = {"float": float_out}
        else:
            with precision():
                new = {"float": block_forward(block, self.streams["float"], kwargs)}
        with fake_quantized(block, rel) as use:
            for tag, chosen in (("plain", {}), ("clipped", {f[len(block_name) + 1 :]: c for f, c in clips.items()})):
                use(chosen)
                with precision():
                    new[tag] = block_forward(block, self.streams[tag], kwargs)
        self.streams = {k: v.to(self.streams[k].dtype) for k, v in new.items()}
        self.blocks += 1
        self.clipped += list(clips)
        self.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def decide(self, logits: Callable[[torch.Tensor], torch.Tensor], n_blocks: int,
               reducer: Reducer | None = None) -> tuple[bool, dict[str, dict]]:
        """(drop the clips?, per-layer report details): drop when the quantized model without
        clips is closer to the float model (mean next-token KL on the held-out sequences) than
        with them; no decision (False, {}) when the streams did not cover every block.
        ``reducer``: the streams hold this process's held-out sequences; the KLs are over
        every process's."""
        if self.streams is None or self.blocks != n_blocks or not self.clipped:
            return False, {}
        reducer = reducer or Reducer()
        t0, s = time.perf_counter(), self.streams
        kl_clip = reduced_mean_kl(logits, s["float"], s["clipped"], reducer)
        kl_plain = reduced_mean_kl(logits, s["float"], s["plain"], reducer)
        drop = kl_plain < kl_clip
        seconds = round(self.seconds + time.perf_counter() - t0, 3)
        check = {"kl_clipped": kl_clip, "kl_unclipped": kl_plain, "kept": not drop, "seconds": seconds}
        return drop, {n: {"clip_model_check": check, "clipped": not drop} for n in self.clipped}

    def carry(self) -> dict[str, torch.Tensor]:
        if self.streams is None:
            return {}
        names = torch.frombuffer(bytearray(json.dumps(self.clipped).encode()), dtype=torch.uint8)
        return {**{f"stream.{k}": v for k, v in self.streams.items()},
                "streamed_blocks": torch.tensor([self.blocks]), "clipped_names": names}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        streams = {k[len("stream.") :]: v for k, v in state.items() if k.startswith("stream.")}
        if not streams:
            return
        self.streams = streams
        self.blocks = int(state["streamed_blocks"][0])
        self.clipped = json.loads(bytes(state["clipped_names"].tolist()).decode())
