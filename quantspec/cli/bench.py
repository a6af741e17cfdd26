"""``quantspec bench MODEL_OR_DIR``: prefill/decode speed, latency and memory vs the dense model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure speed (prefill, decode, TTFT, TPOT) and memory against the dense baseline",
        description="Measure a quantized folder and its dense baseline (or a dense model alone) in one run.",
    )
    p.add_argument("model", help="quantized checkpoint folder, or any dense model spec")
    p.add_argument("--baseline", help="dense model to compare with (default: the source named in the folder)")
    p.add_argument("--baseline-run", dest="measure_baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the dense baseline in the same run (default: on)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512], help="prefill prompt lengths")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--decode-prompt-length", type=int, default=64, help="prompt length before decoding")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per decode run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backend", default="auto",
                   help="kernel backend of the quantized layers (auto: the fastest; on CPU it rounds the "
                        "activations of weight-only layers, which is why accuracy is measured with exact)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time decode under torch.compile (default backend: inductor), next to eager")
    p.add_argument("--static", action=argparse.BooleanOptionalAction, default=False,
                   help="also time decode through quantspec's static-cache decoder (Llama, Mistral, Qwen2/3)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="print progress to stderr")
    p.add_argument("--json", type=Path, help="also write the full result as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..eval.speed import SpeedConfig, speed_markdown, speed_report

    config = SpeedConfig(
        prompt_lengths=tuple(args.prompt_lengths), batch_sizes=tuple(args.batch_sizes),
        decode_prompt_length=args.decode_prompt_length, new_tokens=args.new_tokens,
        repeats=args.repeats, warmup=args.warmup, compile=args.compile, static=args.static,
    )
    say = (lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)) if args.progress else None
    report = speed_report(args.model, baseline=args.baseline, config=config, dtype=args.dtype,
                          device=args.device, backend=args.backend, measure_baseline=args.measure_baseline,
                          progress=say)
    print(speed_markdown(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
