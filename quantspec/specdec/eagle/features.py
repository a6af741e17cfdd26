"""The target's features of training windows, computed once and kept on disk in shards.

An EAGLE head learns from the target's final-normed hidden states (what its LM head reads) over
text. Computing them is a full target forward per window, the slowest part of training on a
CPU, so they are written shard by shard (``shard-00000.safetensors``: ``tokens`` int64 [n, L],
``features`` bf16 [n, L, H]), each atomically: a run that is stopped keeps its finished shards
and the next run computes only the rest. ``manifest.json`` records what the features are of
(target, data, windows); features of anything else in the folder are refused, not mixed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...checkpoint.atomic import atomic_save_file, atomic_write_text
from ...errors import QuantspecError

MANIFEST = "manifest.json"


@torch.inference_mode()
def model_features(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden states [B, L, H] of ``ids`` [B, L] (transformers' last
    ``hidden_states``, the LM head's input)."""
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return out.hidden_states[-1]


def _shard_path(folder: Path, i: int) -> Path:
    return folder / f"shard-{i:05d}.safetensors"


def claim_folder(folder: str | Path, key: dict) -> Path:
    """Mark ``folder`` as holding what ``key`` (JSON-able) describes; a folder already marked for
    another key raises QuantspecError (nothing of another run is reused or mixed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / MANIFEST
    key = json.loads(json.dumps(key))  # as it reads back
    if manifest.is_file():
        held = json.loads(manifest.read_text())
        if held != key:
            changed = sorted(k for k in set(held) | set(key) if held.get(k) != key.get(k))
            raise QuantspecError(f"{folder} holds features of another run (differs in {changed}).",
                                 "use another --out, or --overwrite to start over.")
    else:
        atomic_write_text(manifest, json.dumps(key, indent=1) + "\n")
    return folder


def extract_features(model: torch.nn.Module, windows: torch.Tensor, folder: str | Path, key: dict,
                     shard_size: int = 16, batch_size: int = 4, progress: bool = True) -> list[Path]:
    """Features of every window of ``windows`` (int64 [n, L]) in shards under ``folder``.

    ``key`` says what they are of (``claim_folder``). Finished shards are reused. Returns the
    shard paths in window order.
    """
    from tqdm.auto import tqdm

    folder = claim_folder(folder, key)
    n = windows.shape[0]
    paths = [_shard_path(folder, i) for i in range((n + shard_size - 1) // shard_size)]
    done = sum(shard_size if (i + 1) * shard_size <= n else n - i * shard_size
               for i, p in enumerate(paths) if p.is_file())
    device = next(model.parameters()).device
    with tqdm(total=n, initial=done, desc="target features", unit="win", disable=not progress) as bar:
        for i, path in enumerate(paths):
            if path.is_file():
                continue
            chunk = windows[i * shard_size:(i + 1) * shard_size]
            parts = []
            for j in range(0, chunk.shape[0], batch_size):
                parts.append(model_features(model, chunk[j:j + batch_size].to(device)).to("cpu", torch.bfloat16))
                bar.update(parts[-1].shape[0])
            atomic_save_file({"tokens": chunk.contiguous(), "features": torch.cat(parts).contiguous()}, path)
    return paths


def load_features(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [n, L], features bf16 [n, L, H]) of the shards, in order."""
    from safetensors.torch import load_file

    parts = [load_file(str(p)) for p in paths]
    return torch.cat([p["tokens"] for p in parts]), torch.cat([p["features"] for p in parts])
