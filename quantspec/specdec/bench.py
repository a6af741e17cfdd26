"""Benchmark on the same prompts, in one run: the target alone (greedy ``generate``), our
speculative decoding, and transformers' assisted generation with the same draft
(``assistant_model=`` for a model draft, ``prompt_lookup_num_tokens=`` for n-gram lookup).

Modes run one after the other on each prompt (interleaved, so that load on a shared machine
hits all alike). Every greedy output is compared with the target's own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import QuantspecError
from .loop import fast_verify_default, speculative_generate
from .proposers import DraftModel, NGram, Proposer
from .stats import SpecStats


@dataclass
class ModeResult:
    """Totals of one mode over all prompts."""

    tokens: int = 0
    wall_s: float = 0.0
    mismatches: list[str] = field(default_factory=list)
    stats: SpecStats | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def load_prompts(path: str | Path, kinds: list[str] | None = None) -> list[dict]:
    """JSONL rows ``{"id", "kind", "prompt"}``, optionally only the given kinds."""
    path = Path(path)
    if not path.is_file():
        raise QuantspecError(f"prompts file {path} does not exist.", "pass --prompts FILE.jsonl.")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
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
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


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
) -> dict:
    """Greedy benchmark; returns a JSON-ready dict (per mode and per prompt).

    progress: optional callable(str) for one line per prompt. fast_verify: passed to
    ``speculative_generate``; when on, the mode ``target_fast`` also times the target alone
    through the same runtime (k = 0: one token per step), to show what the runtime gives
    without speculation.
    """
    device = next(target.parameters()).device
    if fast_verify is None:
        fast_verify = fast_verify_default(target)
    hf_kwargs = _hf_kwargs(proposer, k, adaptive) if hf else None
    modes = {"target": ModeResult(), "ours": ModeResult(stats=SpecStats())}
    if fast_verify:
        modes["target_fast"] = ModeResult()
    if hf_kwargs is not None:
        modes["hf_assisted"] = ModeResult()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad)
    per_prompt = []
    with torch.inference_mode():
        warm = encode(tokenizer, prompts[0]["prompt"], chat).to(device)
        target.generate(warm, attention_mask=torch.ones_like(warm), **{**common, "max_new_tokens": 8})
        speculative_generate(target, proposer, warm, max_new_tokens=8, k=k, adaptive=adaptive,
                             fast_verify=fast_verify)
        for row in prompts:
            ids = encode(tokenizer, row["prompt"], chat).to(device)
            mask = torch.ones_like(ids)
            ref, t_ref = _timed(lambda: target.generate(ids, attention_mask=mask, **common))
            (ours, st), t_ours = _timed(lambda: speculative_generate(
                target, proposer, ids, mask, max_new_tokens=max_new_tokens, k=k, adaptive=adaptive,
                fast_verify=fast_verify))
            n = ref.shape[1] - ids.shape[1]
            rec = {"id": row.get("id"), "kind": row.get("kind"), "prompt_tokens": ids.shape[1],
                   "new_tokens": n, "target_s": round(t_ref, 4), "ours_s": round(t_ours, 4),
                   "ours": st.to_dict()}
            _add(modes["target"], n, t_ref)
            same = _same(ours, ref)
            _add(modes["ours"], st.new_tokens, t_ours, same, row)
            if not same:
                rec["divergence"] = divergence(target, ours, ref, ids.shape[1])
            modes["ours"].stats = modes["ours"].stats.merge(st)
            if fast_verify:
                (out, st_fast), t_fast = _timed(lambda: speculative_generate(
                    target, proposer, ids, mask, max_new_tokens=max_new_tokens, k=0, fast_verify=True))
                _add(modes["target_fast"], st_fast.new_tokens, t_fast, _same(out, ref), row)
                rec["target_fast_s"] = round(t_fast, 4)
            if hf_kwargs is not None:
                out, t_hf = _timed(lambda: target.generate(ids, attention_mask=mask, **common, **hf_kwargs))
                _add(modes["hf_assisted"], out.shape[1] - ids.shape[1], t_hf, _same(out, ref), row)
                rec["hf_assisted_s"] = round(t_hf, 4)
            per_prompt.append(rec)
            if progress:
                progress(f"{row.get('id')}: {n} tokens, target {t_ref:.2f}s, ours {t_ours:.2f}s"
                         + (f", hf {rec['hf_assisted_s']:.2f}s" if "hf_assisted_s" in rec else ""))
    return _summary(modes, per_prompt, target, proposer, max_new_tokens, k, adaptive)


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


def _add(mode: ModeResult, tokens: int, wall: float, same: bool = True, row: dict | None = None):
    mode.tokens += tokens
    mode.wall_s += wall
    if not same:
        mode.mismatches.append(str(row.get("id")))


def _summary(modes, per_prompt, target, proposer, max_new_tokens, k, adaptive) -> dict:
    base = modes["target"].tokens_per_s
    out = {
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "draft": getattr(proposer, "name", type(proposer).__name__),
        "max_new_tokens": max_new_tokens, "k": k, "adaptive": adaptive,
        "threads": torch.get_num_threads(), "modes": {}, "prompts": per_prompt,
    }
    for name, m in modes.items():
        entry = {"tokens": m.tokens, "wall_s": round(m.wall_s, 3),
                 "tokens_per_s": round(m.tokens_per_s, 3),
                 "speedup": round(m.tokens_per_s / base, 3) if base else None,
                 "greedy_matches_target": not m.mismatches, "mismatched_prompts": m.mismatches}
        if m.stats is not None:
            entry.update({key: m.stats.to_dict()[key] for key in
                          ("acceptance_rate", "mean_accepted", "tokens_per_call", "hist",
                           "target_calls", "draft_calls", "mean_k")})
        out["modes"][name] = entry
    return out


def format_table(result: dict) -> str:
    """One Markdown table: tokens/s, speed-up vs target, acceptance, mean accepted per call."""
    lines = ["| mode | tokens | tokens/s | speed-up | acceptance | accepted/call | greedy == target |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    where = {str(p.get("id")): p["divergence"] for p in result.get("prompts", []) if p.get("divergence")}

    def named(pid: str, mode: str) -> str:
        d = where.get(pid) if mode == "ours" else None
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
