"""Load a quantized checkpoint as a transformers model whose quantized Linears are QuantLinear.

The model is built on the meta device (parameters only; buffers such as rotary frequencies stay
real), the Linears that the checkpoint stores quantized are swapped for QuantLinear modules,
and the checkpoint's tensors are assigned in place: no dense copy of the model is materialised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..core.floatcodes import require_float8
from ..errors import QuantspecError
from ..formats.overrides import read_with_overrides
from ..kernels.quant_linear import QuantLinear
from ..models import resolve_device, resolve_dtype
from ..models.conv1d import conv1d_shape, is_conv1d
from ..models.experts import key_map, linearize_experts
from .checksums import verify_manifest
from .reader import CheckpointReader


def read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not path.exists():
        raise QuantspecError(f"{path} does not exist.", "check the path of the checkpoint folder.")
    if not cfg_path.is_file():
        raise QuantspecError(
            f"{path} has no config.json.", "point to a checkpoint folder written by `quantspec quantize`."
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantspecError(f"{cfg_path} is not valid JSON ({exc}).", "rewrite the checkpoint.") from exc
    if not isinstance(cfg, dict):
        raise QuantspecError(f"{cfg_path} is not a JSON object.", "rewrite the checkpoint.")
    return cfg


def is_quantized_folder(path: str | Path) -> bool:
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        return "quantization_config" in json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _empty_model(cfg: dict, dtype: torch.dtype) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    model_type = plain.get("model_type")
    if not model_type:
        raise QuantspecError("config.json has no model_type.", "rewrite the checkpoint.")
    try:
        config = AutoConfig.for_model(**plain)
    except (ValueError, KeyError, TypeError) as exc:
        raise QuantspecError(
            f"config.json describes a model transformers cannot build ({exc}).",
            "upgrade transformers or rewrite the checkpoint.",
        ) from exc
    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise QuantspecError(
            f"transformers cannot build a {model_type!r} model from config.json ({exc}).",
            "check config.json, or upgrade transformers if the architecture is newer.",
        ) from exc


def _swap_quantized_linears(model: nn.Module, fcfg, fmt, keys: set[str], dtype, names) -> list[str]:
    """Replace every nn.Linear (or GPT-2 Conv1D) whose tensors the checkpoint stores quantized
    (``keys``: tensor names in memory; ``names``: the KeyMap to the names the quantization
    config uses); return the names."""
    swapped = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear):
            k, n = mod.in_features, mod.out_features
        elif is_conv1d(mod):
            k, n = conv1d_shape(mod)
        else:
            continue
        scheme = fcfg.scheme_for(names.to_disk(name))
        specs = fmt.tensor_specs(scheme, n, k)
        if not all(f"{name}.{t}" in keys for t in specs):
            continue  # stored dense
        qmod = QuantLinear(k, n, mod.bias is not None, scheme, fmt.name, device="meta", dtype=dtype)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, qmod)
        swapped.append(name)
    return swapped


def quantized_skeleton(cfg: dict, fmt, fcfg, reader: CheckpointReader, dtype) -> tuple[nn.Module, object, list[str]]:
    """The checkpoint's model on the meta device with its quantized Linears swapped for
    QuantLinear (MoE experts linearized first, as the checkpoint stores them one per expert);
    returns (model, the KeyMap from module names to tensor names, the swapped names)."""
    model = _empty_model(cfg, dtype)
    linearize_experts(model)
    names = key_map(model)
    swapped = _swap_quantized_linears(model, fcfg, fmt, {names.to_memory(k) for k in reader.keys()}, dtype, names)
    return model, names, swapped


def load_quantized(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    backend: str = "auto",
    verify: bool = True,
) -> nn.Module:
    """Load a quantized checkpoint folder (GPTQ, AWQ or compressed-tensors).

    dtype: the compute dtype of activations and dense layers ("auto": fp32 on CPU, bf16 on GPU).
    backend: the kernel backend of every QuantLinear ("auto" picks the fastest that can run it).
    verify: check the files against the checkpoint's checksum manifest first (when it has one).
    Returns the transformers model in eval mode; ``model.quantspec_backends`` maps each
    quantized layer to the backend it uses.
    """
    path = Path(path)
    if not path.is_dir():
        raise QuantspecError(f"checkpoint folder {path} does not exist.", "check the path.")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if verify:
        verify_manifest(path)
    cfg = read_config(path)
    qcfg = cfg.get("quantization_config")
    if not isinstance(qcfg, dict):
        raise QuantspecError(
            f"{path}/config.json has no quantization_config: this is not a quantized checkpoint.",
            "load it as a dense model, or quantize it first with `quantspec quantize`.",
        )
    fmt, fcfg = read_with_overrides(qcfg)
    if any(sc.is_float for sc in (fcfg.scheme, *(sc for _, sc in fcfg.overrides))):
        require_float8(f"{path} ({fcfg.scheme.weights} weights)")
    reader = CheckpointReader(path)
    model, names, swapped = quantized_skeleton(cfg, fmt, fcfg, reader, dtype)
    if not swapped:
        raise QuantspecError(
            f"{path} says it is {fmt.name}-quantized but holds no quantized layer tensors.",
            "rewrite the checkpoint; it may be truncated or mislabelled.",
        )
    state = reader.load_all(model, dtype, names)
    kv = fcfg.extra.get("kv_cache")
    kv_state = {n: state.pop(n) for n in [n for n in state if n.endswith((".k_scale", ".v_scale"))]}
    _assign(model, state, path)
    model.to(device)
    model.eval()
    backends = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            mod.layer_name = name
            backends[name] = mod.prepare(backend)
    model.quantspec_backends = backends
    from ..kernels.cpu_moe import attach_cpu_token
    from ..kernels.moe import attach_grouped

    model.quantspec_grouped_experts = attach_grouped(model)
    model.quantspec_cpu_token_experts = attach_cpu_token(model)
    model.quantspec_format = fmt.name
    model.quantspec_kv_cache = _kv_cache(model, kv, kv_state, path)
    model.name_or_path = str(path)
    return model


def _kv_cache(model: nn.Module, kv, tensors: dict[str, torch.Tensor], path: Path):
    """(KVCacheConfig, per-layer scales) of a checkpoint with a kv_cache_scheme, else None;
    ``eval.perplexity`` and the KV decoders run attention on the cache it describes."""
    from ..core.kv_config import scales_from_tensors

    if kv is None:
        if tensors:
            raise QuantspecError(f"{path} holds KV-cache scales ({sorted(tensors)[0]}, ...) but its "
                                 "quantization_config has no kv_cache_scheme.", "rewrite the checkpoint.")
        return None
    return kv, scales_from_tensors(tensors)


def _assign(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = dict(model.state_dict(keep_vars=True))
    tied = _tied_keys(model)
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - tied)
    if unexpected or missing:
        raise QuantspecError(
            f"{path} does not match its config.json: "
            + (f"unexpected tensors {unexpected[:4]}{'...' if len(unexpected) > 4 else ''} " if unexpected else "")
            + (f"missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}" if missing else ""),
            "rewrite the checkpoint (it may be truncated or written for another model).",
        )
    for name, t in state.items():
        ref = expected[name]
        if tuple(ref.shape) != tuple(t.shape):
            raise QuantspecError(
                f"tensor {name} in {path} has shape {tuple(t.shape)} but the config implies "
                f"{tuple(ref.shape)}.",
                "rewrite the checkpoint; its tensors and config.json disagree.",
            )
        if ref.dtype.is_floating_point != t.dtype.is_floating_point:
            raise QuantspecError(
                f"tensor {name} in {path} has dtype {t.dtype}, expected a {ref.dtype}-like tensor.",
                "rewrite the checkpoint; its tensors and quantization_config disagree.",
            )
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    leftover += [n for n, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise QuantspecError(
            f"{path} is missing tensors for {leftover[:4]}.", "rewrite the checkpoint."
        )


def _tied_keys(model: nn.Module) -> set[str]:
    """State-dict keys that tie_weights() fills (e.g. lm_head.weight tied to the embeddings)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings()
    if out is None or isinstance(out, QuantLinear):
        return set()
    for name, mod in model.named_modules():
        if mod is out:
            return {f"{name}.weight"}
    return set()
