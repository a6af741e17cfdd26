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

    return {
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model(),
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
    return f"{machine.get('cpu')}{f' ({cores} cores)' if cores else ''}, {gpu}"
