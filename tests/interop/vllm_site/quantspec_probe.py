"""Layer probe inside vLLM's worker (see tests/interop/probe.py): ``LLM.apply_model`` calls
``install`` on the loaded model in every worker; the hook saves the input and output of block
0's fused q/k/v projection for the forward whose token count is ``rows`` (a prompt not seen
before, so no prefix-cache hit shortens it)."""

import torch

SUFFIX = "layers.0.self_attn.qkv_proj"


def install(model, path: str, rows: int) -> str:
    names = [n for n, _ in model.named_modules() if n.endswith(SUFFIX)]
    if not names:
        return f"no module named *{SUFFIX}"
    module = model.get_submodule(names[0])

    def hook(mod, inp, out):
        x = inp[0]
        if x.shape[0] == rows:
            y = out[0] if isinstance(out, tuple) else out
            torch.save({"x": x.detach().cpu().clone(), "y": y.detach().cpu().clone(), "module": names[0]}, path)

    module.register_forward_hook(hook)
    return f"{names[0]}: {describe(module)}"


def describe(module) -> str:
    """Which of vLLM's code paths computes ``module``: its quant method, scheme and kernel."""
    parts = [type(getattr(module, "quant_method", None)).__name__]
    scheme = getattr(module, "scheme", None)
    if scheme is not None:
        parts.append(type(scheme).__name__)
        kernel = getattr(scheme, "kernel", None)
        if kernel is not None:
            parts.append(type(kernel).__name__)
    kernel = getattr(getattr(module, "quant_method", None), "kernel", None)
    if kernel is not None:
        parts.append(type(kernel).__name__)
    return " / ".join(parts)


def kv_scales(model) -> dict:
    """{attention layer: {"k_scale", "v_scale": the floats its kernels use, "kv_cache_dtype": the
    cache dtype it resolved (vLLM turns "auto" into "fp8" for a checkpoint's kv_cache_scheme)}}."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "_k_scale_float") and hasattr(module, "_v_scale_float"):
            out[name] = {"k_scale": float(module._k_scale_float), "v_scale": float(module._v_scale_float),
                         "kv_cache_dtype": str(getattr(module, "kv_cache_dtype", None)),
                         # the scale tensors as loaded (one value, or one per KV head)
                         "k_scales": [float(v) for v in getattr(module, "_k_scale", torch.zeros(0)).flatten()],
                         "v_scales": [float(v) for v in getattr(module, "_v_scale", torch.zeros(0)).flatten()]}
    return out
