"""A checksum manifest for checkpoint folders: every file's sha256, checked before loading.

Without it a flipped byte inside a tensor's data loads as a silently different model (the
safetensors header cannot notice). ``quantspec.checksums.json`` lists each file written; engines
ignore it, quantspec verifies it. Folders without a manifest (written by other tools) load as
they are.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import QuantspecError

MANIFEST = "quantspec.checksums.json"
VERSION = 1


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    data = {
        "version": VERSION,
        "algorithm": "sha256",
        "files": {str(p.relative_to(folder)): file_sha256(p) for p in files},
    }
    (folder / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def verify_manifest(folder: Path) -> bool:
    """Raise QuantspecError when a listed file is missing or differs; False when no manifest."""
    path = folder / MANIFEST
    if not path.is_file():
        return False
    fix = "the checkpoint is corrupt or was edited by hand; rewrite it with `quantspec quantize`."
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        ok = data.get("version") == VERSION and data.get("algorithm") == "sha256"
        ok = ok and isinstance(files, dict)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise QuantspecError(f"{path} is unreadable ({exc}).", fix) from exc
    if not ok:
        raise QuantspecError(f"{path} has an unknown version or layout.", fix)
    for name, digest in files.items():
        f = folder / name
        if not f.is_file():
            raise QuantspecError(f"{f} is listed in {MANIFEST} but missing.", fix)
        if file_sha256(f) != digest:
            raise QuantspecError(f"{f} does not match its checksum (truncated or corrupt).", fix)
    return True
