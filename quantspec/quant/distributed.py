"""Data-parallel calibration: ``torchrun --nproc-per-node N quantspec quantize ...``.

Each process holds the model and calibration samples ``tensor_split(ids, N)[rank]``: it runs
the blocks on its own samples and keeps its own activations. What a method computes from
statistics is reduced across processes before it is used, so every process quantizes from the
same numbers and the results agree: a GPTQ Hessian is the row-weighted mean of the processes'
Hessians (``Reducer.hessian``), a routed-token count the sum, SmoothQuant's per-channel max |x|
(and a static activation scale) the maximum. Rank 0 writes the checkpoint.
NCCL (or RCCL on ROCm) on GPUs, gloo on CPUs.

Equality with one process: a Hessian summed in another order differs in its last bits, so a
weight whose value lies on a rounding boundary may round the other way; tests/test_distributed.py
states the tolerance.

``Reducer`` (one process: every reduction is the identity) is what the calibration engine hands
to methods in ``BlockContext.reducer``; a method that reduces nothing refuses data parallelism
(``BlockMethod.data_parallel`` False).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import QuantspecError


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

        where = t.device
        t = t.to(_device()).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
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
