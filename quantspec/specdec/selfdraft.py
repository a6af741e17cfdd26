"""QuantizedSelf: the target, quantized by this library, as its own draft.

``quantize_in_memory`` deep-copies the target and quantizes it with ``quantspec.quantize_model``
(RTN, the GPTQ format, the fastest kernel backend here), so the draft quantizes exactly the
layers a checkpoint would. A checkpoint folder goes through ``quantspec.load_quantized``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import QuantspecError
from ..quant.arch import head_name
from ..core.scheme import QuantScheme
from .draft_vocab import PrunedHead, output_head, prune_head, wrap_head
from .proposers import DraftModel


def quantize_in_memory(
    model: nn.Module,
    scheme: QuantScheme,
    include_lm_head: bool = True,
    fmt: str = "gptq",
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    head_scheme: QuantScheme | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[nn.Module, dict]:
    """A quantized copy of ``model`` (RTN, ``quantspec.quantize_model``) and its report.

    include_lm_head: the draft may quantize the output projection too (a large share of a
    small model's weights), with ``head_scheme`` (default: ``scheme``); the target itself is
    never changed. dtype: the copy's compute dtype (default: the model's); a bf16 draft of an
    fp32 target reads half the bytes in the layers it leaves dense. token_ids: the copy's head
    keeps these rows only (``draft_vocab.prune_head``; the caller wraps it).
    """
    from ..quant.api import quantize_model
    from ..quant.recipe import Recipe

    draft = copy.deepcopy(model).eval()  # a tied lm_head is swapped, the embedding stays
    if dtype is not None:
        draft = draft.to(dtype)
    head = head_name(draft)
    if token_ids is not None:
        prune_head(draft, token_ids)
    if head_scheme is not None and include_lm_head and head is not None:
        _check_head_scheme(draft.get_submodule(head), head_scheme)
    recipe = Recipe(name="self-draft", method="rtn", format=fmt, scheme=scheme,
                    ignore=() if include_lm_head else ("lm_head",))
    overrides = {head: head_scheme} if head_scheme is not None and head is not None else None
    draft, report = quantize_model(draft, recipe, backend=backend, overrides=overrides)
    report.pop("layers")
    return draft, report


def _check_head_scheme(head: nn.Module, scheme: QuantScheme) -> None:
    k = head.weight.shape[1]
    if scheme.group_size > 0 and k % scheme.group_size:
        raise QuantspecError(
            f"the output head's {k} inputs do not split into groups of {scheme.group_size}.",
            "use a per-channel head scheme (e.g. w8gpc) or a group size that divides it.",
        )


# The output head of a draft at 8 bits per channel, chosen on validation prompts
# (benchmarks/specdec_prompts_validation.jsonl; benchmarks/results/specdec-draft-head.md): on
# SmolLM2-135M it agrees with the target as often as the dense head (RTN W4 g128 body 0.744 vs
# 0.744, AWQ+GPTQ W4 g32 body 0.894 vs 0.886) at half the bytes of bf16; a W4 g128 head drops to 0.689.
DRAFT_HEAD = QuantScheme(bits=8, group_size=-1)


class QuantizedSelf(DraftModel):
    """A DraftModel over a quantized copy of the target (or a quantized checkpoint of it): it
    starts each batch from the target's cache of the prompt and takes the target's keys and values
    of each step's committed tokens (``DraftModel.adopt_prompt``, ``adopt_accepted``)."""

    def __init__(self, model: nn.Module, name: str = "self", report: dict | None = None,
                 pruned: PrunedHead | None = None):
        super().__init__(model, name=name, pruned=pruned, shares_cache=True)
        self.report = report or {}

    @classmethod
    def from_target(
        cls, target: nn.Module, scheme: QuantScheme | None = None, include_lm_head: bool = True,
        dtype: torch.dtype | None = None, head_scheme: QuantScheme | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> "QuantizedSelf":
        """head_scheme: the output head's (default: ``scheme``; see ``DRAFT_HEAD``). token_ids:
        the head scores these tokens, and those of the text it continues (``draft_vocab``)."""
        scheme = scheme or QuantScheme(bits=4, group_size=128)
        draft, report = quantize_in_memory(target, scheme, include_lm_head=include_lm_head,
                                           dtype=dtype, head_scheme=head_scheme, token_ids=token_ids)
        pruned = _wrap(draft, target, token_ids, report)
        return cls(draft, name=f"self:{scheme.short_name}", report=report, pruned=pruned)

    @classmethod
    def from_checkpoint(cls, path: str, target: nn.Module, dtype: torch.dtype | None = None,
                        head_scheme: QuantScheme | None = None,
                        token_ids: torch.Tensor | None = None) -> "QuantizedSelf":
        """head_scheme: quantize the checkpoint's output head in memory when it is dense
        (checkpoints keep it dense; a draft reads it every token). token_ids: as ``from_target``."""
        from ..checkpoint.load import load_quantized

        device = next(target.parameters()).device
        dtype = dtype or next(target.parameters()).dtype
        model = load_quantized(path, dtype=dtype, device=device)
        report = {"backends": dict(getattr(model, "quantspec_backends", {}))}
        head = head_name(model)
        if token_ids is not None:
            prune_head(model, token_ids)
        if head_scheme is not None and head is not None and type(model.get_submodule(head)) is nn.Linear:
            from ..quant.api import quantize_model
            from ..quant.recipe import Recipe

            _check_head_scheme(model.get_submodule(head), head_scheme)
            recipe = Recipe(name="draft-head", method="rtn", format="gptq", scheme=head_scheme,
                            targets=(head,), ignore=())
            report["backends"].update(quantize_model(model, recipe)[1]["backends"])
            report["head"] = head_scheme.short_name
        pruned = _wrap(model, target, token_ids, report)
        return cls(model, name=f"self:{path}", report=report, pruned=pruned)


def _wrap(draft: nn.Module, target: nn.Module, token_ids: torch.Tensor | None, report: dict):
    """The draft's pruned head wrapped (tokens it brings in read from the target's dense head),
    or None without ``token_ids``; the report says how many tokens it keeps."""
    if token_ids is None:
        return None
    source = target.get_submodule(output_head(target))
    report["draft_vocab"] = int(token_ids.numel())
    return wrap_head(draft, token_ids, int(source.out_features), source)
