"""The decode plan (a step's blocks as one C++ loop) against the Python loop, timed side by side.

One target and one draft; modes: the target alone through transformers' ``generate`` (the base),
and, each with the plan and with the Python loop (``build_plan`` refused for the run):
the target alone through quantspec's runtime (``target_fast``, one token per step; ``--fast``)
and speculative decoding (``ours``). The draft is built twice, so each copy keeps its own
decoder. Greedy, every mode on every prompt in every repeat, interleaved (``specdec.schedule``).

    python benchmarks/decode_plan.py smollm2-135m --draft self:out/smol-awq-gptq-w4g32 --k 4 \\
        --prompts benchmarks/specdec_prompts.jsonl --repeats 3 --name decode-plan-smollm2
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def python_loop():
    """Decoders built inside get no plan (the Python loop of ``StaticDecoder._blocks``)."""
    with mock.patch("quantspec.runtime.decode_plan.build_plan", lambda decoder: (None, "benchmark: Python loop")):
        yield


def _without_plan(run):
    def wrapped(i: int):
        with python_loop():
            return run(i)
    return wrapped


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
    p.add_argument("--draft", default="self:w4g128", help="a draft spec (self:..., a model, ngram)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="tokens the draft's head scores (0: all; default: make_proposer's)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the target alone through quantspec's runtime (target_fast)")
    add_run_arguments(p, HERE / "specdec_prompts.jsonl", repeats=3)
    args = p.parse_args(argv)
    target, tok, desc, prompts, inputs, pad = load_run(args)
    planned = make_proposer(args.draft, target, tok, vocab=args.draft_vocab)
    with python_loop():
        python = make_proposer(args.draft, target, tok, vocab=args.draft_vocab)
    n = args.max_new_tokens
    modes = {"target": target_mode(target, inputs, n, pad)}
    if args.fast:
        modes["target_fast plan"] = spec_mode(target, planned, inputs, n, 0, fast_verify=True)
        modes["target_fast python"] = _without_plan(spec_mode(target, python, inputs, n, 0, fast_verify=True))
    modes["ours plan"] = spec_mode(target, planned, inputs, n, args.k)
    modes["ours python"] = _without_plan(spec_mode(target, python, inputs, n, args.k))
    rows, _ = run_modes(modes, inputs, prompts, args.repeats)
    command = "python benchmarks/decode_plan.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = {"command": command, "target": model_label(desc), "draft": args.draft, "k": args.k,
              "draft_vocab": args.draft_vocab,
              "dtype": args.dtype, "prompts": args.prompts, "repeats": args.repeats, "threads": args.threads,
              "max_new_tokens": n, "machine": describe_machine(), "rows": rows}
    write_result(args.out, args.name, f"# Decode plan vs Python loop: {model_label(desc)} ({args.dtype}), "
                 f"draft {args.draft}, k = {args.k}", result, args, len(inputs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
