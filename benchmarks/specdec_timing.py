"""A timed, interleaved speculative-decoding run and its table (draft_vocab.py,
specdec_drafts.py): the target alone as the base mode, every mode on every prompt in every repeat
(``specdec.schedule``), per mode the medians over repeats (tokens/s, speed-up over ``target``)
and for speculative modes the merged statistics of every prompt's run; the raw JSON and the
markdown table written side by side."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HEADER = [("| mode | tokens/s | speed-up vs target | tokens per call | acceptance | draft ms / step | "
           "verify ms / call | greedy == target |"),
          "|---|---:|---:|---:|---:|---:|---:|---:|"]


PLAIN = ("target", "target_fast")  # the target alone: no draft statistics


def mode_rows(modes, timings, outputs, n_inputs: int) -> dict[str, dict]:
    """One row per mode of ``run_interleaved``'s ``timings`` and ``outputs``."""
    from quantspec.specdec.bench import _same
    from quantspec.specdec.schedule import mode_medians
    from quantspec.specdec.stats import SpecStats

    medians = mode_medians(timings, base="target")
    rows = {}
    for name in modes:
        runs = [outputs[(name, i)] for i in range(n_inputs)]
        same = sum(_same(r.ids, outputs[("target", i)].ids) for i, r in enumerate(runs))
        row = {**medians[name], "greedy_matches_target": same}
        if name not in PLAIN:
            stats = SpecStats()
            for r in runs:
                stats = stats.merge(r.stats)
            d = stats.to_dict()
            row.update({key: d[key] for key in ("acceptance_rate", "tokens_per_call", "target_calls", "draft_calls",
                                                "draft_s", "target_s")})
            row["draft_ms_per_step"] = round(1e3 * d["draft_s"] / max(1, d["draft_calls"]), 2)
            row["target_ms_per_call"] = round(1e3 * d["target_s"] / max(1, d["target_calls"]), 2)
        rows[name] = row
    return rows


def table_lines(rows: dict[str, dict], n_inputs: int) -> list[str]:
    lines = list(HEADER)
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {r['speedup']:.3f}x | {r.get('tokens_per_call', 1.0):.2f} | "
                     f"{r.get('acceptance_rate', '-')} | {r.get('draft_ms_per_step', '-')} | "
                     f"{r.get('target_ms_per_call', '-')} | {r['greedy_matches_target']}/{n_inputs} |")
    return lines


def prompts_line(prompts: str, n_inputs: int, max_new_tokens: int, repeats: int, threads: int) -> str:
    return (f"Greedy, {n_inputs} prompts of {Path(prompts).name}, {max_new_tokens} new tokens, "
            f"{repeats} interleaved repeats, {threads} thread(s); medians over repeats.")


def add_run_arguments(p, prompts: Path, repeats: int) -> None:
    """The options every timed run takes (prompts, tokens, dtype, repeats, threads, output)."""
    p.add_argument("--prompts", default=str(prompts))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", required=True, help="result stem under --out")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")


def load_run(args):
    """(target, tokenizer, description, prompt rows, encoded chat prompts, pad id) of ``args``."""
    import torch

    from quantspec.models.load import load_model
    from quantspec.specdec.bench import encode, load_prompts

    torch.set_num_threads(args.threads)
    target, tok, desc = load_model(args.target, dtype=args.dtype)
    prompts = load_prompts(args.prompts)
    inputs = [encode(tok, row["prompt"], True) for row in prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return target, tok, desc, prompts, inputs, pad


def target_mode(target, inputs, max_new_tokens: int, pad: int):
    """The base mode: the target alone through transformers' ``generate`` (what a user runs)."""
    import torch

    from quantspec.specdec.bench import Run

    def run(i: int) -> Run:
        out = target.generate(inputs[i], attention_mask=torch.ones_like(inputs[i]), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=pad)
        return Run(out, out.shape[1] - inputs[i].shape[1])
    return run


def spec_mode(target, proposer, inputs, max_new_tokens: int, k: int, tree=None, fast_verify=None):
    """A mode: ``speculative_generate`` with ``proposer`` (k = 0: the target alone, one token per step)."""
    from quantspec.specdec import speculative_generate
    from quantspec.specdec.bench import Run

    def run(i: int) -> Run:
        out, st = speculative_generate(target, proposer, inputs[i], max_new_tokens=max_new_tokens, k=k, tree=tree,
                                       fast_verify=fast_verify)
        return Run(out, st.new_tokens, st)
    return run


def run_modes(modes, inputs, prompts: list[dict], repeats: int):
    """Warm every mode up on the first prompt (untimed), then time them interleaved; returns
    (rows, timings)."""
    import torch

    from quantspec.specdec.schedule import run_interleaved

    with torch.inference_mode():
        for run in modes.values():
            run(0)
        timings, outputs = run_interleaved(
            modes, len(inputs), repeats,
            progress=lambda r, i, s: print(f"repeat {r + 1} {prompts[i].get('id')}: "
                                           + ", ".join(f"{m} {x:.2f}s" for m, x in s.items()),
                                           file=sys.stderr, flush=True))
    return mode_rows(modes, timings, outputs, len(inputs)), timings


def write_result(out: Path, name: str, title: str, result: dict, args, n_inputs: int) -> None:
    """``NAME.json`` (``result``, which holds ``command``, ``machine`` and ``rows``) and ``NAME.md``."""
    from quantspec.eval.machine import machine_line

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    lines = [title, "",
             (f"Command: `{result['command']}`; raw: {name}.json; {machine_line(result['machine'])}; "
              f"{time.strftime('%Y-%m-%d')}."),
             prompts_line(args.prompts, n_inputs, args.max_new_tokens, args.repeats, args.threads), "",
             *table_lines(result["rows"], n_inputs)]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
