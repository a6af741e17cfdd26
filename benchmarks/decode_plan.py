"""One part of quantspec's decode runtime on and off, timed side by side (``--part``).

``plan``: the decode plan (a step's blocks as one C++ loop) against the Python loop
(``build_plan`` refused for the run). ``screen``: the greedy argmax of the fp32 output head
screened through its int8 copy (``kernels.output_head``) against the argmax of every logit
(``screen_refusal`` refusing). ``share``: a self-draft starting from the target's cache of the
prompt (``DraftModel.adopt_prompt``) against its own prefill. ``sync``: a self-draft also taking
the target's keys and values of each step's committed tokens (``DraftModel.adopt_accepted``)
against the prompt's only. One target and one draft; modes: the target alone through
transformers' ``generate`` (the base), and, each with the part on and off: the target alone
through quantspec's runtime (``target_fast``, one token per step; ``--fast``) and speculative
decoding (``ours``). The draft is built twice, so each copy keeps its own decoder. Greedy, every
mode on every prompt in every repeat, interleaved (``specdec.schedule``).

    python benchmarks/decode_plan.py smollm2-135m --draft self:out/smol-awq-gptq-w4g32 --k 4 \\
        --prompts benchmarks/specdec_prompts.jsonl --repeats 3 --name decode-plan-smollm2
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent

# part -> (what is patched to refuse it, the refusal, the on and off mode suffixes, the title)
PARTS = {
    "plan": ("quantspec.runtime.decode_plan.build_plan", lambda decoder: (None, "benchmark: Python loop"),
             "plan", "python", "Decode plan vs Python loop"),
    "screen": ("quantspec.kernels.output_head.screen_refusal", lambda module: "benchmark: every logit",
               "screened", "full head", "Screened head argmax vs every logit"),
    "share": ("quantspec.specdec.proposers.DraftModel.adopt_prompt", lambda self, target, sequences: False,
              "shared prompt cache", "own prefill", "A self-draft starting from the target's prompt cache vs its own prefill"),
    "sync": ("quantspec.specdec.proposers.DraftModel.adopt_accepted", lambda self, target, sequences: False,
             "shared step caches", "prompt cache only",
             "A self-draft taking the target's keys and values of each step's tokens vs of the prompt only"),
}


def part_off(part: str):
    """A context in which decoders built get no ``part``."""
    target, refusal = PARTS[part][:2]
    return mock.patch(target, refusal)


def _without(part: str, run):
    def wrapped(i: int):
        with part_off(part):
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
    p.add_argument("--part", choices=sorted(PARTS), default="plan", help="what is turned off")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="tokens the draft's head scores (0: all; default: make_proposer's)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the target alone through quantspec's runtime (target_fast)")
    add_run_arguments(p, HERE / "specdec_prompts.jsonl", repeats=3)
    args = p.parse_args(argv)
    target, tok, desc, prompts, inputs, pad = load_run(args)
    on, off, title = PARTS[args.part][2:]
    with_part = make_proposer(args.draft, target, tok, vocab=args.draft_vocab)
    with part_off(args.part):
        without = make_proposer(args.draft, target, tok, vocab=args.draft_vocab)
    n = args.max_new_tokens
    modes = {"target": target_mode(target, inputs, n, pad)}
    if args.fast:
        modes[f"target_fast {on}"] = spec_mode(target, with_part, inputs, n, 0, fast_verify=True)
        modes[f"target_fast {off}"] = _without(args.part, spec_mode(target, without, inputs, n, 0, fast_verify=True))
    modes[f"ours {on}"] = spec_mode(target, with_part, inputs, n, args.k)
    modes[f"ours {off}"] = _without(args.part, spec_mode(target, without, inputs, n, args.k))
    rows, _ = run_modes(modes, inputs, prompts, args.repeats)
    command = "python benchmarks/decode_plan.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = {"command": command, "part": args.part, "target": model_label(desc), "draft": args.draft, "k": args.k,
              "draft_vocab": args.draft_vocab,
              "dtype": args.dtype, "prompts": args.prompts, "repeats": args.repeats, "threads": args.threads,
              "max_new_tokens": n, "machine": describe_machine(), "rows": rows}
    write_result(args.out, args.name, f"# {title}: {model_label(desc)} ({args.dtype}), "
                 f"draft {args.draft}, k = {args.k}", result, args, len(inputs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
