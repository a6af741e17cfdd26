"""What the engine scripts share (imported in each engine's own venv: torch only)."""

from __future__ import annotations

import json
import os
import sys
import traceback


def topk(logits, k):
    """Top-``k`` {token id: logprob} of each row of ``logits``."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = lp.topk(k, dim=-1)
    return [{str(int(a)): float(b) for a, b in zip(ii, vv)} for ii, vv in zip(i.tolist(), v.tolist())]


def logprobs_and_greedy(hf, job: dict) -> tuple[list, list]:
    """For each prompt of ``job``: top-K logprobs at every position, and the greedy continuation."""
    import torch

    k = int(job.get("top_k", 20))
    plps, greedy = [], []
    with torch.inference_mode():
        for ids in job["prompts"]:
            plps.append(topk(hf(input_ids=torch.tensor([ids])).logits[0], k))
            greedy.append(greedy_continuation(hf, ids, int(job.get("max_new_tokens", 16))))
    return plps, greedy


def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, each from a full recompute (exact, no cache subtleties)."""
    import torch

    cur, gen = list(ids), []
    for _ in range(n):
        nxt = int(model(input_ids=torch.tensor([cur])).logits[0, -1].float().argmax())
        gen.append(nxt)
        cur.append(nxt)
    return gen


def run_main(actions: dict, package: str) -> None:
    """``script JOB.json RESULT.json``: run ``actions[job["action"]]`` (default "load"), write its
    result (or the error) as JSON with ``<package>_version``, exit without waiting for children."""
    job = json.load(open(sys.argv[1]))
    try:
        mod = __import__(package)
        res = actions[job.get("action", "load")](job)
        res[f"{package}_version"] = mod.__version__
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-6000:]}
    json.dump(res, open(sys.argv[2], "w"))
    sys.stdout.flush()
    os._exit(0 if res["ok"] else 1)
