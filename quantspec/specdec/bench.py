"""Benchmark on the same prompts, in one run: the target alone (greedy ``generate``), our
speculative decoding, and transformers' assisted generation with the same draft
(``assistant_model=`` for a model draft, ``prompt_lookup_num_tokens=`` for n-gram lookup).

Every mode runs several times on every prompt, interleaved (``schedule.py``: for each repeat,
for each prompt, every mode, their order rotated), so that load on a shared machine hits all
alike; speeds are medians over the repeats. Every greedy output is compared with the target's
own. Given a ``TreeSpec``, the mode ``ours_tree`` times token trees of the same proposer beside
its chains (``ours``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuantspecError
from .loop import fast_verify_default, speculative_generate
from .proposers import DraftModel, NGram, Proposer
from .schedule import mode_medians, run_interleaved
from .stats import SpecStats
from .tree import TreeSpec

SCHEDULE = ("for each repeat, for each prompt, every mode once, rotated by (repeat * prompts + "
            "prompt) mod modes; tokens/s: median over repeats of tokens / seconds summed over "
            "prompts; speedup: median over repeats of the ratio to target in the same repeat")


def load_prompts(path: str | Path, kinds: list[str] | None = None) -> list[dict]:
    """JSONL rows ``{"id", "kind", "prompt"}``, optionally only the given kinds; a line that is
    not such an object, or whose prompt is blank, raises QuantspecError naming the line."""
    from ..data.sources import read_jsonl_rows

    path = Path(path)
    if not path.is_file():
        raise QuantspecError(f"prompts file {path} does not exist.", "pass --prompts FILE.jsonl.")
    rows = []
    for lineno, row in read_jsonl_rows(path, "prompt"):
        if not row["prompt"].strip():
            raise QuantspecError(f"{path} line {lineno} has a blank prompt.", "give every line a prompt, or remove it.")
        rows.append(row)
    if kinds:
        rows = [r for r in rows if r.get("kind") in kinds]
    if not rows:
        raise QuantspecError(f"no prompts in {path} (kinds={kinds}).", "check the file and --kinds.")
    return rows


def encode(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """int64 [1, P]: the prompt, through the chat template when ``chat`` and one exists."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise QuantspecError(f"the prompt {prompt!r} is no tokens (the tokenizer adds no start token).",
                             "give a prompt with text in it.")
    return ids


@dataclass
class Run:
    """One generation of one mode: ids int64 [1, P + n], n new tokens, our stats (ours only)."""

    ids: torch.Tensor
    new_tokens: int
    stats: SpecStats | None = None


def _hf_kwargs(proposer: Proposer, k: int, adaptive: bool) -> dict | None:
    """transformers' own version of our proposer, or None when it has none."""
    if isinstance(proposer, NGram):
        return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": proposer.max_n}
    if isinstance(proposer, DraftModel):
        gc = proposer.model.generation_config
        gc.num_assistant_tokens = k
        gc.num_assistant_tokens_schedule = "heuristic" if adaptive else "constant"
        gc.assistant_confidence_threshold = 0.0
        return {"assistant_model": proposer.model}
    return None


def _modes(target, proposer, inputs: list[torch.Tensor], max_new_tokens: int, k: int,
           adaptive: bool, fast_verify: bool, hf_kwargs: dict | None, pad: int,
           tree: TreeSpec | None = None) -> dict:
    """mode name -> callable(prompt index) -> Run, greedy, each on ``inputs[p]`` [1, P]."""
    common = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad)

    def hf_generate(p: int, extra: dict) -> Run:
        ids = inputs[p]
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)
        return Run(out, out.shape[1] - ids.shape[1])

    def spec(p: int, kk: int, adapt: bool, shape: TreeSpec | None = None) -> Run:
        out, st = speculative_generate(target, proposer, inputs[p], max_new_tokens=max_new_tokens,
                                       k=kk, adaptive=adapt, fast_verify=fast_verify, tree=shape)
        return Run(out, st.new_tokens, st)

    modes = {"target": lambda p: hf_generate(p, {}), "ours": lambda p: spec(p, k, adaptive)}
    if tree is not None:
        modes["ours_tree"] = lambda p: spec(p, k, False, tree)
    if fast_verify:
        modes["target_fast"] = lambda p: spec(p, 0, False)
    if hf_kwargs is not None:
        modes["hf_assisted"] = lambda p: hf_generate(p, hf_kwargs)
    return modes


