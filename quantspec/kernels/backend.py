"""The contract of a kernel backend, and the choice of one for a layer.

A backend declares what it supports (``cannot_run`` gives the reason it cannot), repacks a
layer's canonical ``QuantResult`` once at load into the layout it wants (``prepare``), and
computes ``y = x @ W.T + bias`` from that layout (``linear``).

Choosing (``choose_backend``): ``auto`` takes the fastest backend that can run a layer;
``exact`` the fastest that also computes the scheme the checkpoint declares, activations
included. They differ where a backend rounds more than the scheme says: the ``cpu`` backend
rounds the activations of weight-only (A16) layers (int8 blocks in its C++ extension, bf16 in
torch's fallback ops; see ``kernels/cpu.py``), a speed trade that moves a W4A16 perplexity by
up to about 1%. So accuracy is measured with ``exact`` (the
default of ``quantspec eval``, the lm-eval adapter and sweeps) and speed with ``auto``.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from ..errors import QuantspecError
from ..core.scheme import QuantResult, QuantScheme


class Backend(Protocol):
    name: str

    def cannot_run(
        self,
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> str | None:
        """None when this backend can run such a layer here, else the reason it cannot."""

    def prepare(self, result: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Repack once at load; the returned tensors are kept as non-persistent buffers.

        The layout must serve every activation dtype that ``cannot_run`` accepts: a cast of the
        module (``.to(torch.bfloat16)``) keeps it, bytes and dtypes (``QuantLinear._apply``)."""

    def linear(
        self,
        x: torch.Tensor,
        prepared: dict[str, torch.Tensor],
        scheme: QuantScheme,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` [..., K] -> [..., N] in ``x.dtype``."""

    # Optional: ``bind(prepared, scheme, out_features, in_features)`` returns None or a function
    # ``run(x, prepared, bias)`` equal to ``linear`` with every per-layer decision taken once;
    # it calls only dispatcher ops (each with a fake kernel), so torch.compile traces it.


@functools.lru_cache(maxsize=None)
def _registry() -> dict[str, Backend]:
    """Backends in order of preference (fastest first); imported lazily on first use.

    The order follows the measured tables: on CPU ours (``cpu``) is 1.3x / 3.4x faster than
    torch's int4 op (``tinygemm``) at M = 1 / 16 (benchmarks/results/cpu-kernels-epyc.md).
    The GPU peers (``marlin``, ``gemlite``, ``tinygemm`` on CUDA) come after ``triton`` until a
    GPU run of ``benchmarks/kernel_speed.py --peers`` measures them faster; each is
    selectable by name. They are registered even where they cannot run, so that ``cannot_run``
    (shown by ``quantspec inspect``) says why: their libraries load only when a layer asks.
    Backends are stateless, so one instance of each serves every layer."""
    from .gemlite_backend import GemliteBackend
    from .marlin import MarlinBackend
    from .reference import ReferenceBackend
    from .tinygemm import TinygemmBackend

    backends: dict[str, Backend] = {}
    try:
        from .triton_backend import TritonBackend

        backends["triton"] = TritonBackend()
    except ImportError:
        pass
    try:
        from .cpu import CpuBackend

        backends["cpu"] = CpuBackend()
    except ImportError:
        pass
    backends["marlin"] = MarlinBackend()
    backends["gemlite"] = GemliteBackend()
    backends["tinygemm"] = TinygemmBackend()
    backends["reference"] = ReferenceBackend()
    return backends


# Backends that round the activations of weight-only (A16) layers, or their scales (kernels/cpu.py:
# int8 blocks, or bf16 in torch's fallback ops; tinygemm.py, gemlite_backend.py, marlin.py: scales
# or zeros in the activation dtype): fast, but not the scheme the checkpoint declares. W8A8
# layers declare int8 per-token activations, which these backends compute exactly.
ROUNDS_A16_ACTIVATIONS = frozenset({"cpu", "tinygemm", "gemlite", "marlin"})


def computes_declared_scheme(backend_name: str, scheme: QuantScheme) -> bool:
    """Whether ``backend_name`` runs a ``scheme`` layer on the activations the scheme declares
    (16-bit or fp32 for weight-only schemes, int8 per token for W8A8)."""
    # float weights run on fp32 activations everywhere (cpu: csrc/cpu_fgemv.cpp)
    return scheme.activations is not None or scheme.is_float or backend_name not in ROUNDS_A16_ACTIVATIONS


def available_backends() -> list[str]:
    return list(_registry())


def get_backend(name: str) -> Backend:
    reg = _registry()
    if name not in reg:
        raise QuantspecError(
            f"unknown kernel backend {name!r}.", f"use one of {sorted(reg)}, 'auto' or 'exact'."
        )
    return reg[name]


def choose_backend(
    scheme: QuantScheme,
    out_features: int,
    in_features: int,
    device: torch.device,
    dtype: torch.dtype,
    requested: str = "auto",
) -> tuple[Backend, str]:
    """The backend for one layer and why: the requested one, or the first that can run it
    (``auto``), or the first that can run it on the activations its scheme declares (``exact``)."""
    if requested not in ("auto", "exact"):
        backend = get_backend(requested)
        reason = backend.cannot_run(scheme, out_features, in_features, device, dtype)
        if reason:
            raise QuantspecError(
                f"backend {requested!r} cannot run a {out_features}x{in_features} "
                f"{scheme.short_name} layer on {device}: {reason}.",
                "use --backend auto or exact (or 'reference', which runs everything).",
            )
        return backend, "requested"
    skipped = []
    for name, backend in _registry().items():
        reason = backend.cannot_run(scheme, out_features, in_features, device, dtype)
        if reason is None and requested == "exact" and not computes_declared_scheme(name, scheme):
            reason = "rounds the activations, not the declared scheme"
        if reason is None:
            return backend, ("fastest available" if not skipped else "; ".join(skipped))
        skipped.append(f"{name}: {reason}")
    raise RuntimeError("the reference backend refused a layer")  # reference runs everything


def backend_reasons(
    scheme: QuantScheme, out_features: int, in_features: int, device: torch.device, dtype: torch.dtype,
) -> dict[str, str | None]:
    """Every registered backend, in order of preference, with the reason it cannot run such a
    layer here (None: it can)."""
    return {name: b.cannot_run(scheme, out_features, in_features, device, dtype) for name, b in _registry().items()}

