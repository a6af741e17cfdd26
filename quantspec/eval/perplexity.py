"""Perplexity with the GPTQ/AWQ papers' protocol (DESIGN.md, "Perplexity protocol").

Tokenize the whole joined text once (ids cached on disk per tokenizer and dataset), cut it into
windows of ``seqlen`` tokens, score the first ``windows`` windows, and report
ppl = exp(mean NLL over all scored tokens).

Windows. With ``stride == seqlen`` (the default and the papers' protocol) windows do not
overlap: window j is ids[j*seqlen : (j+1)*seqlen] and all its seqlen-1 next-token
predictions are scored (the first token of each window has no context and is not scored).
With ``stride < seqlen`` (sliding windows) window j is ids[j*stride : j*stride + seqlen];
window 0 scores all its seqlen-1 predictions and every later window scores only its last
``stride`` tokens (the ones no earlier window scored), so each of those tokens sees at least
seqlen-stride tokens of context. Only full windows are used; the tail is dropped.
Reference numbers: Frantar et al. 2022 (GPTQ), Lin et al. 2023 (AWQ), seqlen 2048.

Every result names the kernels that computed it (``kernels_used``): a quantized model loaded with
``backend="auto"`` on a CPU runs weight-only layers on rounded activations (a speed path), which
is not the scheme the checkpoint declares; load with ``backend="exact"`` to measure that scheme.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ..data.sources import TextSource, load_text
from ..data.tokens import cached_token_ids
from ..errors import QuantspecError
from ..kernels.backend import computes_declared_scheme
from ..kernels.quant_linear import QuantLinear
from ..models.source import check_context
from ..runtime.kv import cache_kwarg
from ..runtime.kv_quant import QuantKVCache, resolve_kv

AS_DECLARED = "as declared"


def window_starts(total: int, seqlen: int, stride: int, windows: int | None) -> list[int]:
    """Start offsets of the full windows of ``seqlen`` tokens, ``stride`` apart, at most ``windows``."""
    count = 0 if total < seqlen else (total - seqlen) // stride + 1
    if windows is not None:
        count = min(count, windows)
    return [j * stride for j in range(count)]


def _validate(seqlen: int, windows: int | None, stride: int, batch_size: int) -> None:
    if seqlen < 2:
        raise QuantspecError(f"seqlen must be at least 2, got {seqlen}.", "pass --seqlen 512 or more.")
    if not 1 <= stride <= seqlen:
        raise QuantspecError(f"stride must be between 1 and seqlen ({seqlen}), got {stride}.",
                             "leave stride unset for non-overlapping windows, or pass a smaller stride.")
    if windows is not None and windows < 1:
        raise QuantspecError(f"windows must be at least 1 (or None for all), got {windows}.", "pass a positive count.")
    if batch_size < 1:
        raise QuantspecError(f"batch_size must be at least 1, got {batch_size}.", "pass a positive batch size.")


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def kernels_used(model) -> dict:
    """Which kernels computed ``model``'s quantized layers, to record beside an accuracy number.

    {"backend": the backends' names joined by "," ("torch dense" for a model without quantized
    layers), "activations": "as declared", or how many weight-only layers ran on rounded
    activations or scales (a speed path that is not the checkpoint's scheme)}.
    """
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return {"backend": "torch dense", "activations": AS_DECLARED}
    names = [m.backend_name or "unprepared" for m in layers]
    rounded = sum(not computes_declared_scheme(n, m.scheme) for n, m in zip(names, layers))
    activations = AS_DECLARED if not rounded else (
        f"rounded on {rounded} of {len(layers)} quantized layers (a speed path that rounds the activations "
        "or the scales, not the declared scheme)")
    return {"backend": ",".join(sorted(set(names))), "activations": activations}


def window_nll(logits: torch.Tensor, ids: torch.Tensor, scored: int) -> torch.Tensor:
    """Summed NLL (float64 scalar) of the last ``scored`` targets of each row.

    logits: [B, L, V] for ids [B, L]; position t predicts ids[:, t+1]; scored <= L-1.
    """
    pred = logits[:, -scored - 1 : -1, :].float()
    target = ids[:, -scored:]
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="sum")
    return nll.double()


@torch.inference_mode()
def perplexity(model, tokenizer, data: str | TextSource, seqlen: int = 512, windows: int | None = 40,
               stride: int | None = None, progress: bool = True, batch_size: int = 1,
               kv_cache: str = "checkpoint", kv_scales: str = "calibrated") -> dict:
    """Perplexity of ``model`` on ``data`` (a load_text name/path or a TextSource).

    kv_cache / kv_scales: the KV cache attention reads (``runtime.kv_quant.resolve_kv``): by
    default what the checkpoint declares (its calibrated FP8/int8 scales, else unquantized);
    the result's ``kv_cache`` names it.

    Returns {"ppl", "nll" (mean per scored token), "seqlen", "windows" (used), "stride",
    "tokens" (scored tokens), "data" (label), "seconds", "kernels" (``kernels_used``)}. Raises
    QuantspecError when the text is shorter than one window.
    """
    stride = seqlen if stride is None else stride
    _validate(seqlen, windows, stride, batch_size)
    check_context(getattr(model, "config", None), seqlen, "the perplexity window (--seqlen)", "use --seqlen {context} or less.")
    source = data if isinstance(data, TextSource) else load_text(data)
    ids = cached_token_ids(tokenizer, source)
    starts = window_starts(ids.numel(), seqlen, stride, windows)
    if not starts:
        raise QuantspecError(f"'{source.label}' has {ids.numel()} tokens, fewer than one window of {seqlen}.",
                             "lower seqlen or use a longer text.")
    device = _model_device(model)
    kv = resolve_kv(model, kv_cache, kv_scales)
    was_training = getattr(model, "training", False)
    model.eval()
    total_nll, total_tokens = 0.0, 0
    start_time = time.perf_counter()
    bar = _progress(len(starts), source.label, seqlen, progress)
    try:
        for b in range(0, len(starts), batch_size):
            chunk = starts[b : b + batch_size]
            batch = torch.stack([ids[s : s + seqlen] for s in chunk]).to(device)
            extra = {} if kv is None else {cache_kwarg(model): QuantKVCache(*kv, config=model.config), "use_cache": True}
            logits = model(input_ids=batch, **extra).logits
            for row, s in enumerate(chunk):
                scored = seqlen - 1 if s == 0 or stride >= seqlen else stride
                total_nll += float(window_nll(logits[row : row + 1], batch[row : row + 1], scored))
                total_tokens += scored
            bar.update(len(chunk))
            bar.set_postfix(ppl=f"{math.exp(total_nll / total_tokens):.3f}")
    finally:
        bar.close()
        model.train(was_training)
    nll = total_nll / total_tokens
    return {"ppl": math.exp(nll), "nll": nll, "seqlen": seqlen, "windows": len(starts), "stride": stride,
            "tokens": total_tokens, "data": source.label, "seconds": round(time.perf_counter() - start_time, 3),
            "kernels": kernels_used(model),
            "kv_cache": None if kv is None else {"kind": kv[0].kind, "scales": kv[0].scales}}


def _progress(total: int, label: str, seqlen: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"ppl {label} @ {seqlen}", unit="win", disable=not enabled, leave=False)
