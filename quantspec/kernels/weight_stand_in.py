"""What a quantized Linear answers when model code reads its ``.weight``.

Model code reads a Linear's weight for its dtype or device (DeepSeek-V3.2's indexer:
``x.to(self.weights_proj.weight.dtype)``; HunYuan's router: ``self.wg.weight.dtype``). A
``QuantLinear`` holds no dense weight, so it answers with a stand-in: a zero-storage [N, K] tensor
(one element expanded) of the layer's compute dtype on its device, whose shape, dtype, device and
the like read as a Linear's would. Any computation with it raises a QuantspecError naming the
layer, never a silent result from values that are not the weights.
"""

from __future__ import annotations

import torch

from ..errors import QuantspecError

# what reading a weight's description may do (property getters and methods of no values)
_READS = {"dtype", "device", "shape", "ndim", "is_meta", "is_cuda", "is_cpu", "layout", "requires_grad",
          "is_floating_point", "is_complex", "size", "dim", "numel", "element_size", "is_quantized", "is_sparse",
          "stride", "is_contiguous", "__len__"}


def _name(func) -> str:
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:  # a property getter: ``__get__``
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


class WeightStandIn(torch.Tensor):
    """The ``.weight`` of a quantized Linear: describes the weight, holds none of it."""

    layer: str = "a quantized Linear"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _name(func) in _READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        layer = next((a.layer for a in args if isinstance(a, WeightStandIn)), cls.layer)
        raise QuantspecError(
            f"the model computed with {layer}.weight ({_name(func) or func}), but a quantized Linear holds "
            "no dense weight (reading its shape, dtype or device works).",
            f"keep {layer} dense: add it to the recipe's ignore list and quantize again.",
        )

    def __repr__(self, *args, **kwargs) -> str:
        return f"WeightStandIn({self.layer}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def weight_stand_in(layer: str, out_features: int, in_features: int, dtype: torch.dtype,
                    device: torch.device) -> WeightStandIn:
    t = torch.zeros(1, dtype=dtype, device=device).expand(out_features, in_features).as_subclass(WeightStandIn)
    t.layer = layer
    return t
