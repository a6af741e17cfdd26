"""Exact fingerprints of weights: sha256 over every byte of every tensor, with its name, dtype
and shape, so that one changed element anywhere changes the digest.

The resume journal (``resume.py``) and AWQ's scales file (``awq.py``) record these to refuse
state that was computed on other weights (e.g. a fine-tune with the same config). sha256 runs
in hardware on current x86 and ARM CPUs (SHA-NI, ARMv8 SHA2): a SmolLM2-135M block (14 MB in
fp32) hashes in milliseconds.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch
from torch import nn


def update_tensor(h: Any, t: torch.Tensor) -> None:
    """Feed ``t``'s dtype, shape and raw bytes (every element) into ``h`` (a hashlib object)."""
    if t.is_meta:
        raise ValueError("a tensor on the meta device has no bytes to hash")
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy())


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 hex of named tensors, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode() + b"\0")
        update_tensor(h, t)
    return h.hexdigest()


def module_digest(module: nn.Module) -> str:
    """sha256 hex of every tensor of ``module``'s state dict (parameters and persistent buffers)."""
    return tensors_digest(module.state_dict().items())
