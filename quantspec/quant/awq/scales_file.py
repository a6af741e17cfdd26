"""AWQ's scales file (``awq.save_scales`` / ``awq.load_scales``): the searched scales and clips,
reused by a later run instead of searching again.

safetensors; tensors ``<block>.<prev>.scales`` fp32 [K] and ``<block>.<linear>.clip`` fp32
[N, G]; metadata ``quantspec_awq`` = JSON ``{"version", "recipe": {...}, "blocks": {block:
sha256 of every byte of the float block's parameters (``digest.module_digest``)}}``. Loading
checks the version, the recipe and each block's fingerprint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ...errors import QuantspecError

SCALES_VERSION = 2  # 2: block fingerprints over every byte (1 sampled rows)


class ScalesFile:
    """Reads (once, lazily) and checks a scales file made with ``recipe`` (a fingerprint dict)."""

    def __init__(self, path: str | os.PathLike, recipe: dict):
        self.path, self.recipe = Path(path), recipe
        self._loaded: tuple[dict[str, torch.Tensor], dict] | None = None

    def read(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, metadata), after checking the version and the recipe."""
        if self._loaded is None:
            from safetensors import safe_open

            path = self.path
            if not path.is_file():
                raise QuantspecError(f"AWQ scales file {path} does not exist.", "check --load-scales.")
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("quantspec_awq", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if meta.get("version") != SCALES_VERSION:
                raise QuantspecError(
                    f"AWQ scales file {path} was written by another version of quantspec "
                    f"(format {meta.get('version')}, not {SCALES_VERSION}).",
                    "drop --load-scales to search again, and --save-scales to write a new file.",
                )
            if meta.get("recipe") != self.recipe:
                raise QuantspecError(
                    f"AWQ scales file {path} was made with another recipe "
                    f"({meta.get('recipe')}, not {self.recipe}).",
                    "drop --load-scales to search again, or use the recipe it was made with.",
                )
            self._loaded = (tensors, meta)
        return self._loaded

    def has_clips(self) -> bool:
        return any(k.endswith(".clip") for k in self.read()[0])

    def block(self, block_name: str, fingerprint: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """({prev name: scale}, {Linear name: clip}) of one block (full names), after checking
        that the block is the one they were searched on."""
        tensors, meta = self.read()
        if meta.get("blocks", {}).get(block_name) != fingerprint:
            raise QuantspecError(
                f"AWQ scales file has no scales for block {block_name} of this model "
                "(its float weights differ from those the scales were searched on).",
                "drop --load-scales to search again, or quantize the model they were made for.",
            )
        inside = {k: v for k, v in tensors.items() if k.startswith(block_name + ".")}
        scales = {k[: -len(".scales")]: v for k, v in inside.items() if k.endswith(".scales")}
        clips = {k[: -len(".clip")]: v for k, v in inside.items() if k.endswith(".clip")}
        return scales, clips


def write_scales(path: str | os.PathLike, tensors: dict[str, torch.Tensor], recipe: dict,
                 blocks: dict[str, str]) -> None:
    """Write (atomically) the scales and clips found so far, with the recipe and block
    fingerprints they belong to."""
    from ...checkpoint.atomic import atomic_save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"version": SCALES_VERSION, "recipe": recipe, "blocks": blocks}
    atomic_save_file({k: v.contiguous() for k, v in tensors.items()}, path, {"quantspec_awq": json.dumps(meta)})
