"""How much each draft gets accepted, side by side on one target (deterministic: no timing).

Greedy speculative generation of every prompt with every draft at the same k (the same
verification cost: one target forward over k + 1 tokens per step), reporting per draft the
acceptance rate, the mean accepted length (tokens per target call, the bonus token included),
acceptance by depth, and whether the output equals the target's own greedy output. Acceptance
does not depend on the machine's load, so this runs beside anything; speeds come from
``quantspec bench-specdec``.

    python benchmarks/specdec_acceptance.py smollm2-135m --draft eagle:heads/smol --draft self:w4g128 \\
        --draft ngram --k 4 --name specdec-acceptance-smollm2
    # the same drafts on a quantized target (a head trained on that target's features, and not)
    python benchmarks/specdec_acceptance.py out/smol-gptq-w4 --draft eagle:heads/smol-w4 --draft eagle:heads/smol ...
    # each draft also as token trees (KIND:NODES:TOPK, depth k), beside its chain
    python benchmarks/specdec_acceptance.py smollm2-135m --draft self:w4g128 --tree dynamic:8:2 --tree static:8:2 ...

A tree row offers more draft tokens per target call than a chain of k (its nodes), so its
verification costs more: compare tokens per call at the nodes offered (the ``nodes`` column).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    import torch

    from quantspec.eval.machine import describe_machine, machine_line
    from quantspec.models.load import load_model, model_label
    from quantspec.specdec import make_proposer, speculative_generate
    from quantspec.specdec.bench import encode, load_prompts
    from quantspec.specdec.stats import SpecStats

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--draft", action="append", required=True, help="a proposer spec (repeatable)")
    p.add_argument("--prompts", default=str(HERE / "specdec_prompts.jsonl"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tree", action="append", default=[], metavar="KIND:NODES:TOPK",
                   help="also draft token trees of depth --k (static|dynamic); repeatable")
    p.add_argument("--name", required=True, help="result stem under --out")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    trees = [None] + [tree_spec(t, args.k) for t in args.tree]
    target, tok, desc = load_model(args.target, dtype=args.dtype)
    prompts = load_prompts(args.prompts)
    inputs = [encode(tok, row["prompt"], args.chat) for row in prompts]
    with torch.inference_mode():
        refs = [target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=args.max_new_tokens,
                                pad_token_id=tok.pad_token_id or tok.eos_token_id) for ids in inputs]
    rows = {}
    for spec in args.draft:
        proposer = make_proposer(spec, target, tok)
        for tree, label in zip(trees, [spec] + [f"{spec} tree {t}" for t in args.tree]):
            if tree is not None and not proposer.grows_trees:
                continue  # this draft grows no trees (an n-gram draft): its chain only
            stats, same = SpecStats(), []
            for ids, ref in zip(inputs, refs):
                out, st = speculative_generate(target, proposer, ids, max_new_tokens=args.max_new_tokens, k=args.k,
                                               tree=tree)
                stats = stats.merge(st)
                same.append(bool(out.shape == ref.shape and torch.equal(out, ref)))
            d = stats.to_dict()
            rows[label] = {key: d[key] for key in ("acceptance_rate", "mean_accepted", "mean_accepted_length",
                                                   "by_depth", "target_calls", "new_tokens", "mean_proposed")}
            rows[label]["greedy_matches_target"] = sum(same)
            print(f"{label}: acceptance {d['acceptance_rate']:.3f}, mean accepted length "
                  f"{d['mean_accepted_length']:.2f}, greedy == target on {sum(same)}/{len(same)}", flush=True)
    result = {"target": model_label(desc), "target_kind": desc["kind"], "dtype": args.dtype, "k": args.k,
              "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "chat": args.chat,
              "drafts": rows, "machine": machine_line(describe_machine()), "date": time.strftime("%Y-%m-%d"),
              "command": "python benchmarks/specdec_acceptance.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Draft acceptance on {result['target']} (k = {args.k}, greedy, {len(prompts)} prompts, "
             f"{args.max_new_tokens} new tokens)", "", f"Command: `{result['command']}`; raw: {args.name}.json; "
             f"{result['machine']}; {result['date']}.", "",
             "| draft | acceptance | mean accepted length (tokens / target call) | draft nodes / call | accept@1 | accept@2 | accept@3 | greedy == target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for spec, r in rows.items():
        depth = {e["depth"]: e for e in r["by_depth"]}
        at = [f"{depth[d]['accept_rate']:.3f}" if d in depth else "-" for d in (1, 2, 3)]
        lines.append(f"| {spec} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
                     f"{r['mean_proposed']:.2f} | {' | '.join(at)} "
                     f"| {r['greedy_matches_target']}/{len(prompts)} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def tree_spec(text: str, depth: int):
    """``KIND:NODES:TOPK`` -> TreeSpec of that depth."""
    from quantspec.specdec.tree import TreeSpec

    parts = text.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise SystemExit(f"--tree {text}: use KIND:NODES:TOPK, e.g. dynamic:8:2")
    return TreeSpec(parts[0], total=int(parts[1]), top_k=int(parts[2]), depth=depth)


if __name__ == "__main__":
    raise SystemExit(main())
