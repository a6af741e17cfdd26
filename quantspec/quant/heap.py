"""Keep freed memory in the process heap while a calibration run reuses large buffers.

glibc serves every allocation above its mmap threshold (at most 32 MiB by default) with a fresh
``mmap`` and unmaps it on free, so a block forward over the whole calibration set (tensors of
hundreds of MB) page-faults and zero-fills all of its memory on every call: measured here, that
made a batched SmolLM2 block forward 1.8x slower than the same work sample by sample.
``reuse_freed_memory()`` raises the mmap and trim thresholds for the duration of a run (so freed
blocks are reused), then sets them where glibc's own rule would have taken them in a process that
has freed large buffers, and returns the heap's free memory to the system. Elsewhere than glibc it
does nothing.

Why not glibc's defaults on exit: glibc raises its mmap threshold by itself (up to 32 MiB, the
trim threshold to twice that) each time a mapped block is freed, but any ``mallopt`` of either
threshold turns that rule off for the rest of the process. Restoring the 128 KiB defaults left
every later buffer above 128 KiB a fresh mmap: a KV-cache calibration run after quantize's block
run took 53 s instead of 33 s (SmolLM2-135M, 32 samples).

``trims_each_block`` decides whether the streaming path also returns it after every block.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

from ..errors import QuantspecError

# mallopt parameters (malloc.h); glibc's dynamic mmap threshold's ceiling on 64-bit
# (DEFAULT_MMAP_THRESHOLD_MAX) and the trim threshold it sets beside it.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_AFTER_MMAP = 32 * 1024 * 1024
_AFTER_TRIM = 2 * _AFTER_MMAP
_RUN_THRESHOLD = 1 << 30


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextlib.contextmanager
def reuse_freed_memory() -> Iterator[None]:
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _RUN_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _RUN_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _AFTER_MMAP)
        libc.mallopt(_M_TRIM_THRESHOLD, _AFTER_TRIM)
        libc.malloc_trim(0)


def release_heap() -> None:
    """Return the heap's free memory to the system now (glibc ``malloc_trim``; elsewhere a
    no-op)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


TRIM_ENV = "QUANTSPEC_TRIM_HEAP"
TRIM_MODES = ("auto", "always", "never")


def trims_each_block(model_bytes: int, available_bytes: int | None, mode: str = "auto") -> bool:
    """Whether streaming returns the freed heap to the system after every block.

    Without it, glibc keeps the freed pages of processed blocks (fragmentation across blocks): on
    12- and 40-block test models the resident size grew by a third to two thirds of a block per
    block, up to about the model's size. With it, the next block page-faults its calibration
    buffers in again, which made SmolLM2-135M GPTQ 9% slower than before the quantize-core
    redesign (benchmarks/results/quant-cost-gptq.md). So ``auto`` trims only where the kept pages
    matter: a model (fp32 bytes) above a quarter of the memory available when the run starts, or
    where that is unknown. ``always`` / ``never`` force it (``QUANTSPEC_TRIM_HEAP``)."""
    if mode not in TRIM_MODES:
        raise QuantspecError(f"{TRIM_ENV}={mode!r} is not a heap policy.", f"use one of {', '.join(TRIM_MODES)}.")
    if mode != "auto":
        return mode == "always"
    return available_bytes is None or model_bytes > available_bytes / 4


def available_memory_bytes() -> int | None:
    """The memory the system can give without swapping (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            line = next((x for x in f if x.startswith("MemAvailable:")), None)
    except OSError:
        return None
    return int(line.split()[1]) * 1024 if line else None


def free_memory_bytes(device) -> int | None:
    """Bytes free on ``device`` (a torch.device) now: CUDA/ROCm's free memory, the host's
    available memory for the CPU; None where it cannot be asked."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        return available_memory_bytes()
    return None
