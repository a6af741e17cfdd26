"""QuantLinear: a Linear whose weight is stored in a checkpoint format and run by a backend.

Built on any device (the meta device included) with the format's tensors as buffers, so that
``state_dict()`` has exactly the checkpoint's names. ``prepare()`` unpacks them once to the
canonical ``QuantResult`` and hands it to the chosen backend, whose layout is kept in
non-persistent buffers (they move with ``.to()`` but are not saved). A backend that offers
``bind`` gets every per-layer decision made once, at ``prepare``: each call then costs one
dispatcher op (decode runs hundreds of small linears per token, where Python overhead per call
is as large as the kernel).

Casts (``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``) change the compute dtype:
the bias and ``compute_dtype`` follow them; the format's tensors and the prepared layout are
data and keep their dtypes (they still follow device moves), see ``QuantLinear._apply``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import QuantspecError
from ..formats import get_format
from ..core.scheme import QuantResult, QuantScheme
from .backend import choose_backend, get_backend
from .weight_stand_in import weight_stand_in


def _move_only(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` when ``fn`` keeps ``t``'s dtype (a device move, ``share_memory_``,
    ``to_empty``); else ``t`` moved to the device ``fn`` targets, its dtype and bytes kept."""
    probe = fn(t.new_empty(0))  # what fn does, learnt on an empty tensor: no copy of t
    return fn(t) if probe.dtype == t.dtype else t.to(probe.device)


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        fmt: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.fmt = fmt
        self.compute_dtype = dtype
        specs = get_format(fmt).tensor_specs(scheme, out_features, in_features)
        for name, (shape, tdtype) in specs.items():
            self.register_buffer(name, torch.empty(shape, dtype=tdtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self._backend = None
        self.backend_name: str | None = None
        self.backend_reason: str = ""
        self._prepared_names: list[str] = []
        self._prepared_cache: dict[str, torch.Tensor] | None = None
        self._runner = None
        self.layer_name = ""  # its name in the model (load_quantized sets it), for error messages
        self._released_backend: str | None = None  # what release_prepared() dropped

    def format_names(self) -> list[str]:
        return list(get_format(self.fmt).tensor_specs(self.scheme, self.out_features, self.in_features))

    def format_tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.format_names()}

    def quant_result(self) -> QuantResult:
        return get_format(self.fmt).unpack(
            self.format_tensors(), self.scheme, self.out_features, self.in_features
        )

    @classmethod
    def from_result(
        cls, result: QuantResult, fmt: str, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> "QuantLinear":
        n, k = result.shape
        mod = cls(k, n, bias is not None, result.scheme, fmt, device="meta", dtype=dtype)
        for name, t in get_format(fmt).pack(result).items():
            setattr(mod, name, t)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        return mod

    def prepare(self, backend: str = "auto") -> str:
        """Repack for a backend (chosen for this device and dtype unless named). Returns its name."""
        device = next(iter(self.format_tensors().values())).device
        chosen, why = choose_backend(
            self.scheme, self.out_features, self.in_features, device, self.compute_dtype, backend
        )
        self._drop_layout()
        prepared = chosen.prepare(self.quant_result(), self.compute_dtype)
        for name, t in prepared.items():
            attr = f"_p_{name}"
            self.register_buffer(attr, t, persistent=False)
            self._prepared_names.append(attr)
        from .custom_ops import register_ops

        register_ops()  # eagerly, so a model compiled later finds the op registered
        self._backend = chosen
        self.backend_name = chosen.name
        self.backend_reason = why
        bind = getattr(chosen, "bind", None)
        self._runner = bind(prepared, self.scheme, self.out_features, self.in_features) if bind else None
        return chosen.name

    def bound(self) -> tuple[object | None, dict[str, torch.Tensor]]:
        """(the backend's bound op, its prepared tensors): what ``forward`` calls, preparing the
        layer first as ``forward`` does; the op is None where the backend binds none."""
        if self.backend_name is None:
            self.prepare(self._released_backend or "auto")
        return self._runner, self.prepared()

    def release_prepared(self) -> None:
        """Drop the backend's layout (the next forward prepares it again), e.g. once a fused
        copy serves this layer (``kernels.siblings``): the format tensors stay."""
        self._drop_layout()
        self._runner = None
        self._backend = None
        self._released_backend, self.backend_name = self.backend_name, None

    def _drop_layout(self) -> None:
        for name in self._prepared_names:
            delattr(self, name)
        self._prepared_names = []
        self._prepared_cache = None

    def prepared(self) -> dict[str, torch.Tensor]:
        if torch.compiler.is_compiling():  # the module's buffers, as torch.compile tracks them
            return {n[3:]: getattr(self, n) for n in self._prepared_names}
        if self._prepared_cache is None:
            self._prepared_cache = {n[3:]: getattr(self, n) for n in self._prepared_names}
        return self._prepared_cache

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()``... call this with ``fn`` for every tensor.

        The bias follows ``fn`` and ``compute_dtype`` becomes the dtype ``fn`` gives a float
        tensor; the format's tensors and the backend's prepared layout are packed data (fp16
        scales, byte layouts that the kernels check): they follow device moves but keep their
        dtypes, so ``state_dict()`` still holds the checkpoint's bytes and the layout still fits
        its backend. A compute dtype that the layer's backend cannot run is refused here, before
        this layer changes.
        """
        device = next(iter(self.format_tensors().values())).device
        dtype = fn(torch.empty(0, dtype=self.compute_dtype, device=device)).dtype
        if dtype != self.compute_dtype:
            self._check_compute_dtype(dtype, device)
        packed = {id(t) for t in self.format_tensors().values()}
        packed |= {id(getattr(self, n)) for n in self._prepared_names}
        super()._apply(lambda t: _move_only(fn, t) if id(t) in packed else fn(t), recurse)
        self._prepared_cache = None  # the buffers were replaced: forget the cached dict of them
        self.compute_dtype = dtype
        return self

    def _check_compute_dtype(self, dtype: torch.dtype, device: torch.device) -> None:
        """QuantspecError when this layer cannot compute in ``dtype`` (the cast is refused)."""
        name = self.backend_name or self._released_backend
        if not dtype.is_floating_point:
            reason = "activations must be floating point"
        elif name is None:  # not prepared yet: the first forward chooses for the new dtype
            return
        else:
            reason = get_backend(name).cannot_run(
                self.scheme, self.out_features, self.in_features, device, dtype
            )
        if reason:
            raise QuantspecError(
                f"cannot cast the quantized layer {self.out_features}x{self.in_features} "
                f"({name or 'unprepared'} backend) to {dtype}: {reason}; the model may be partly cast.",
                "reload it and cast to a dtype that backend runs (fp32, bf16 or fp16), or load "
                "with backend='reference', which runs every dtype.",
            )

    def __getattr__(self, name: str):
        """nn.Module's lookup (parameters, buffers, submodules); then, where the format has no tensor
        called ``weight``, a stand-in for model code that reads the weight's shape, dtype (the
        compute dtype) or device; computing with it raises (``weight_stand_in.py``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight" or "fmt" not in self.__dict__ or "weight" in self.format_names():
                raise
        device = next((b.device for b in self._buffers.values() if b is not None), torch.device("cpu"))
        layer = self.layer_name or f"a {self.out_features}x{self.in_features} quantized Linear"
        return weight_stand_in(layer, self.out_features, self.in_features, self.compute_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend_name is None:
            self.prepare(self._released_backend or "auto")
        if self._runner is not None:  # eager and compiled alike: one dispatcher op
            return self._runner(x, self.prepared(), self.bias)
        if torch.compiler.is_compiling():
            # torch.compile sees one opaque custom op per layer (no graph break); eager calls
            # the backend directly and skips the dispatcher's per-call overhead.
            from .custom_ops import quant_linear

            return quant_linear(
                x, self.prepared(), self.backend_name, self.scheme,
                self.out_features, self.in_features, self.bias,
            )
        return self._backend.linear(
            x, self.prepared(), self.scheme, self.out_features, self.in_features, self.bias
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme.short_name}, format={self.fmt}, backend={self.backend_name}"
        )