def run_bench(
    target: torch.nn.Module,
    tokenizer,
    proposer: Proposer,
    prompts: list[dict],
    max_new_tokens: int = 128,
    k: int = 4,
    adaptive: bool = False,
    chat: bool = True,
    hf: bool = True,
    progress=None,
    fast_verify: bool | None = None,
    repeats: int = 3,
    timer=time.perf_counter,
    tree: TreeSpec | None = None,
) -> dict:
    """Greedy benchmark; returns a JSON-ready dict (per mode and per prompt).

    Every mode runs ``repeats`` times on every prompt, interleaved (``schedule.schedule``);
    tokens/s and speed-ups are medians over the repeats (``schedule.mode_medians``). Each mode
    is first warmed up once on the first prompt (8 tokens, untimed). progress: optional
    callable(str), one line per repeat and prompt. fast_verify: passed to
    ``speculative_generate``; when on, the mode ``target_fast`` also times the target alone
    through the same runtime (k = 0: one token per step), to show what the runtime gives
    without speculation. tree: also time the proposer's token trees of this shape (mode
    ``ours_tree``); the result records the shape under "tree".
    """
    if repeats < 1:
        raise QuantspecError(f"repeats={repeats} times nothing.", "use --repeats 1 or more.")
    device = next(target.parameters()).device
    if fast_verify is None:
        fast_verify = fast_verify_default(target)
    hf_kwargs = _hf_kwargs(proposer, k, adaptive) if hf else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = [encode(tokenizer, row["prompt"], chat).to(device) for row in prompts]
    setup = (target, proposer, inputs)
    modes = _modes(*setup, max_new_tokens, k, adaptive, fast_verify, hf_kwargs, pad, tree)

    def report(r: int, p: int, seconds: dict[str, float]) -> None:
        if progress:
            progress(f"repeat {r + 1}/{repeats} {prompts[p].get('id')}: "
                     + ", ".join(f"{m} {s:.2f}s" for m, s in seconds.items()))

    with torch.inference_mode():
        for warm in _modes(*setup, 8, k, adaptive, fast_verify, hf_kwargs, pad, tree).values():
            warm(0)
        timings, outputs = run_interleaved(modes, len(inputs), repeats, timer, report)
    per_prompt = []
    for p, row in enumerate(prompts):
        ref, ours = outputs[("target", p)], outputs[("ours", p)]
        rec = {"id": row.get("id"), "kind": row.get("kind"), "prompt_tokens": inputs[p].shape[1],
               "new_tokens": ref.new_tokens, "ours": ours.stats.to_dict(),
               "seconds": {m: [round(t.seconds, 4) for t in timings if t.mode == m and t.prompt == p]
                           for m in modes}}
        if not _same(ours.ids, ref.ids):
            rec["divergence"] = divergence(target, ours.ids, ref.ids, inputs[p].shape[1])
        if tree is not None:
            ours_tree = outputs[("ours_tree", p)]
            rec["ours_tree"] = ours_tree.stats.to_dict()
            if not _same(ours_tree.ids, ref.ids):
                rec["divergence_tree"] = divergence(target, ours_tree.ids, ref.ids, inputs[p].shape[1])
        per_prompt.append(rec)
    result = _summary(modes, outputs, timings, prompts, target, proposer, max_new_tokens, k, adaptive)
    result["tree"] = tree.to_dict() if tree is not None else None
    result.update(repeats=repeats, prompts=per_prompt)
    return result


