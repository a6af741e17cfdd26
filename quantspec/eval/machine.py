"""Describe the machine and the software versions a measurement ran on.

Every number quantspec reports carries this description, so that two results can be compared
only when they came from comparable machines.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo on Linux, else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the widest matrix instructions a CPU has, by their /proc/cpuinfo flag: they set a measurement's
# speed; whether bf16 products run in hardware (bf16 numbers can differ from emulated ones) is
# said beside them, by the flags of kernels.cpu_ext.NATIVE_BF16_FLAGS
MATRIX_ISA = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("bf16", "Arm BF16"),
              ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))


def cpu_matrix_isa(flags: str) -> str | None:
    """The first of ``MATRIX_ISA`` whose flag the CPU's flags line holds, with ", no native bf16"
    where the line names no native bf16 products (None: no known flag)."""
    from ..kernels.cpu_ext import has_native_bf16

    have = set(flags.split())
    name = next((name for flag, name in MATRIX_ISA if flag in have), None)
    return name if name is None or has_native_bf16(flags) else f"{name}, no native bf16"


def package_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages that change the numbers."""
    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "quantspec", "lm_eval", "triton", "accelerate"):
        out[name] = package_version(name.replace("_", "-")) or package_version(name)
    out["cuda"] = torch.version.cuda
    out["hip"] = getattr(torch.version, "hip", None)
    return out


def gpu_names() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def describe_machine() -> dict[str, Any]:
    """CPU model, core counts, memory, GPUs, torch threads and package versions."""
    import psutil
    import torch

    from ..kernels.cpu_ext import cpu_flags

    return {
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model(),
        "cpu_isa": cpu_matrix_isa(cpu_flags()),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpu_names(),
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line for tables and plot titles."""
    gpu = ", ".join(machine.get("gpus") or []) or "no GPU"
    cores = machine.get("cpu_affinity") or machine.get("cpu_cores_logical")
    about = ", ".join(x for x in (f"{cores} cores" if cores else "", machine.get("cpu_isa") or "") if x)
    return f"{machine.get('cpu')}{f' ({about})' if about else ''}, {gpu}"
