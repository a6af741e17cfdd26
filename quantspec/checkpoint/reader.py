"""Read the tensors of a checkpoint folder (one safetensors file, or shards with an index).

Every failure to read (missing file, truncated or corrupt bytes, bad header) becomes a
QuantspecError naming the file; nothing is loaded half-way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import QuantspecError


class CheckpointReader:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.files = self._files()
        self._keys: dict[str, Path] | None = None

    def _files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise QuantspecError(
                    f"{index} is not a valid safetensors index ({exc}).", "rewrite the checkpoint."
                ) from exc
            files = sorted({self.folder / f for f in weight_map.values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise QuantspecError(
                f"{self.folder} holds no .safetensors weights.",
                "point to a complete checkpoint folder (only safetensors is read).",
            )
        for f in files:
            if not f.is_file():
                raise QuantspecError(f"weight file {f} is missing.", "rewrite the checkpoint.")
        return files

    def _open(self, f: Path):
        from safetensors import safe_open

        try:
            return safe_open(str(f), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise QuantspecError(
                f"cannot read {f}: {exc}.", "the file is truncated or corrupt; rewrite the checkpoint."
            ) from exc

    def keys(self) -> set[str]:
        if self._keys is None:
            self._keys = {}
            for f in self.files:
                with self._open(f) as h:
                    for k in h.keys():
                        if k in self._keys:
                            raise QuantspecError(
                                f"tensor {k} appears in two weight files.", "rewrite the checkpoint."
                            )
                        self._keys[k] = f
        return set(self._keys)

    def file_of(self, key: str) -> Path:
        """The weight file that holds tensor ``key``."""
        self.keys()
        return self._keys[key]  # type: ignore[index]

    def load_all(self, model: nn.Module, dtype: torch.dtype, names=None) -> dict[str, torch.Tensor]:
        """All tensors, by module name (``names``: a ``models.experts.KeyMap`` from the names on
        disk); floating tensors of dense modules are cast to ``dtype``, quantized layers'
        tensors (codes, scales, zeros) keep the dtype they are stored in."""
        from ..kernels.quant_linear import QuantLinear
        from ..models.experts import KeyMap

        names = names or KeyMap()
        keep = set()
        for name, mod in model.named_modules():
            if isinstance(mod, QuantLinear):
                keep.update(f"{name}.{t}" for t in mod.format_tensors())
        self.keys()
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            with self._open(f) as h:
                for k in h.keys():
                    try:
                        t = h.get_tensor(k)
                    except Exception as exc:
                        raise QuantspecError(
                            f"cannot read tensor {k} from {f}: {exc}.",
                            "the file is truncated or corrupt; rewrite the checkpoint.",
                        ) from exc
                    k = names.to_memory(k)
                    if t.is_floating_point() and k not in keep:
                        t = t.to(dtype)
                    out[k] = t
        return out
