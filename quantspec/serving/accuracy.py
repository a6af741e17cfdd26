"""Accuracy taken through the serving engine: the engine's kernels compute the number.

``server_perplexity`` scores the windows of quantspec's own perplexity protocol
(eval/perplexity.py: the same token ids, windows and scored positions) from the prompt
log-probabilities the completions endpoint returns with ``echo`` and ``logprobs``, so it sits
beside ``quantspec eval --ppl`` of the same checkpoint. ``server_lm_eval`` runs lm-eval tasks
through lm-eval's ``local-completions`` model against the same endpoint.
"""

from __future__ import annotations

import math
import time

from ..errors import QuantspecError
from .client import Endpoint, get_json


def window_logprobs(endpoint: Endpoint, ids: list[int]) -> list[float | None]:
    """The engine's log-probability of each token of ``ids`` given the ones before it (None for
    the first), from one ``echo`` completion of one token."""
    body = {"model": endpoint.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True,
            "logprobs": 1}
    out = get_json(endpoint, "/v1/completions", body)
    lps = out["choices"][0]["logprobs"]["token_logprobs"]
    if len(lps) < len(ids):
        raise ValueError(f"the engine returned {len(lps)} prompt log-probabilities for {len(ids)} tokens")
    return lps[:len(ids)]


def server_perplexity(endpoint: Endpoint, tokenizer, data: str = "wikitext2", seqlen: int = 512,
                      windows: int = 40, progress=None) -> dict:
    """Perplexity through the server on ``data`` with the protocol of ``eval.perplexity``
    (non-overlapping windows of ``seqlen`` tokens, all but each window's first token scored)."""
    from ..data.sources import load_text
    from ..data.tokens import cached_token_ids
    from ..eval.perplexity import window_starts

    source = load_text(data)
    ids = cached_token_ids(tokenizer, source)
    starts = window_starts(ids.numel(), seqlen, seqlen, windows)
    if not starts:
        raise QuantspecError(f"'{source.label}' has {ids.numel()} tokens, fewer than one window of {seqlen}.",
                             "lower --ppl-seqlen or use a longer text")
    t0 = time.perf_counter()
    nll, scored = 0.0, 0
    for j, s in enumerate(starts):
        lps = window_logprobs(endpoint, ids[s:s + seqlen].tolist())
        nll -= sum(lps[1:])
        scored += seqlen - 1
        if progress:
            progress(j + 1, len(starts), math.exp(nll / scored))
    return {"ppl": math.exp(nll / scored), "nll": nll / scored, "seqlen": seqlen, "windows": len(starts),
            "tokens": scored, "data": source.label, "seconds": round(time.perf_counter() - t0, 3),
            "computed_by": "engine (prompt logprobs through /v1/completions)"}


def server_lm_eval(endpoint: Endpoint, tokenizer_path: str, tasks: list[str], *, limit: float | None = None,
                   num_concurrent: int = 1, num_fewshot: int | None = None, seed: int = 0,
                   include_path: str | None = None) -> dict:
    """lm-eval tasks through the endpoint (lm-eval's ``local-completions`` model)."""
    from ..eval.lmeval_adapter import _require_lm_eval, run_lm_eval

    _require_lm_eval()
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(
        base_url=f"{endpoint.base.rstrip('/')}/v1/completions", model=endpoint.model, tokenizer=tokenizer_path,
        tokenizer_backend="huggingface", num_concurrent=num_concurrent, max_retries=3, tokenized_requests=False)
    return run_lm_eval(endpoint.base, tasks, limit=limit, num_fewshot=num_fewshot, seed=seed, lm=lm,
                       include_path=include_path,
                       kernels={"backend": "engine", "activations": "as the engine computes them"})
