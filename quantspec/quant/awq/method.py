"""AWQ as a calibration-engine method (a ``Smoother`` that also rounds).

For each smoothing pair of a block (``prev`` -> balanced Linears, ``smoothing.py``):

1. ``x_mean`` [K]: mean |x| per input channel of the balanced Linears (calibration tokens).
2. The scale search (``search.search_scale``) under the pair's objective (``objective.py``:
   the consuming module's output on whole sequences, or the Linears' outputs on a sample).
3. The best ``s`` is folded exactly (``smoothing.fold_scales``).
4. Clipping (``clip.py``; by default at 3 bits and below, ``CLIP_AUTO_MAX_BITS``; every Linear
   unless named in ``CLIP_SKIP``): each group's clip from its error curve, kept only where it lowers the pair's
   objective (``keep_helpful_clips``), then a block's kept clips together only where they lower
   the block's output error on held-out calibration sequences (``clip_check_seqs``), then
   model-wide only where they bring the next-token distribution closer to the float model's
   (``model_check.py``, the post-pass ``finish``).
5. RTN of the scaled, clipped weights -> QuantResult.

Data-parallel calibration (``distributed.py``): the search sequences and the held-out ones are
chosen among the global sequence indices and each process runs those it holds; the statistics,
token samples and every loss that decides something are over every process's (reduced), so
every process folds the same scales and keeps the same clips; rank 0 writes the scales file.
The scale search then evaluates every candidate in full (no early stop).

Why the defaults are what they are: docs/decisions/awq-defaults.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ...errors import QuantspecError
from ..block_ops import block_forward, check_finite
from ..digest import module_digest
from ..distributed import Reducer, Share
from ..fused_scales import block_global_scales
from ..method import BlockContext, BlockOutput, Finish, FinishContext, Smoother
from ..options import AWQOptions
from ..precision import forward_precision
from ..resume import result_tensors, results_from_tensors
from ...core.scheme import QuantResult, QuantScheme
from ..smoothing import ResolvedPair, collect_input_stats, fold_scales, resolve_pairs
from .clip import CLIP_SKIP, awq_quantize, clip_error_curve, clip_wanted, pick_clip
from .model_check import ModelClipCheck
from .objective import PairObjective, block_errors, capture_parents, held_out, keep_helpful_clips, spread
from .scales_file import ScalesFile, write_scales
from .search import search_scale, weight_group_mean

if TYPE_CHECKING:
    from ..recipe import Recipe


@dataclass(frozen=True)
class AWQSettings:
    """AWQ's options (``awq``) plus the sample sizes of its searches and checks.

    search_tokens: tokens each candidate scale is scored on; clip_tokens: the clip search's
    token sample; clip_skip: Linear names (suffixes) never clipped; quantize: False to scale
    (and search clips) only, as the smoothing step before another rounder; propagate: the next
    block's inputs come from this block with its "float" (scaled, unquantized, as AutoAWQ and
    llm-compressor do) or its "quantized" weights; clip_check_seqs: held-out calibration
    sequences of the block-level clip check (0: none); clip_model_check: the model-level check.
    The sample sizes were chosen on the validation split of docs/decisions/awq-defaults.md (C4
    documents outside the calibration draw), not on the wikitext2 text the tables report.
    """

    awq: AWQOptions = AWQOptions()
    search_tokens: int = 8192
    clip_tokens: int = 512
    clip_skip: tuple[str, ...] = CLIP_SKIP
    quantize: bool = True
    propagate: str = "float"
    clip_check_seqs: int = 8
    clip_model_check: bool = True

    def __post_init__(self) -> None:
        if self.propagate not in ("float", "quantized"):
            raise QuantspecError(f"AWQ propagate={self.propagate!r} is not float or quantized.",
                                 "use float (the default) or quantized.")
        if self.clip_check_seqs < 0:
            raise QuantspecError(f"AWQ clip_check_seqs={self.clip_check_seqs} is negative.",
                                 "use 0 (no block check) or a number of sequences, e.g. 8.")


class AWQProbe:
    """What a study of AWQ's choices may watch or supply (no-op defaults; e.g.
    benchmarks/awq_tune_defaults.py records a run and replays it with other clip settings)."""

    def scale(self, pair: str, x_mean: torch.Tensor, search: Callable[[], tuple[torch.Tensor, dict]]
              ) -> tuple[torch.Tensor, dict]:
        """The scale of smoothing pair ``pair`` (its first Linear's full name): by default the
        search's (``search()``), or one the probe supplies."""
        return search()

    def clip_curve(self, name: str, errors: torch.Tensor, amax: torch.Tensor) -> None:
        """Linear ``name``'s clip error curve (``clip.clip_error_curve``)."""

    def scaled_weight(self, name: str, weight: torch.Tensor) -> None:
        """Linear ``name``'s scaled float weight, just before it is rounded."""


class AWQMethod(Smoother):
    """AWQ: ``smooth`` searches and folds a block's scales (and finds its clips);
    ``process_block`` also rounds it. After either, the block's smoothing scales are folded
    (norms and Linears changed in place); every planned Linear's ``.weight`` holds its scaled,
    unclipped float weight, the dense weight its QuantResult approximates.

    The model-level clip check holds the unclipped results of the clipped Linears (one byte
    per weight, on the CPU) until ``finish``.
    """

    data_parallel = True  # sequence choices global; statistics, samples and losses reduced (module docstring)

    def __init__(self, settings: AWQSettings | None = None, scale_dtype: torch.dtype = torch.float16,
                 recipe_fingerprint: dict | None = None, probe: AWQProbe | None = None):
        super().__init__(settings or AWQSettings(), scale_dtype)
        self.probe = probe or AWQProbe()
        self.recipe_fingerprint = recipe_fingerprint or {}
        self._saved: dict[str, torch.Tensor] = {}  # what --save-scales writes
        self._block_fps: dict[str, str] = {}
        self._file = ScalesFile(self.options.awq.load_scales, self.recipe_fingerprint) \
            if self.options.awq.load_scales else None
        self._clips: dict[str, torch.Tensor] = {}  # the last smoothed block's kept clips
        self._check = ModelClipCheck()
        self._unclipped: dict[str, QuantResult] = {}  # alternatives for the model-level check

    # -- Smoother ----------------------------------------------------------------------------
    def smooth(self, ctx: BlockContext) -> dict[str, dict]:
        info: dict[str, dict] = {}
        rel = ctx.relative_plan()
        pairs, skipped = resolve_pairs(ctx.block, ctx.arch)
        pairs = [p for p in pairs if any(n in rel for n in p.linear_names)]
        opts = self.options.awq
        fp = module_digest(ctx.block) if opts.load_scales or opts.save_scales else ""
        if self._file is not None:
            self._clips = self._apply_loaded(ctx.name, fp, pairs)
        else:
            self._clips = self._search(ctx, rel, pairs, info)
        self._block_fps[ctx.name] = fp
        if opts.save_scales and ctx.reducer.rank == 0:  # every process holds the same scales
            write_scales(opts.save_scales, self._saved, self.recipe_fingerprint, self._block_fps)
        if skipped:
            for name in ctx.plan:
                info.setdefault(name, {})["smoothing_skipped"] = skipped
        return info

    # -- BlockMethod -------------------------------------------------------------------------
    def process_block(self, ctx: BlockContext) -> BlockOutput:
        t0 = time.perf_counter()
        info = self.smooth(ctx)
        clips, block, block_name = self._clips, ctx.block, ctx.name
        if not self.options.quantize:
            return BlockOutput({}, info)
        outputs = None
        if self.options.propagate == "float":  # folding is exact: the float block's output
            outputs = block_forward(block, ctx.inputs, ctx.kwargs)
            check_finite(outputs, block_name, "its output")
        results = {}
        gscales = block_global_scales(block, block_name, ctx.plan, ctx.arch)  # NVFP4 fused siblings, scaled weights
        for name, scheme in ctx.plan.items():
            mod = block.get_submodule(name[len(block_name) + 1 :])
            self.probe.scaled_weight(name, mod.weight)
            results[name] = awq_quantize(mod.weight, scheme, clips.get(name), self.scale_dtype, gscales.get(name))
            info.setdefault(name, {})["clipped"] = name in clips
        state = {}
        rel = ctx.relative_plan()
        if self._check.started or self.uses_model_head(rel):
            held = self._held_out(ctx.reducer.share(ctx.inputs.shape[0]), ctx.inputs.shape[1])
            self._check.advance(block, block_name, ctx.inputs[held], ctx.kwargs, rel, clips,
                                forward_precision(block, self.options.awq.search_dtype),
                                outputs[held] if outputs is not None else None)
            if clips:
                unclipped = {n: awq_quantize(block.get_submodule(n[len(block_name) + 1 :]).weight,
                                             ctx.plan[n], None, self.scale_dtype, gscales.get(n)).to("cpu")
                             for n in clips}
                self._unclipped.update(unclipped)
                state = result_tensors(unclipped, "unclipped.")
        for name in results:
            info[name]["awq_seconds"] = time.perf_counter() - t0
        return BlockOutput(results, info, next_inputs=outputs, state=state)

    def uses_model_head(self, plan: dict[str, QuantScheme]) -> bool:
        """Whether quantizing ``plan`` (names -> schemes) may end with the model-level clip
        check (it needs the model's head at the end)."""
        opts = self.options
        if not (opts.clip_model_check and opts.clip_check_seqs and opts.quantize):
            return False
        if self._file is not None:
            return self._file.has_clips()
        return any(clip_wanted(opts.awq.clip, sc) and not n.endswith(tuple(opts.clip_skip)) for n, sc in plan.items())

    def restore_block(self, ctx: BlockContext, state: dict[str, torch.Tensor]) -> None:
        names = {k[len("unclipped.") :].rpartition(".")[0] for k in state}
        self._unclipped.update(results_from_tensors(state, {n: ctx.plan[n].to_dict() for n in names}, "unclipped."))

    def carry(self) -> dict[str, torch.Tensor]:
        return self._check.carry()

    def restore_carry(self, state: dict[str, torch.Tensor]) -> None:
        self._check.restore(state)

    def finish(self, ctx: FinishContext) -> Finish:
        """The model-level clip check: every clip dropped (the unclipped results swapped in)
        when the model is closer to the float one without them."""
        if ctx.logits is None:
            return Finish()
        drop, info = self._check.decide(ctx.logits, ctx.n_blocks, ctx.reducer)
        return Finish(replace=dict(self._unclipped) if drop else {}, info=info)

    # -- the searches ------------------------------------------------------------------------
    def _search_seqs(self, n: int, seqlen: int) -> list[int]:
        """Which of ``n`` calibration sequences of ``seqlen`` tokens the searches run on
        (``search_tokens`` worth, spread)."""
        n_seq = min(n, max(1, -(-self.options.search_tokens // seqlen)))
        return torch.linspace(0, n - 1, n_seq).round().long().unique().tolist()

    def _held_out(self, seqs: Share, seqlen: int) -> list[int]:
        """This process's sequences (indices into its share ``seqs``) among the ones the clip
        checks run on: ``clip_check_seqs`` of all sequences, spread, avoiding the searches'."""
        used = set(self._search_seqs(seqs.total, seqlen))
        return seqs.local(held_out(seqs.total, used, self.options.clip_check_seqs))

    def _apply_loaded(self, block_name: str, fp: str, pairs: list[ResolvedPair]) -> dict[str, torch.Tensor]:
        scales, clips = self._file.block(block_name, fp)
        for p in pairs:
            key = f"{block_name}.{p.prev_name}"
            if key not in scales:
                raise QuantspecError(f"AWQ scales file lacks {key}.scales.", "drop --load-scales.")
            s = scales[key].to(p.linears[0].weight.device)
            fold_scales(p, s)
            self._saved[f"{key}.scales"] = s.cpu()
        self._saved.update({f"{k}.clip": v for k, v in clips.items()})
        return clips

    def _search(self, ctx: BlockContext, rel: dict[str, QuantScheme], pairs: list[ResolvedPair],
                info: dict[str, dict]) -> dict[str, torch.Tensor]:
        block, block_name, inputs, kwargs, reducer = ctx.block, ctx.name, ctx.inputs, ctx.kwargs, ctx.reducer
        opts = self.options
        share = reducer.share(inputs.shape[0])
        seqs = share.local(self._search_seqs(share.total, inputs.shape[1]))
        parents = _agreed(capture_parents(block, inputs, kwargs, pairs, seqs), reducer)
        modules = {f"{block_name}.{p.linear_names[0]}": p.linears[0] for p in pairs}
        clip_mods = {f"{block_name}.{r}": block.get_submodule(r) for r, scheme in rel.items()
                     if clip_wanted(opts.awq.clip, scheme) and not r.endswith(tuple(opts.clip_skip))}
        tokens = max(opts.search_tokens, opts.clip_tokens if clip_mods else 0)
        stats = collect_input_stats(block, block_name, inputs, kwargs, {**modules, **clip_mods}, tokens, reducer)
        # inputs of Linears change with each fold (x -> x / s for the pair's Linears)
        samples = {n: st.sample for n, st in stats.items()}
        parts = {n: st.sample_part for n, st in stats.items()}  # where they lie in all processes' samples
        scales = []
        precision = forward_precision(block, opts.awq.search_dtype)
        for p, parent in zip(pairs, parents):
            key = f"{block_name}.{p.linear_names[0]}"
            x = spread(samples[key], opts.search_tokens, parts[key]) if parent is None else None
            planned = {n: rel[n] for n in p.linear_names if n in rel}
            objective = PairObjective(p, planned, x, parent, precision=precision, reducer=reducer)
            w_mean = None
            if opts.awq.duo_scaling:
                scheme = next(iter(planned.values()))
                w_mean = weight_group_mean([lin.weight for lin in p.linears], scheme)
            plain = opts.awq.duo_scaling is not True  # False: the paper's only; "both": the union
            s, found_info = self.probe.scale(key, stats[key].absmean, lambda: search_scale(
                stats[key].absmean, objective, opts.awq.grid, w_mean, plain, bounded=not reducer.active))
            fold_scales(p, s)
            scales.append(s)
            for n in p.linear_names:
                full = f"{block_name}.{n}"
                if full in samples:
                    samples[full] = samples[full] / s.to(samples[full])[None, :]
                if n in rel:
                    info.setdefault(full, {}).update(
                        {"awq_alpha": found_info["alpha"], "awq_duo": found_info["duo"],
                         "awq_loss": found_info["loss"], "awq_loss_rtn": found_info["loss_rtn"],
                         "awq_objective": "parent" if parent is not None else "linears"}
                    )
            self._saved[f"{block_name}.{p.prev_name}.scales"] = s.cpu()
        found = {}
        for full, mod in clip_mods.items():
            r = full[len(block_name) + 1 :]
            x = spread(samples[full], opts.clip_tokens, parts[full])
            errors, amax = clip_error_curve(mod.weight, x, rel[r])
            errors = reducer.mean(errors, x.shape[0])[0]  # a mean over this process's tokens
            self.probe.clip_curve(full, errors, amax)
            found[r] = pick_clip(errors, amax, min_gain=opts.awq.clip_min_gain)
        clips = {}
        for p, parent, s in _clip_checks(block, pairs, parents, scales, found):
            first = f"{block_name}.{p.linear_names[0]}"
            x = None if parent is not None else spread(samples[first], opts.search_tokens, parts[first])
            for n, (clip, gain) in keep_helpful_clips(p, rel, x, parent, s, found, precision, reducer).items():
                full = f"{block_name}.{n}"
                info.setdefault(full, {})["clip_gain"] = gain
                if clip is not None:
                    clips[full] = clip
        if clips and opts.clip_check_seqs:
            held = self._held_out(share, inputs.shape[1])
            plain, clipped = block_errors(block, rel, {f[len(block_name) + 1 :]: c for f, c in clips.items()},
                                          inputs[held], kwargs, reducer)
            for full in clips:
                info[full]["clip_block_gain"] = plain / clipped if clipped > 0 else float("inf")
            if clipped >= plain:
                clips = {}
        for full, clip in clips.items():
            self._saved[f"{full}.clip"] = clip.cpu()
        return clips


def _agreed(parents: list, reducer: Reducer) -> list:
    """Each pair's consuming module where every process found it (a process without search
    sequences finds it with no calls), else None everywhere: every process scores the same
    objective."""
    return [p if reducer.all_true(p is not None) else None for p in parents]


def _clip_checks(block: nn.Module, pairs, parents, scales, found):
    """(pair, parent, folded scale) for each pair holding a clipped Linear; a Linear in no pair
    (e.g. o_proj under grouped-query attention) is judged on its own output."""
    covered = set()
    for p, parent, s in zip(pairs, parents, scales):
        if any(n in found for n in p.linear_names):
            covered.update(p.linear_names)
            yield p, parent, s
    for n in found:
        if n not in covered:
            yield ResolvedPair("", None, (n,), (block.get_submodule(n),)), None, None


def recipe_fingerprint(recipe: "Recipe", with_clip: Any) -> dict:
    """What a scales file must have been made with to be reused by ``recipe``."""
    return {"method": recipe.method, "scheme": recipe.scheme.to_dict(),
            "grid": recipe.awq.grid, "duo_scaling": recipe.awq.duo_scaling, "clip": with_clip,
            "clip_min_gain": recipe.awq.clip_min_gain if with_clip is not False else None,
            "ignore": list(recipe.ignore), "targets": list(recipe.targets)}


def method_from_recipe(recipe: "Recipe") -> AWQMethod:
    """AWQ with the recipe's options (grid, clip, save_scales, load_scales)."""
    return AWQMethod(AWQSettings(awq=recipe.awq), recipe_fingerprint=recipe_fingerprint(recipe, recipe.awq.clip))


def smoother_from_recipe(recipe: "Recipe") -> AWQMethod:
    """AWQ's scales only (clip off: the rounder after it picks its own grid), as the smoothing
    step of a composed method (awq+gptq)."""
    from dataclasses import replace

    return AWQMethod(AWQSettings(awq=replace(recipe.awq, clip=False), quantize=False),
                     recipe_fingerprint=recipe_fingerprint(recipe, False))
