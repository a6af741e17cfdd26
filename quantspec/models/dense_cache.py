"""Dequantize a GGUF file once into a dense safetensors folder, atomically.

Loading a GGUF through transformers dequantizes every tensor (15-70 s for 135M-0.5B models on
2 CPU cores); a dense safetensors copy reloads in about a second. The folder (config,
weights, tokenizer, generation config, ``quantspec_source.json``) is written to a temporary
sibling folder and renamed into place, so a folder that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from ..checkpoint.atomic import rename_folder_into_place, sibling_temp_folder
from ..errors import QuantspecError
from .paths import cache_root

# Weights dtype of the cached copy. The GGUF values (q * scale + min, fp16 scale/min) are
# exact in fp32 but not in bf16; fp32 keeps the cached model bit-identical to the GGUF load.
CACHE_DTYPE = torch.float32
SOURCE_FILE = "quantspec_source.json"


def gguf_cache_dir(gguf: Path, alias: str | None = None) -> Path:
    """Cache folder for a GGUF: ``models/<alias>`` for aliases, else ``models/gguf/<stem>-<key>``.

    The key hashes the absolute path, size and mtime, so an edited file gets a new folder.
    """
    root = cache_root() / "models"
    if alias:
        return root / alias
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return root / "gguf" / f"{gguf.stem.lower()}-{key}"


def require_gguf_package() -> None:
    """Raise a QuantspecError naming the extra to install when ``gguf`` is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise QuantspecError(
            "reading a GGUF file needs the 'gguf' package, which is not installed.",
            "pip install 'quantspec[gguf]'",
        ) from exc


def load_gguf(gguf: Path, dtype: torch.dtype = CACHE_DTYPE):
    """(model, tokenizer) from a GGUF file via transformers' GGUF loader (dequantizes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf_package()
    extra = {}
    try:  # transformers >= 5.x can keep GGUF blocks; ask for a plain dense model explicitly
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, **extra)
    except QuantspecError:
        raise
    except Exception as exc:  # gguf raises ValueError/KeyError/struct errors on bad files
        raise QuantspecError(
            f"could not read the GGUF file {gguf}: {type(exc).__name__}: {exc}",
            "check that the file is a complete GGUF of a causal LM architecture transformers supports "
            "(llama, qwen2, mistral, gemma2, phi3, ...), or pass a dense HF folder instead.",
        ) from exc
    if getattr(model, "hf_quantizer", None) is not None:  # dense weights, drop the GGUF marker
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def build_dense_cache(gguf: Path, dest: Path, dtype: torch.dtype = CACHE_DTYPE) -> Path:
    """Write the dense copy of ``gguf`` to ``dest`` (temp folder + rename); return ``dest``."""
    if (dest / "config.json").is_file():
        return dest
    start = time.perf_counter()
    model, tokenizer = load_gguf(gguf, dtype)
    with sibling_temp_folder(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        meta = {"gguf": str(gguf.resolve()), "gguf_bytes": gguf.stat().st_size,
                "dtype": str(dtype).removeprefix("torch."),
                "dequantize_seconds": round(time.perf_counter() - start, 2)}
        finish_dense_folder(tmp, dest, meta)
    return dest


def finish_dense_folder(tmp: Path, dest: Path, meta: dict) -> None:
    """Write ``meta`` as ``SOURCE_FILE`` into the temporary folder ``tmp`` and rename it to ``dest``
    (``rename_folder_into_place`` gives it a plain folder's modes) (a lost race to another process writing the same copy is not an error)."""
    (tmp / SOURCE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    try:
        rename_folder_into_place(tmp, dest)
    except OSError:
        if not (dest / "config.json").is_file():  # not a lost race: a real failure
            raise
