"""Checkpoints published only in a float quantized format, dequantized once into a dense copy.

Some models ship no dense original: GPT-OSS's experts are MXFP4 (``quant_method: "mxfp4"``),
DeepSeek-V3/R1 and the Qwen3 "-FP8" releases are FP8 E4M3 with 128 x 128 weight blocks
(``"fp8"``). quantspec quantizes dense models, so such a folder is dequantized once, tensor by
tensor and shard by shard (never the whole model in memory), into
``$QUANTSPEC_CACHE/models/dequantized/<name>-<key>`` through a temporary folder renamed into
place; every later use reads that copy, which is an ordinary dense checkpoint (same tensor
names, same shards, config.json without its quantization_config, ``quantspec_source.json``
naming the original).

The formats (``FORMATS``), with the rules the dequantization follows:
- ``mxfp4`` (GPT-OSS): ``X_blocks`` uint8 [E, N, K/32, 16] (two E2M1 codes a byte, the even
  column in the low nibble) and ``X_scales`` uint8 [E, N, K/32] (E8M0, bias 127) become ``X``
  [E, K, N], the layout of transformers' dense experts.
- ``fp8`` (DeepSeek-V3 style): ``W.weight`` float8_e4m3fn [N, K] times ``W.weight_scale_inv``
  [ceil(N/bn), ceil(K/bk)] (``weight_block_size`` [bn, bk]; the last block of a side may be
  short, as DeepSeek-V3's kv_a_proj_with_mqa's 576 rows over blocks of 128 are; a scalar scale
  without blocks) becomes ``W.weight``. transformers 5.25's own FP8 dequantization derives the
  block from the grid's shape and so refuses (or, where the grid happens to divide, misreads)
  such short blocks, so this one does not use it.

The copy's dtype is the original's declared ``dtype`` (bf16 for these releases): an MXFP4 value
is exact in bf16; an FP8 value times its fp32 block scale is rounded once to it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.floatcodes import dequantize_values, unpack_fp4_pairs
from ..errors import QuantspecError
from .paths import cache_root

INDEX_FILE = "model.safetensors.index.json"


def _mxfp4(get, key: str, qcfg: dict, dtype: torch.dtype) -> tuple[str, torch.Tensor | None] | None:
    if key.endswith("_scales"):
        return key, None  # read with its blocks
    if not key.endswith("_blocks"):
        return None
    name = key.removesuffix("_blocks")
    blocks, scales = get(key), get(name + "_scales")
    *lead, groups, half = blocks.shape
    if half != 16 or tuple(scales.shape) != (*lead, groups):
        raise QuantspecError(f"{key} {tuple(blocks.shape)} and its scales {tuple(scales.shape)} are not MXFP4 "
                             "blocks [..., K/32, 16] with scales [..., K/32].",
                             "check the checkpoint; only GPT-OSS style MXFP4 experts are read.")
    rows = blocks.reshape(-1, groups * 16)
    codes = unpack_fp4_pairs(rows)  # [rows, K]
    dense = dequantize_values(codes, scales.reshape(-1, groups), "mxfp4", 32)
    dense = dense.reshape(*lead, groups * 32)
    return name, (dense.transpose(-1, -2) if dense.dim() >= 3 else dense).to(dtype).contiguous()


def _fp8(get, key: str, qcfg: dict, dtype: torch.dtype) -> tuple[str, torch.Tensor | None] | None:
    if key.endswith(("weight_scale_inv", "weight_scale")):
        return key, None  # read with its weight
    w = get(key)
    if w.dtype != torch.float8_e4m3fn:
        return None
    scale = get(key + "_scale_inv", None)
    if scale is None:
        scale = get(key + "_scale", None)
    if scale is None:
        raise QuantspecError(f"FP8 weight {key} has no {key}_scale_inv (or _scale).",
                             "check that the checkpoint is complete.")
    values = w.to(torch.float32)
    scale = scale.to(torch.float32)
    if scale.numel() > 1:
        bn, bk = qcfg.get("weight_block_size") or (None, None)
        if bn is None or values.dim() != 2:
            raise QuantspecError(f"FP8 weight {key} {tuple(w.shape)} has scales {tuple(scale.shape)} but the "
                                 "config declares no weight_block_size.", "check the quantization_config.")
        n, k = values.shape
        if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
            raise QuantspecError(f"FP8 weight {key} {tuple(w.shape)} has a scale grid {tuple(scale.shape)}, not "
                                 f"ceil of its shape over the {bn} x {bk} blocks.", "check the checkpoint.")
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return key, (values * scale).to(dtype)


# quant_method -> (what it is, for messages; the per-tensor rule: (get: tensor by name, key, qcfg, dtype) ->
# None (copy the tensor as it is) | (name, dense tensor) | (key, None) (dropped, read with another))
FORMATS: dict[str, tuple[str, Callable]] = {
    "mxfp4": ("MXFP4 (E2M1 values, E8M0 scales per 32)", _mxfp4),
    "fp8": ("FP8 E4M3 with block scales", _fp8),
}


def quant_method(folder: Path) -> str | None:
    """The ``quant_method`` of ``folder``'s config.json quantization_config (None: dense or
    unreadable; "?" when the config has one without a method)."""
    try:
        qcfg = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qcfg:
        return None
    return qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else "?"


def dequantized_dir(folder: Path) -> Path:
    """The cache folder of ``folder``'s dense copy; the key hashes its absolute path and the
    size and mtime of its config and weight files, so a changed original gets a new copy."""
    folder = Path(folder).resolve()
    parts = [str(folder)]
    for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        st = f.stat()
        parts.append(f"{f.name}|{st.st_size}|{st.st_mtime_ns}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
    return cache_root() / "models" / "dequantized" / f"{folder.name.lower()}-{key}"


def dense_copy(folder: Path) -> Path:
    """``folder`` when it is dense; the dense copy of an original in one of ``FORMATS`` (built
    on first use, announced on stderr); any other quantized folder as it is, for the caller's
    refusal."""
    method = quant_method(folder)
    if method not in FORMATS:
        return Path(folder)
    dest = dequantized_dir(folder)
    if not (dest / "config.json").is_file():
        print(f"quantspec: {folder} holds {FORMATS[method][0]} weights, no dense ones; dequantizing it once to "
              f"{dest}", file=sys.stderr, flush=True)
        build_dequantized(Path(folder), dest)
    return dest


def build_dequantized(folder: Path, dest: Path) -> Path:
    """Write the dense copy of ``folder`` to ``dest``, one shard at a time; return ``dest``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..checkpoint.atomic import sibling_temp_folder
    from .dense_cache import finish_dense_folder

    start = time.perf_counter()
    config = json.loads((folder / "config.json").read_text())
    qcfg = config.pop("quantization_config")
    method = qcfg["quant_method"]
    rule = FORMATS[method][1]
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"))
    file_of: dict[str, Path] = {}  # tensor name -> the shard holding it
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            file_of.update(dict.fromkeys(h.keys(), f))
    keys = set(file_of)

    last: dict[str, torch.Tensor] = {}  # the tensor read last: a rule and the copy read it once

    def get(key: str, *default):
        if default and key not in keys:
            return default[0]
        if key not in last:
            with safe_open(str(file_of[key]), framework="pt") as h:
                last.clear()
                last[key] = h.get_tensor(key)
        return last[key]

    shards: dict[Path, list[str]] = {}
    for key in sorted(keys):
        shards.setdefault(file_of[key], []).append(key)
    weight_map, converted = {}, 0
    with sibling_temp_folder(dest) as tmp:
        for f, names in sorted(shards.items()):
            out = {}
            for key in names:
                got = rule(get, key, qcfg, dtype)
                if got is None:
                    out[key] = get(key)
                elif got[1] is not None:
                    out[got[0]] = got[1]
                    converted += 1
            save_file(out, str(tmp / f.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, f.name))
        if len(shards) > 1 or (folder / INDEX_FILE).is_file():
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
                                                     indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for extra in folder.iterdir():  # tokenizer, generation config, chat template ...
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_FILE):
                (tmp / extra.name).write_bytes(extra.read_bytes())
        meta = {"original": str(folder.resolve()), "quant_method": method, "dtype": str(dtype).removeprefix("torch."),
                "tensors_dequantized": converted, "dequantize_seconds": round(time.perf_counter() - start, 2)}
        finish_dense_folder(tmp, dest, meta)
    return dest
