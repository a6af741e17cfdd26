"""Streaming quantization: models larger than RAM, one decoder block in memory at a time.

The model is built on the meta device; only the tensors outside the decoder blocks (embeddings,
final norm, output head) are read up front. Block i's weights are read lazily from the
safetensors shards just before it is processed, and its packed tensors are written to their own
shard right after, before block i+1 is read; then the block goes back to the meta device. Peak
memory is the outside tensors + one block + the calibration activations, not the model.

The checkpoint is the same as the in-memory path's, tensor for tensor (tested), laid out as one
shard per block plus one for the rest, with the standard index file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import QuantspecError
from .arch import head_name
from .pack import checkpoint_state
from .scheme import QuantResult


class LazyWeights:
    """Read named tensors from a folder's safetensors files on demand (never all at once)."""

    def __init__(self, folder: Path):
        from ..checkpoint.reader import CheckpointReader

        self.reader = CheckpointReader(folder)
        self.keys = self.reader.keys()
        self._where = self.reader._keys  # name -> file

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[key]), framework="pt") as h:
            t = h.get_tensor(key)
        return t.to(dtype) if t.is_floating_point() else t

    def load_into(self, module: nn.Module, prefix: str, dtype: torch.dtype) -> None:
        """Assign every parameter/buffer of ``module`` (named ``prefix.*`` in the files)."""
        from safetensors import safe_open

        wanted: dict[Path, list[str]] = {}
        for rel, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_meta:
                continue
            key = f"{prefix}.{rel}" if prefix else rel
            if key not in self.keys:
                continue  # e.g. a tied head, filled by tie_weights
            wanted.setdefault(self._where[key], []).append(rel)
        state = {}
        for f, rels in wanted.items():
            with safe_open(str(f), framework="pt") as h:
                for rel in rels:
                    key = f"{prefix}.{rel}" if prefix else rel
                    t = h.get_tensor(key)
                    state[rel] = t.to(dtype) if t.is_floating_point() else t
        module.load_state_dict(state, strict=False, assign=True)


def empty_model(folder: Path, dtype: torch.dtype) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model


def load_outside_blocks(
    model: nn.Module, weights: LazyWeights, blocks_name: str, dtype, skip: tuple[str, ...] = ()
) -> None:
    """Materialise every tensor outside the decoder blocks, except the modules in ``skip``."""
    blocks = model.get_submodule(blocks_name)
    inside = {id(t) for t in list(blocks.parameters()) + list(blocks.buffers())}
    for name, mod in model.named_modules():
        if name == blocks_name or name.startswith(blocks_name + ".") or name in skip:
            continue
        direct = [
            (n, t)
            for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            if t.is_meta and id(t) not in inside
        ]
        if not direct:
            continue
        shell = nn.Module()
        for n, t in direct:
            shell.register_parameter(n, nn.Parameter(t, requires_grad=False)) if isinstance(
                t, nn.Parameter
            ) else shell.register_buffer(n, t)
        weights.load_into(shell, name, dtype)
        for n, _ in direct:
            setattr(mod, n, getattr(shell, n))
    model.tie_weights()
    missing = [
        n for n, t in model.named_parameters()
        if t.is_meta and not n.startswith(blocks_name + ".") and n.rpartition(".")[0] not in skip
    ]
    if missing:
        raise QuantspecError(f"the model's weights lack {missing[:4]}.", "check the model folder.")


