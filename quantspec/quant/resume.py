"""Resumable state of the block engine: finished blocks on disk, so a rerun continues.

Layout of ``resume_dir``::

    manifest.json                 {"version", "fingerprint", "done", "inputs", "report", "blocks"}
    block_0000.safetensors        QuantResults of block 0 ("<name>.qweight|scales|zeros|g_idx",
                                  and global_scale / input_scale where the scheme has them)
                                  + any other block tensor the method changed ("state.<key>")
                                  + the method's tensors for the block ("method_block.<key>");
                                  metadata "schemes": {name: QuantScheme dict} as JSON
    inputs_0003.safetensors       "inputs": the hidden states entering block ``done``
                                  + what the method carries on ("method.<key>")

Every file is written under a temporary name and renamed; the manifest is replaced last, so
an interruption at any point leaves the previous consistent state. ``JournaledSink`` wraps any
sink (``sinks.py``) with this journal.

What must match for a rerun to continue: the fingerprint (model config, every tensor outside
the decoder blocks but the output head, plan, method and its options, calibration ids), and,
block by block, the digest of each finished block's float weights (``"blocks"``, every byte:
``digest.py``), checked before that block is reused. Anything different fails with a clear
error instead of mixing another model's blocks in (e.g. a fine-tune with the same config).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..checkpoint.atomic import atomic_save_file, atomic_write_text
from ..errors import QuantspecError
from .arch import ArchSpec, head_name
from .digest import module_digest, tensors_digest, update_tensor
from ..core.scheme import QuantResult, QuantScheme
from .sinks import BlockRecord, Sink

VERSION = 3  # 3: method tensors per block and carried (2: AWQ alternatives as alt.*)
_FIELDS = ("qweight", "scales", "zeros", "g_idx", "global_scale", "input_scale")


def fingerprint(
    model: nn.Module,
    arch: ArchSpec,
    plan: dict[str, QuantScheme],
    method: str,
    calib_ids: torch.Tensor,
) -> str:
    """sha256 hex of what determines the engine's inputs to block 0 and its settings; the
    blocks' own weights are checked block by block (``ResumeState.restore_block``).

    Every tensor outside the decoder blocks counts (embeddings, final norm), except the output
    head, which no journaled state depends on (the streaming path may not have read it yet)."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string() if config is not None else type(model).__name__).encode())
    h.update(repr(arch).encode())
    h.update(json.dumps({n: plan[n].to_dict() for n in sorted(plan)}).encode())
    h.update(method.encode())
    update_tensor(h, calib_ids.to(torch.int64))
    head = head_name(model)
    outside = [(k, v) for k, v in model.state_dict().items()
               if not k.startswith(arch.blocks + ".") and (head is None or k.rpartition(".")[0] != head)]
    h.update(tensors_digest(outside).encode())
    return h.hexdigest()


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    atomic_save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, path, metadata)