def _same(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return out.shape == ref.shape and bool(torch.equal(out.cpu(), ref.cpu()))


@torch.inference_mode()
def divergence(target, out: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> dict | None:
    """Where a greedy output first leaves the target's own, and how close the target's choice was.

    out, ref: [1, P + n] sequences. Returns None when they agree, else {"at": new-token index,
    "target_token", "ours_token", "logit_gap"}: the gap between the two tokens' logits in one
    target forward over the common prefix. A gap within the logits' rounding (bf16: ~1e-2 of
    their scale) is a near-tie that the target's own numerics decide differently at different
    batch shapes (verifying k+1 tokens at once vs one per step), not a wrong acceptance.
    """
    a, b = out[0, prompt_len:].cpu(), ref[0, prompt_len:].cpu()
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if diff.numel() == 0 and len(a) == len(b):
        return None
    at = int(diff[0]) if diff.numel() else n
    if at >= n:  # one stopped earlier
        return {"at": at, "target_token": None, "ours_token": None, "logit_gap": None}
    prefix = ref[:, : prompt_len + at]
    logits = target(prefix.to(next(target.parameters()).device)).logits[0, -1].float().cpu()
    t_tok, o_tok = int(b[at]), int(a[at])
    return {"at": at, "target_token": t_tok, "ours_token": o_tok,
            "logit_gap": round(float(logits[t_tok] - logits[o_tok]), 4)}


def _summary(modes, outputs, timings, prompts, target, proposer, max_new_tokens, k, adaptive) -> dict:
    out = {
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "draft": getattr(proposer, "name", type(proposer).__name__),
        "max_new_tokens": max_new_tokens, "k": k, "adaptive": adaptive,
        "threads": torch.get_num_threads(), "schedule": SCHEDULE, "modes": {},
    }
    medians = mode_medians(timings, base="target")
    refs = [outputs[("target", p)] for p in range(len(prompts))]
    for name in modes:
        runs = [outputs[(name, p)] for p in range(len(prompts))]
        mismatched = [str(row.get("id")) for row, run, ref in zip(prompts, runs, refs)
                      if not _same(run.ids, ref.ids)]
        entry = {"tokens": sum(r.new_tokens for r in runs), **medians[name],
                 "greedy_matches_target": not mismatched, "mismatched_prompts": mismatched}
        if name in ("ours", "ours_tree"):
            stats = SpecStats()
            for r in runs:
                stats = stats.merge(r.stats)
            entry.update({key: stats.to_dict()[key] for key in
                          ("acceptance_rate", "mean_accepted", "tokens_per_call", "hist",
                           "target_calls", "draft_calls", "mean_k", "mean_proposed", "mean_accepted_length", "by_depth")})
        out["modes"][name] = entry
    return out


def format_table(result: dict) -> str:
    """One Markdown table: tokens/s and speed-up vs target (medians over the repeats),
    acceptance, mean accepted per call."""
    reps = result.get("repeats", 1)
    lines = [f"| mode | tokens | tokens/s (median of {reps}) | speed-up (median of {reps}) "
             "| acceptance | accepted/call | greedy == target |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    where = {(mode, str(p.get("id"))): p[key] for p in result.get("prompts", [])
             for mode, key in (("ours", "divergence"), ("ours_tree", "divergence_tree")) if p.get(key)}

    def named(pid: str, mode: str) -> str:
        d = where.get((mode, pid))
        if not d or d["logit_gap"] is None:
            return pid
        return f"{pid} @{d['at']} gap {d['logit_gap']:g}"

    for name, m in result["modes"].items():
        acc = f"{m['acceptance_rate']:.3f}" if "acceptance_rate" in m else "-"
        mean = f"{m['mean_accepted']:.2f}" if "mean_accepted" in m else "-"
        same = "yes" if m["greedy_matches_target"] else (
            "NO (" + ", ".join(named(pid, name) for pid in m["mismatched_prompts"]) + ")")
        lines.append(f"| {name} | {m['tokens']} | {m['tokens_per_s']:.2f} | {m['speedup']:.2f}x "
                     f"| {acc} | {mean} | {same} |")
    return "\n".join(lines)
