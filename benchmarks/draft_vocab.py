"""Draft output heads over part of the vocabulary (``--draft-vocab``), timed side by side.

One target, one draft spec, several draft vocabulary sizes (0 = the whole vocabulary) and
chain lengths k: every (size, k) is a mode of one interleaved run beside the target alone
(transformers' ``generate``), greedy, each prompt in every repeat (``specdec.schedule``). Per
mode: tokens/s and the speed-up over the target (medians over repeats), tokens per target call,
acceptance, milliseconds per draft step and per verification, and whether the output equals the
target's. Choosing the default uses the validation prompts (the default ``--prompts``).

    python benchmarks/draft_vocab.py qwen2.5-coder-0.5b --dtype bfloat16 --draft self:w4g128 \\
        --vocabs 0,16384,32768,65536 --ks 4 --repeats 2 --name draft-vocab-qwen-val
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--draft", default="self:w4g128", help="a draft model spec (self:..., a model)")
    p.add_argument("--vocabs", type=_ints, default=[0, 16384, 32768, 65536], help="comma-separated sizes; 0 = all")
    p.add_argument("--ks", type=_ints, default=[4], help="comma-separated chain lengths")
    p.add_argument("--verify", default="default",
                   help="comma-separated: default (speculative_generate's choice), transformers, runtime "
                        "(quantspec's static decoder; adds the mode target_fast: the target alone through it)")
    add_run_arguments(p, HERE / "specdec_prompts_validation.jsonl", repeats=2)
    args = p.parse_args(argv)
    target, tok, desc, prompts, inputs, pad = load_run(args)
    drafts = {}
    for v in args.vocabs:
        t0 = time.perf_counter()
        drafts[v] = make_proposer(args.draft, target, tok, vocab=v)
        print(f"draft vocab {v or 'all'}: built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    target_alone = target_mode(target, inputs, args.max_new_tokens, pad)

    fast = {"default": None, "transformers": False, "runtime": True}
    verifies = [x.strip() for x in args.verify.split(",") if x.strip()]
    if not verifies or any(x not in fast for x in verifies):
        p.error(f"--verify takes {', '.join(fast)}")

    def spec(v: int, k: int, verify: str):
        return spec_mode(target, drafts[v], inputs, args.max_new_tokens, k, fast_verify=fast[verify])

    modes = {"target": target_alone}
    if "runtime" in verifies:
        modes["target_fast"] = spec(args.vocabs[0], 0, "runtime")  # k = 0: one token per step
    for v in args.vocabs:
        for k in args.ks:
            for verify in verifies:
                label = "" if verify == "default" else f" verify={verify}"
                modes[f"vocab={v or 'all'} k={k}{label}"] = spec(v, k, verify)
    rows, _ = run_modes(modes, inputs, prompts, args.repeats)
    command = "python benchmarks/draft_vocab.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    machine = describe_machine()
    result = {"command": command, "target": model_label(desc), "draft": args.draft, "dtype": args.dtype,
              "prompts": args.prompts, "repeats": args.repeats, "threads": args.threads,
              "max_new_tokens": args.max_new_tokens, "machine": machine,
              "draft_reports": {str(v): getattr(d, "report", {}) for v, d in drafts.items()}, "rows": rows}
    write_result(args.out, args.name, f"# Draft vocabulary sizes: {args.draft} for {model_label(desc)} ({args.dtype})",
                 result, args, len(inputs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
