"""Composition as data: a smoothing step then a rounding step, as one BlockMethod.

``awq+gptq`` (AWQ's scales, then GPTQ on the scaled block), ``smoothquant`` (SmoothQuant's
scales, then RTN) and ``smoothquant+gptq`` are the same mechanism: the registry
(``registry.py``) lists each composed method's steps.
"""

from __future__ import annotations

import torch

from .method import BlockContext, BlockMethod, BlockOutput, Finish, FinishContext, Smoother, merge_info
from ..core.scheme import QuantScheme


class Composed(BlockMethod):
    """``smoother.smooth`` then ``rounder.process_block`` on every block: the rounder's results
    and next inputs, both steps' report details."""

    needs_smoothing = True

    def __init__(self, smoother: Smoother, rounder: BlockMethod):
        super().__init__((smoother.options, rounder.options), rounder.scale_dtype)
        self.smoother, self.rounder = smoother, rounder
        self.needs_calibration = smoother.needs_calibration or rounder.needs_calibration  # type: ignore[misc]
        self.data_parallel = smoother.data_parallel and rounder.data_parallel  # type: ignore[misc]

    def describe(self) -> str:
        return f"Composed({self.smoother.describe()}, {self.rounder.describe()})"

    def process_block(self, ctx: BlockContext) -> BlockOutput:
        smoothed = self.smoother.smooth(ctx)
        out = self.rounder.process_block(ctx)
        out.info = merge_info(smoothed, out.info)
        return out

    def uses_model_head(self, plan: dict[str, QuantScheme]) -> bool:
        return self.smoother.uses_model_head(plan) or self.rounder.uses_model_head(plan)

    def restore_block(self, ctx: BlockContext, state: dict[str, torch.Tensor]) -> None:
        self.rounder.restore_block(ctx, state)

    def carry(self) -> dict[str, torch.Tensor]:
        return self.rounder.carry()

    def restore_carry(self, state: dict[str, torch.Tensor]) -> None:
        self.rounder.restore_carry(state)

    def finish(self, ctx: FinishContext) -> Finish:
        return self.rounder.finish(ctx)