class BlockShardWriter:
    """Writes block i's tensors to ``model-{i+1:05d}-of-{n:05d}.safetensors`` as it finishes."""

    def __init__(self, folder: Path, n_files: int, fmt, save_dtype: torch.dtype):
        self.folder, self.n_files, self.fmt, self.save_dtype = folder, n_files, fmt, save_dtype
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def _block_state(self, prefix: str, module: nn.Module, results: dict[str, QuantResult]) -> dict[str, torch.Tensor]:
        rel = {n[len(prefix) + 1 :] if prefix else n: r for n, r in results.items()}
        state = checkpoint_state(module, rel, self.fmt, self.save_dtype)
        return {(f"{prefix}.{k}" if prefix else k): v for k, v in state.items()}

    def write(self, index: int, prefix: str, module: nn.Module, results: dict[str, QuantResult]) -> None:
        self.write_state(index, self._block_state(prefix, module, results))

    def write_alternative(self, index: int, prefix: str, module: nn.Module, results: dict[str, QuantResult]) -> None:
        """Block i's shard with a method's second choice (same tensor names and shapes), kept
        aside in ``.alternatives/`` until ``choose``."""
        side = self.folder / ".alternatives"
        side.mkdir(exist_ok=True)
        self._save(side, index, self._block_state(prefix, module, results))

    def choose(self, use_alternatives: bool) -> None:
        """Move the alternative shards over the first ones (or not), then drop the rest."""
        import shutil

        side = self.folder / ".alternatives"
        if use_alternatives and side.is_dir():
            for f in sorted(side.iterdir()):
                f.replace(self.folder / f.name)
        shutil.rmtree(side, ignore_errors=True)

    def shard_name(self, index: int) -> str:
        return f"model-{index + 1:05d}-of-{self.n_files:05d}.safetensors"

    def _save(self, folder: Path, index: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(state, str(folder / self.shard_name(index)), metadata={"format": "pt"})
        return state

    def write_state(self, index: int, state: dict[str, torch.Tensor]) -> None:
        state = self._save(self.folder, index, state)
        fname = self.shard_name(index)
        for k, v in state.items():
            self.weight_map[k] = fname
            self.total += v.numel() * v.element_size()

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def block_shard_hooks(
    model: nn.Module, weights: LazyWeights, writer: BlockShardWriter, arch, dtype: torch.dtype
) -> tuple[Any, Any]:
    """(on_block_start, on_block_end) callbacks for the calibration engine."""

    def start(i: int, block: nn.Module) -> None:
        weights.load_into(block, arch.block_name(i), dtype)

    def end(i: int, block: nn.Module, results: dict[str, QuantResult]) -> None:
        writer.write(i, arch.block_name(i), block, results)
        block.to("meta")

    return start, end


def quantize_streaming(folder: Path, tokenizer, recipe, fmt, out: Path, *, overwrite: bool,
                       device: torch.device, progress: bool, report: dict, save_dtype_for,
                       finish, resume_dir: Path | None = None) -> None:
    """Quantize the model in ``folder`` block by block into the checkpoint folder ``out``.

    ``finish(tmp, model, plan, calib, seconds, config)`` writes the non-weight files into the
    temporary folder before it is renamed into place. ``resume_dir``: the calibration engine's
    journal (``resume.py``); the blocks it holds are read again and their shards rewritten
    from it, not recomputed (RTN, which needs no calibration, keeps none)."""
    import time

    from ..checkpoint.atomic import atomic_folder
    from ..checkpoint.checksums import write_manifest
    from .arch_infer import get_arch
    from .methods import calibrated_setup, check_smoothing, run_rtn
    from .pack import checkpoint_config
    from .plan import LayerPlan, make_plan
    from .calibrate import run_blockwise

    model = empty_model(folder, torch.float32)
    arch = get_arch(model)
    check_smoothing(arch, recipe, model)
    weights = LazyWeights(folder)
    plan = make_plan(model, recipe.scheme, fmt, recipe.targets, recipe.ignore)
    inside = lambda n: n.startswith(arch.blocks + ".")  # noqa: E731
    head = head_name(model)
    method, calib = None, None
    if recipe.method != "rtn":
        ids, method, calib = calibrated_setup(tokenizer, recipe, device)
    # The output head is not needed to calibrate: it is streamed to the checkpoint at the end
    # (unless the recipe quantizes it, it is tied to the embeddings, or the method makes a
    # choice on the whole model's outputs at the end, e.g. AWQ's model-level clip check).
    final_choice = method is not None and getattr(method, "may_offer_alternatives", lambda _p: False)(plan.quantize)
    stream_head = (head is not None and head not in plan.quantize and not model.config.tie_word_embeddings
                   and not final_choice)
    load_outside_blocks(model, weights, arch.blocks, torch.float32, (head,) if stream_head else ())
    save_dtype = save_dtype_for(model.config)
    blocks = arch.block_list(model)
    outside_plan = LayerPlan(quantize={n: s for n, s in plan.quantize.items() if not inside(n)})
    rest_keys = _outside_keys(model, inside)
    with atomic_folder(out, overwrite) as tmp:
        n_files = len(blocks) + (1 if outside_plan.quantize else len(rest_keys))
        writer = BlockShardWriter(tmp, n_files, fmt, save_dtype)
        start, end = block_shard_hooks(model, weights, writer, arch, torch.float32)
        t0 = time.perf_counter()
        if recipe.method == "rtn":
            for i, block in enumerate(blocks):
                start(i, block)
                prefix = arch.block_name(i) + "."
                sub = LayerPlan(quantize={n: s for n, s in plan.quantize.items() if n.startswith(prefix)})
                end(i, block, run_rtn(model, sub, progress=False, report=report))
        else:
            def alternative(i: int, block: nn.Module, results: dict[str, QuantResult]) -> None:
                writer.write_alternative(i, arch.block_name(i), block, results)

            run_blockwise(
                model, arch, ids, method, plan.quantize, device=device, progress=progress,
                report=report, on_block_start=start, on_block_end=end,
                on_block_alternative=alternative, on_choice=writer.choose, resume_dir=resume_dir,
            )
            writer.choose(False)  # no choice made: the first results stay
        results = run_rtn(model, outside_plan, progress=False, report=report)
        seconds = time.perf_counter() - t0
        config = checkpoint_config(model, recipe, plan, fmt, save_dtype)
        if outside_plan.quantize:
            state = checkpoint_state(model, results, fmt, save_dtype)
            writer.write_state(len(blocks), {k: v for k, v in state.items() if not inside(k)})
        else:  # one tensor at a time, each in its own shard, released after writing
            for j, key in enumerate(rest_keys):
                mod_name, _, attr = key.rpartition(".")
                mod = model.get_submodule(mod_name) if mod_name else model
                t = getattr(mod, attr)
                t = weights.read(key, save_dtype) if t.is_meta else t.detach().to(save_dtype)
                writer.write_state(len(blocks) + j, {key: t})
                del t
                _release(mod, attr)
        writer.write_index()
        finish(tmp, model, plan, calib, seconds, config)
        write_manifest(tmp)


def _outside_keys(model: nn.Module, inside) -> list[str]:
    """State-dict keys outside the blocks; a tied output head is stored once (as the input)."""
    keys = [k for k in model.state_dict() if not inside(k)]
    if model.config.tie_word_embeddings:
        head = head_name(model)
        keys = [k for k in keys if head is None or k != f"{head}.weight"]
    return keys


def _release(module: nn.Module, attr: str) -> None:
    t = getattr(module, attr)
    meta = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        setattr(module, attr, nn.Parameter(meta, requires_grad=False))
    else:
        setattr(module, attr, meta)
