"""``quantspec bench-specdec``: the target alone vs our speculative decoding vs transformers'
assisted generation, greedy, on the same prompts, repeated and interleaved (medians over
``--repeats``); prints one table and writes JSON. ``--agreement`` adds the draft's
teacher-forced greedy agreement with the target (``--no-timing``: that alone).

``--tree static|dynamic`` also times token trees of the same draft (mode ``ours_tree``, paths
of up to ``--k`` nodes, ``--tree-nodes`` nodes, ``--tree-topk`` children per node) beside chains.

``add_specdec_args`` is shared with ``quantspec generate`` (--draft, --k, --adaptive,
--fast-verify, --tree, --tree-nodes, --tree-topk, --temperature, --top-k, --top-p);
``sampling_from_args`` turns them into a SamplingConfig and ``tree_from_args`` into a TreeSpec.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._common import write_json

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "specdec_prompts.jsonl"
# the defaults of the flags that only a draft uses, and of those that only sampling uses: another
# value without a draft (at temperature 0) would do nothing, so it is refused (``check_decode_args``)
DRAFT_DEFAULTS = {"draft_dtype": "auto", "draft_head": "w8gpc", "draft_vocab": None, "k": 4, "adaptive": False,
                  "fast_verify": None}
SAMPLING_DEFAULTS = {"top_k": 0, "top_p": 1.0, "seed": None}


def add_specdec_args(parser: argparse.ArgumentParser, draft_required: bool = False) -> None:
    """The speculative decoding flags (a draft is optional unless ``draft_required``)."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--draft", required=draft_required, default=None,
                   help="ngram | ngram:MAX_N | self:w4g128 | self:/path/to/quantized | a draft model id/folder")
    g.add_argument("--draft-dtype", default=DRAFT_DEFAULTS["draft_dtype"],
                   help="the draft model's dtype: auto (bfloat16 for an fp32 target on a CPU with "
                        "AVX-512 BF16, else the target's), float32, bfloat16, float16")
    g.add_argument("--draft-head", default=DRAFT_DEFAULTS["draft_head"],
                   help="output head of a self: draft, and the weights of an eagle: head: a scheme "
                        "(w8gpc, w4g32, ...), same (a self: draft's body scheme) or dense")
    g.add_argument("--draft-vocab", type=int, default=DRAFT_DEFAULTS["draft_vocab"], metavar="N",
                   help="a draft model's output head scores only the N most frequent tokens of local "
                        "prose and code, plus those of the prompt and of the text written since "
                        "(lossless: the target verifies every draft); 0 = the whole vocabulary "
                        "(default: 65536, so only larger vocabularies are pruned)")
    g.add_argument("--k", type=int, default=DRAFT_DEFAULTS["k"], help="draft tokens per target call (start value with --adaptive)")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=DRAFT_DEFAULTS["adaptive"],
                   help="grow k while every draft is accepted, shrink it when fewer than half are")
    g.add_argument("--fast-verify", action=argparse.BooleanOptionalAction, default=DRAFT_DEFAULTS["fast_verify"],
                   help="the target verifies through quantspec's static decoder and few-row CPU "
                        "products (default: for fp32 targets; off: transformers' forward)")
    g.add_argument("--tree", default=None,
                   help="draft token trees instead of chains: static (a fixed shape) or dynamic "
                        "(EAGLE-2: grown by the draft's confidence); paths of up to --k nodes")
    g.add_argument("--tree-nodes", type=int, default=None, help="nodes per tree (default 16)")
    g.add_argument("--tree-topk", type=int, default=None, help="children per expanded node (default 4)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=SAMPLING_DEFAULTS["top_k"], help="0 = off")
    g.add_argument("--top-p", type=float, default=SAMPLING_DEFAULTS["top_p"], help="1.0 = off")


def _changed(args: argparse.Namespace, defaults: dict) -> list[str]:
    """The flags of ``defaults`` that ``args`` sets to another value (absent ones: unchanged)."""
    return ["--" + name.replace("_", "-") for name, value in defaults.items() if getattr(args, name, value) != value]


def check_decode_args(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, decoding settings that cannot run (``generate`` and
    ``bench-specdec``): the draft spec, k, the token budget, the thread count."""
    from ..errors import QuantspecError
    from ..specdec.factory import check_spec, head_scheme

    if args.draft is not None:
        check_spec(args.draft)
        head_scheme(args.draft_head)
        if args.k < (1 if args.adaptive else 0):
            raise QuantspecError(f"--k {args.k} is invalid.", "use --k 1 or more (0: plain decoding, without --adaptive).")
    else:
        unused = _changed(args, DRAFT_DEFAULTS)
        if unused:
            raise QuantspecError(f"{unused[0]} sets speculative decoding, and no --draft was given.",
                                 f"add --draft SPEC, or drop {unused[0]}.")
    if args.temperature == 0:
        sampled = _changed(args, SAMPLING_DEFAULTS)
        if sampled:
            raise QuantspecError(f"{sampled[0]} shapes sampling, and --temperature 0 decodes greedily.",
                                 f"add --temperature T > 0, or drop {sampled[0]}.")
    if args.max_new_tokens < 1:
        raise QuantspecError(f"--max-new-tokens {args.max_new_tokens} generates nothing.", "use 1 or more.")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise QuantspecError(f"--threads {args.threads} is invalid.", "use 1 or more (default: torch's).")


def sampling_from_args(args: argparse.Namespace):
    from ..specdec.sampling import SamplingConfig

    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def tree_from_args(args: argparse.Namespace):
    """The TreeSpec of ``--tree``/``--tree-nodes``/``--tree-topk`` (None without ``--tree``);
    refuses, before any model loads, values that cannot make a tree."""
    from ..errors import QuantspecError
    from ..specdec.tree import TREE_KINDS, TreeSpec

    sized = [f for f, v in (("--tree-nodes", args.tree_nodes), ("--tree-topk", args.tree_topk)) if v is not None]
    if args.tree is None:
        if sized:
            raise QuantspecError(f"{sized[0]} shapes a token tree, but no --tree was given.",
                                 "add --tree static or --tree dynamic.")
        return None
    if args.tree not in TREE_KINDS:
        raise QuantspecError(f"--tree {args.tree} is not a tree kind.", f"use --tree {' or --tree '.join(TREE_KINDS)}.")
    if not args.draft:
        raise QuantspecError("--tree needs a draft to grow the trees.", "add --draft SPEC.")
    if args.draft.strip().startswith("ngram"):
        raise QuantspecError("an n-gram draft proposes chains only.", "drop --tree, or use a model draft.")
    if args.adaptive:
        raise QuantspecError("--adaptive sets a chain's length, not a tree's.", "drop --adaptive or --tree.")
    for flag, value in (("--tree-nodes", args.tree_nodes), ("--tree-topk", args.tree_topk), ("--k", args.k)):
        if value is not None and value < 1:
            raise QuantspecError(f"{flag} {value} makes no tree.", f"use {flag} 1 or more.")
    return TreeSpec(args.tree, total=args.tree_nodes or 16, top_k=args.tree_topk or 4, depth=args.k)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-specdec",
        help="speculative decoding vs the target alone vs transformers' assisted generation",
        description=__doc__,
    )
    p.add_argument("target", help="target model: hub id, local folder, GGUF file or alias")
    add_specdec_args(p, draft_required=True)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL file of {id, kind, prompt}")
    p.add_argument("--kinds", default=None, help="only these prompt kinds, comma-separated (e.g. code-edit)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="target dtype: auto (fp32 on CPU), float32, bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the tokenizer's chat template when it has one")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' assisted generation")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of every mode on every prompt, interleaved; speeds are medians")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                   help="time the modes (--no-timing: only what --agreement measures)")
    p.add_argument("--agreement", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure the draft's teacher-forced greedy agreement with the target "
                        "(deterministic; a model draft only)")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import QuantspecError
    from ..models import load_dense
    from ..specdec.agreement import greedy_agreement
    from ..specdec.bench import format_table, load_prompts, run_bench
    from ..specdec.factory import make_proposer
    from ..specdec.proposers import DraftModel

    if not sampling_from_args(args).greedy:
        raise QuantspecError("bench-specdec measures greedy decoding.", "drop --temperature.")
    _check_plan(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.kinds.split(",")] if args.kinds else None
    prompts = load_prompts(args.prompts, kinds)
    target, tokenizer, info = load_dense(args.target, dtype=args.dtype, device=args.device)
    proposer = make_proposer(args.draft, target, tokenizer, dtype=args.draft_dtype,
                             head=args.draft_head, vocab=args.draft_vocab)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = {"target": args.target, "draft": proposer.name,
              "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch.")}
    if isinstance(proposer, DraftModel):
        result["draft_dtype"] = str(next(proposer.model.parameters()).dtype).removeprefix("torch.")
    if args.timing:
        result.update(run_bench(target, tokenizer, proposer, prompts, max_new_tokens=args.max_new_tokens,
                                k=args.k, adaptive=args.adaptive, chat=args.chat, hf=args.hf,
                                progress=log, fast_verify=args.fast_verify, repeats=args.repeats,
                                tree=tree_from_args(args)))
        print(format_table(result))
    if args.agreement:
        result["agreement"] = greedy_agreement(target, proposer, tokenizer, prompts,
                                               max_new_tokens=args.max_new_tokens, chat=args.chat)
        a = result["agreement"]
        print(f"teacher-forced greedy agreement: {a['agreement']} ({a['matches']} of {a['positions']})")
    result["draft_report"] = proposer.report
    if args.json:
        write_json(args.json, result)
    return 0


def _check_plan(args: argparse.Namespace) -> None:
    """Refuse, before loading anything, a run that would measure nothing or the impossible."""
    from ..errors import QuantspecError

    tree_from_args(args)
    check_decode_args(args)
    if args.tree is not None and not args.timing:
        raise QuantspecError("--tree times token trees, but --no-timing times nothing.",
                             "drop --no-timing, or drop --tree.")
    if not args.timing and not args.agreement:
        raise QuantspecError("--no-timing without --agreement measures nothing.",
                             "add --agreement, or drop --no-timing.")
    if args.timing and args.repeats < 1:
        raise QuantspecError(f"--repeats {args.repeats} times nothing.", "use --repeats 1 or more.")
    if args.agreement and args.draft.strip().startswith("ngram"):
        raise QuantspecError("an n-gram draft has no logits to agree with the target.",
                             "use --agreement with a model, self: or eagle: draft.")