class ResumeState:
    """The finished blocks recorded under ``resume_dir`` for fingerprint ``fp``."""

    def __init__(self, resume_dir: str | os.PathLike, fp: str):
        self.dir = Path(resume_dir)
        self.fp = fp
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest: dict[str, Any] = {"version": VERSION, "fingerprint": fp, "done": 0, "inputs": None,
                                         "report": {}, "blocks": []}
        path = self.dir / "manifest.json"
        if path.is_file():
            old = json.loads(path.read_text())
            if old.get("version") != VERSION:
                raise QuantspecError(
                    f"the resume state in {self.dir} was written by another version of quantspec.",
                    "delete that folder to start over.",
                )
            if old.get("fingerprint") != fp:
                raise QuantspecError(
                    f"the resume state in {self.dir} was made for a different model, plan, "
                    "method or calibration set.",
                    "delete that folder to start over, or run with those settings again.",
                )
            self.manifest = old

    @property
    def done(self) -> int:
        return int(self.manifest["done"])

    @staticmethod
    def snapshot(block: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in block.state_dict().items()}

    def save_block(self, record: "BlockRecord", before: dict[str, torch.Tensor]) -> None:
        """Journal a finished block. ``before``: its float state (``snapshot``) when it was
        reached, whose digest is recorded; ``record.state`` (the method's tensors for this
        block) is saved as ``method_block.*``; ``record.carry`` (what the method carries to the
        next block) as ``method.*`` with the next inputs, which replace the previous ones."""
        index, block_name, block, results = record.index, record.name, record.block, record.results
        quantized = {n[len(block_name) + 1 :] + ".weight" for n in results}
        tensors: dict[str, torch.Tensor] = {}
        for key, value in block.state_dict().items():
            if key not in quantized and not torch.equal(value, before[key]):
                tensors[f"state.{key}"] = value
        tensors.update(result_tensors(results, ""))
        tensors.update({f"method_block.{k}": v for k, v in record.state.items()})
        schemes = json.dumps({n: r.scheme.to_dict() for n, r in results.items()})
        _save(tensors, self.dir / f"block_{index:04d}.safetensors", {"schemes": schemes})
        inputs_name = f"inputs_{index + 1:04d}.safetensors"
        _save({"inputs": record.next_inputs, **{f"method.{k}": v for k, v in record.carry.items()}},
                    self.dir / inputs_name)
        old_inputs = self.manifest["inputs"]
        self.manifest["report"].update(record.report)
        self.manifest["blocks"] = self.manifest["blocks"][:index] + [tensors_digest(before.items())]
        self.manifest.update(done=index + 1, inputs=inputs_name)
        atomic_write_text(self.dir / "manifest.json", json.dumps(self.manifest, indent=1))
        if old_inputs and old_inputs != inputs_name:
            (self.dir / old_inputs).unlink(missing_ok=True)

    def restore_block(
        self, index: int, block: nn.Module, block_name: str
    ) -> tuple[dict[str, QuantResult], dict[str, torch.Tensor]]:
        """Load finished block ``index`` into ``block`` (its float weights, which must be those
        it was quantized from): the changed tensors and the dequantized weights. Returns its
        results and the method's tensors for it (``BlockRecord.state``)."""
        if module_digest(block) != self.manifest["blocks"][index]:
            raise QuantspecError(
                f"the resume state in {self.dir} holds block {index} ({block_name}) of another model: "
                "this model's float weights there differ from those it was quantized from.",
                "delete that folder to start over, or resume with the model it was made for.",
            )
        path = self.dir / f"block_{index:04d}.safetensors"
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        state = block.state_dict()
        results = results_from_tensors(tensors, json.loads(meta["schemes"]), "")
        with torch.no_grad():
            for key, value in tensors.items():
                if key.startswith("state."):
                    target = state[key[len("state.") :]]
                    target.copy_(value.to(target.device))
            for name, res in results.items():
                mod = block.get_submodule(name[len(block_name) + 1 :])
                mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
        state = {k[len("method_block.") :]: v for k, v in tensors.items() if k.startswith("method_block.")}
        return results, state

    def restore_report(self, report: dict) -> None:
        """The finished blocks' report entries, marked ``"resumed": True``."""
        report.update({n: {**entry, "resumed": True} for n, entry in self.manifest["report"].items()})

    def next_inputs(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The hidden states entering block ``done`` and the method's carry saved with them."""
        saved = load_file(str(self.dir / self.manifest["inputs"]))
        return saved["inputs"], {k[len("method.") :]: v for k, v in saved.items() if k.startswith("method.")}


def result_tensors(results: dict[str, QuantResult], prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix}{name}.{field}`` -> tensor for every result's stored fields."""
    return {f"{prefix}{name}.{f}": getattr(res, f) for name, res in results.items()
            for f in _FIELDS if getattr(res, f) is not None}


def results_from_tensors(tensors: dict[str, torch.Tensor], schemes: dict[str, dict], prefix: str) -> dict[str, QuantResult]:
    """The QuantResults ``result_tensors`` stored under ``prefix``, by name."""
    return {name: QuantResult(**{f: tensors.get(f"{prefix}{name}.{f}") for f in _FIELDS},
                              scheme=QuantScheme.from_dict(sd)) for name, sd in schemes.items()}


class JournaledSink(Sink):
    """Journals every finished block (``ResumeState``) before handing it to ``inner``; a rerun
    reads the journaled blocks back through ``restore`` (into ``inner`` too), so any sink
    resumes: in memory or shard by shard, declared or inferred architecture."""

    def __init__(self, inner: Sink, state: ResumeState):
        self.inner, self.state = inner, state
        self._before: dict[str, torch.Tensor] = {}

    @property
    def done(self) -> int:
        return self.state.done

    def begin_block(self, index: int, block: nn.Module) -> None:
        self._before = ResumeState.snapshot(block)
        self.inner.begin_block(index, block)

    def write_block(self, record: BlockRecord) -> None:
        self.state.save_block(record, self._before)
        self.inner.write_block(record)

    def replace(self, model: nn.Module, results: dict[str, QuantResult]) -> None:
        self.inner.replace(model, results)

    def restore(self, index: int, block: nn.Module, block_name: str) -> BlockRecord:
        """Finished block ``index`` read back into ``block`` and handed to ``inner``."""
        results, state = self.state.restore_block(index, block, block_name)
        record = BlockRecord(index, block_name, block, results, state=state)
        self.inner.write_block(record)
        return record
