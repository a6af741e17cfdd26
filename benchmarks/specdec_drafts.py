"""Several drafts for one target, timed side by side in one interleaved run.

Modes: the target alone through transformers' ``generate`` (``target``, the base of every
speed-up) and through quantspec's runtime one token per step (``target_fast``), then every
``--draft`` spec as a chain of each ``--ks`` and, for drafts that grow trees (draft models, EAGLE
heads), as each ``--tree KIND:NODES:TOPK`` (depth k). Greedy; every mode runs every prompt in
every repeat, in rotated order (``specdec.schedule``). Per mode: tokens/s and speed-up over the
target (medians over repeats), tokens per target call, acceptance, milliseconds per draft step
and per verification, and whether the output equals the target's.

    python benchmarks/specdec_drafts.py smollm2-135m --draft eagle:heads/smol --draft self:w4g128 \\
        --draft ngram --ks 4 --tree dynamic:16:4 --repeats 3 --name specdec-drafts-smollm2
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    from specdec_acceptance import tree_spec
    from specdec_timing import (
        add_run_arguments,
        load_run,
        run_modes,
        spec_mode,
        target_mode,
        write_result,
    )

    from quantspec.eval.machine import describe_machine
    from quantspec.models.load import model_label
    from quantspec.specdec import make_proposer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--draft", action="append", required=True,
                   help="a proposer spec (repeatable); SPEC#HEAD builds it with --draft-head HEAD (e.g. "
                        "eagle:H#dense beside eagle:H, whose weights default to w8gpc)")
    p.add_argument("--ks", type=lambda t: [int(x) for x in t.split(",") if x.strip()], default=[4],
                   help="comma-separated chain lengths (and tree depths)")
    p.add_argument("--tree", action="append", default=[], metavar="KIND:NODES:TOPK",
                   help="also time token trees of this shape (depth k) for drafts that grow them; repeatable")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the target alone through quantspec's runtime (target_fast)")
    add_run_arguments(p, HERE / "specdec_prompts.jsonl", repeats=3)
    args = p.parse_args(argv)
    trees = {t: [tree_spec(t, k) for k in args.ks] for t in args.tree}
    target, tok, desc, prompts, inputs, pad = load_run(args)
    drafts = {}
    for spec in args.draft:
        t0 = time.perf_counter()
        name, _, head = spec.partition("#")
        drafts[spec] = make_proposer(name, target, tok, **({"head": head} if head else {}))
        print(f"draft {spec}: built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def mode(proposer, k: int, tree=None, fast=None):
        return spec_mode(target, proposer, inputs, args.max_new_tokens, k, tree, fast)

    modes = {"target": target_mode(target, inputs, args.max_new_tokens, pad)}
    if args.fast:
        modes["target_fast"] = mode(drafts[args.draft[0]], 0, fast=True)
    for spec, proposer in drafts.items():
        for j, k in enumerate(args.ks):
            modes[f"{spec} k={k}"] = mode(proposer, k)
            for text, shapes in trees.items():
                if proposer.grows_trees:
                    modes[f"{spec} tree {text} depth {k}"] = mode(proposer, k, shapes[j])
    rows, timings = run_modes(modes, inputs, prompts, args.repeats)
    command = "python benchmarks/specdec_drafts.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    machine = describe_machine()
    result = {"command": command, "target": model_label(desc), "drafts": args.draft, "dtype": args.dtype,
              "prompts": args.prompts, "repeats": args.repeats, "threads": args.threads,
              "max_new_tokens": args.max_new_tokens, "machine": machine, "rows": rows,
              "timings": [asdict(t) for t in timings]}
    write_result(args.out, args.name, f"# Drafts side by side: {model_label(desc)} ({args.dtype})", result, args,
                 len(inputs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
