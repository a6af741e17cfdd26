"""``quantspec profile MODEL_OR_DIR``: torch.profiler trace + time by operator class + GEMM roofline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="profile one prefill and N decode steps (Chrome trace, time by op class, GEMM roofline)",
        description="Writes trace.json, summary.json and summary.md into --out.",
    )
    p.add_argument("model", help="quantized checkpoint folder, or any dense model spec")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: profile-<model name>)")
    p.add_argument("--prompt-length", type=int, default=128, help="prefill prompt tokens")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps profiled after the prefill")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backend", default="auto", help="kernel backend of the quantized layers")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="print progress to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..eval.profile import ProfileConfig, profile_to_folder, summary_markdown

    out = args.out or Path(f"profile-{Path(args.model.rstrip('/')).name}")
    config = ProfileConfig(prompt_length=args.prompt_length, decode_steps=args.decode_steps,
                           batch_size=args.batch_size)
    say = (lambda m: print(f"[profile] {m}", file=sys.stderr, flush=True)) if args.progress else None
    summary = profile_to_folder(args.model, out, config, dtype=args.dtype, device=args.device,
                                backend=args.backend, progress=say)
    print(summary_markdown(summary))
    print(f"wrote {out}/trace.json, summary.json, summary.md")
    return 0
