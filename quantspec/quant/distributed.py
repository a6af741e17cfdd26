"""Data-parallel calibration: ``torchrun --nproc-per-node N quantspec quantize ...``.

Each process holds the model and calibration samples ``tensor_split(ids, N)[rank]``: it runs
the blocks on its own samples and keeps its own activations. What a method computes from
statistics is reduced across processes before it is used, so every process quantizes from the
same numbers and the results agree: a GPTQ Hessian is the row-weighted mean of the processes'
Hessians (``Reducer.hessian``), a routed-token count the sum, SmoothQuant's per-channel max |x|
(and a static activation scale) the maximum. AWQ chooses its search and held-out sequences
among the global sequence indices (``Reducer.share``: where this process's rows lie among
every process's, in rank order), each process using the chosen ones it holds; its token samples
are cut so that the processes' samples, in rank order, make the one process's sample; mean |x|
is a reduced sum over a reduced count, and every loss that decides something (candidate scales,
clip error curves, the clip checks, the model-level KL) is a reduced sum of squared errors over
a reduced count (``sum_float``, ``mean``). Rank 0 writes the checkpoint (and AWQ's scales
file). NCCL (or RCCL on ROCm) on GPUs, gloo on CPUs.

Equality with one process: a Hessian (or a mean |x|, a loss) summed in another order differs in
its last bits, so a weight whose value lies on a rounding boundary may round the other way;
tests/test_distributed.py states the tolerances.

``Reducer`` (one process: every reduction is the identity, every share the whole) is what the
calibration engine hands to methods in ``BlockContext.reducer`` (and ``FinishContext.reducer``);
a method that reduces nothing refuses data parallelism (``BlockMethod.data_parallel`` False).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import QuantspecError


@dataclass(frozen=True)
class Share:
    """This process's part of rows that every process holds a part of, concatenated in rank
    order: rows [offset, offset + size) of ``total``. One process: the whole."""

    offset: int
    size: int
    total: int

    def local(self, indices: Iterable[int]) -> list[int]:
        """Those of ``indices`` (into all ``total`` rows) that lie in this part, as indices into
        it, in their order."""
        end = self.offset + self.size
        return [i - self.offset for i in indices if self.offset <= i < end]


@dataclass(frozen=True)
class Reducer:
    """One process: the reductions are identities."""

    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard(self, ids: torch.Tensor) -> torch.Tensor:
        """This process's calibration samples (rows of ``ids``)."""
        return ids

    def hessian(self, H: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        """(mean Hessian over every process's rows, total rows) from this process's."""
        return H, rows

    def sum_int(self, value: int) -> int:
        return value

    def sum_ints(self, values: list[int]) -> list[int]:
        return list(values)

    def all_true(self, flag: bool) -> bool:
        return flag

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of ``t`` over every process."""
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of ``t`` over every process."""
        return t

    def sum_float(self, value: float) -> float:
        """The sum of ``value`` over every process (in float64)."""
        return value

    def mean(self, t: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
        """(mean over every process's items, their number) from this process's mean ``t`` over
        its ``count`` items; a process with none adds nothing (its ``t`` may be NaN). Summed in
        float64, returned in ``t``'s dtype."""
        return t, count

    def sizes(self, count: int) -> list[int]:
        """Every process's ``count``, in rank order."""
        return [count]

    def share(self, count: int) -> Share:
        """Where this process's ``count`` rows lie among every process's rows (in rank order)."""
        sizes = self.sizes(count)
        return Share(sum(sizes[: self.rank]), count, sum(sizes))


@dataclass(frozen=True)
class ProcessGroupReducer(Reducer):
    """Reductions over the default torch.distributed process group."""

    def shard(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] < self.world:
            raise QuantspecError(
                f"{ids.shape[0]} calibration samples cannot be split across {self.world} processes.",
                f"use at least {self.world} samples (calibration samples), or fewer processes.",
            )
        return torch.tensor_split(ids, self.world)[self.rank]

    def hessian(self, H: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        import torch.distributed as dist

        total = self.sum_int(rows)
        weighted = H * rows  # H is a mean over this process's rows
        dist.all_reduce(weighted)
        return weighted / max(total, 1), total

    def sum_int(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return int(t.item())

    def sum_ints(self, values: list[int]) -> list[int]:
        import torch.distributed as dist

        if not values:
            return []
        t = torch.tensor(values, dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]

    def all_true(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def max(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return _all_reduced(t, dist.ReduceOp.MAX)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return _all_reduced(t, dist.ReduceOp.SUM)

    def sum_float(self, value: float) -> float:
        return float(self.sum(torch.tensor([value], dtype=torch.float64)).item())

    def mean(self, t: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
        total = self.sum_int(count)
        weighted = t.to(torch.float64) * count if count else torch.zeros_like(t, dtype=torch.float64)
        return (self.sum(weighted) / max(total, 1)).to(t.dtype), total

    def sizes(self, count: int) -> list[int]:
        mine = [0] * self.world
        mine[self.rank] = count
        return self.sum_ints(mine)


def _all_reduced(t: torch.Tensor, op) -> torch.Tensor:
    """A reduced copy of ``t`` (on its device; reduced where the backend works)."""
    import torch.distributed as dist

    where = t.device
    t = t.to(_device(), copy=True)
    dist.all_reduce(t, op=op)
    return t.to(where)


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def from_environment() -> Reducer:
    """A ProcessGroupReducer when launched by torchrun with WORLD_SIZE > 1 (the process group
    initialized here if needed: NCCL when a GPU is visible, else gloo), else ``Reducer()``."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Reducer()
    import torch.distributed as dist

    if not dist.is_initialized():
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if gpu else "gloo")
    return ProcessGroupReducer(dist.get_rank(), dist.get_world_size())


def local_device(reducer: Reducer, device: torch.device) -> torch.device:
    """This process's GPU under torchrun (LOCAL_RANK), else ``device``."""
    if reducer.active and device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device
