"""``quantspec serve-bench CHECKPOINT...``: serve each checkpoint (and the dense baseline) in a
real engine and measure it from outside: latency percentiles, throughput, goodput under SLOs,
accuracy through the same server."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-bench",
        help="serve checkpoints in vLLM and measure TTFT/TPOT/goodput under load, and accuracy through the server",
        description="Start a vLLM OpenAI-compatible server per checkpoint (and the dense baseline), run a sweep "
                    "of request rates or concurrency levels against it, take perplexity / lm-eval through the "
                    "same server, stop it, and write one JSON (also when interrupted: partial results are kept "
                    "and marked).",
    )
    p.add_argument("checkpoints", nargs="*", help="quantized checkpoint folders or dense models")
    p.add_argument("--engine", default="vllm", choices=["vllm"], help="serving engine (default: vllm)")
    p.add_argument("--engine-python", default=None,
                   help="python of the engine's venv (default: this interpreter)")
    p.add_argument("--engine-args", default="",
                   help="flags passed through to the engine, e.g. \"--dtype bfloat16 --max-model-len 2048 "
                        "--tensor-parallel-size 2\"")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the engine process (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=4")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server (900)")
    p.add_argument("--url", help="measure an already running OpenAI-compatible server instead of starting one")
    p.add_argument("--served-model-name", help="with --url: the model name the server answers to")
    p.add_argument("--baseline", default="auto",
                   help="dense model served first for comparison: auto (the source named in the first "
                        "checkpoint), none, or a model")
    p.add_argument("--spec", action="append", default=[], metavar="VARIANT",
                   help="also serve each model with the engine's speculative decoding: ngram[:K], "
                        "draft=PATH[:K] (e.g. a quantized checkpoint of the target as its draft) or "
                        "eagle=HEAD[:K] (an EAGLE head from train-draft); repeatable")
    p.add_argument("--concurrency", help="fixed numbers of requests in flight, e.g. 1,4,16 (default)")
    p.add_argument("--rate", help="Poisson request rates per second, e.g. 1,2,4 (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="with --rate: gamma shape of the arrival gaps (1 Poisson, <1 burstier), as vLLM bench serve")
    p.add_argument("--slo", help="service-level objectives for goodput, e.g. ttft=500ms,tpot=50ms (also itl, e2e)")
    p.add_argument("--dataset", default="c4-bundled-heldout",
                   help="prompts: a text (wikitext2, c4, c4-bundled-heldout, a .txt/.jsonl of documents), a "
                        ".jsonl of {\"prompt\", \"max_tokens\"}, or a ShareGPT .json (default: c4-bundled-heldout)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens when drawn from a text (256)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (128 for texts)")
    p.add_argument("--duration", type=float, default=None, help="stop issuing requests of a level after S seconds")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests after the server starts (2)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: every request generates its full output length)")
    p.add_argument("--ppl", nargs="?", const="wikitext2", default=None, metavar="DATA",
                   help="perplexity through the server (prompt logprobs) on DATA (default wikitext2)")
    p.add_argument("--ppl-seqlen", type=int, default=512)
    p.add_argument("--ppl-windows", type=int, default=20)
    p.add_argument("--tasks", nargs="+", default=[], help="lm-eval tasks through the server's completions endpoint")
    p.add_argument("--task-limit", type=float, default=None, help="lm-eval --limit")
    p.add_argument("--include-path", help="folder of your own lm-eval task YAMLs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="serve every target this many times, interleaved in a seeded random order per round, each "
                        "on a fresh server; the report gives medians over the rounds (1)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the first checkpoint's)")
    p.add_argument("--out", type=Path, default=Path("serve-bench-out"), help="folder for server logs and the report")
    p.add_argument("--json", type=Path, help="result JSON (default OUT/serve-bench.json)")
    p.add_argument("--no-records", dest="keep_records", action="store_false",
                   help="leave per-request timings out of the JSON")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=run)


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    from ..errors import QuantspecError

    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise QuantspecError(f"--engine-env {pair!r} is not KEY=VALUE.", "e.g. --engine-env VLLM_CPU_KVCACHE_SPACE=4")
        out[k] = v
    return out


def _tokenizer(args, targets):
    """(tokenizer, folder): --tokenizer, else the first served folder that has tokenizer files."""
    from transformers import AutoTokenizer

    from ..errors import QuantspecError

    if args.tokenizer:
        candidates = [args.tokenizer]
    else:
        candidates = [t.model for t in targets if t.model and any(
            (Path(t.model) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))][:1]
    for c in candidates:
        try:
            return AutoTokenizer.from_pretrained(c), c
        except (OSError, ValueError) as exc:
            raise QuantspecError(f"cannot load a tokenizer from {c} ({exc}).", "pass --tokenizer FOLDER") from exc
    return None, None


def _terminate_as_interrupt() -> None:
    """SIGTERM (a scheduler, ``timeout``, ``kill``) ends the run as Ctrl-C does: servers stopped,
    the JSON marked interrupted, exit 130."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.load import is_quantized_folder
    from ..errors import QuantspecError
    from ..eval.machine import describe_machine
    from ..eval.speed import dense_source
    from ..models.source import dense_folder
    from ..serving.bench import BenchConfig, check_url, serve_bench
    from ..serving.client import Endpoint
    from ..serving.load import parse_levels
    from ..serving.server import EngineSpec, check_engine
    from ..serving.slo import parse_slo
    from ..serving.report import write_serving_report
    from ..serving.table import serve_markdown
    from ..serving.variants import build_targets
    from ..serving.workload import build_workload

    say = (lambda m: print(f"[serve-bench] {m}", file=sys.stderr, flush=True)) if args.progress else (lambda m: None)
    # everything that can be wrong with the input is checked before a server starts
    levels = parse_levels(args.rate, args.concurrency)
    if not args.burstiness > 0:
        raise QuantspecError(f"--burstiness {args.burstiness} must be positive.", "use 1 for Poisson arrivals")
    slo = parse_slo(args.slo)
    if args.tasks:  # unknown task names or missing packages fail here, not after a server has started
        from ..eval.lmeval_adapter import check_tasks

        check_tasks(args.tasks, args.include_path, api=True)
    for name in ("num_prompts", "warmup", "ppl_seqlen", "ppl_windows", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise QuantspecError(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range.",
                                 "pass a positive number")
    checkpoints = []
    for ck in args.checkpoints:
        if Path(ck).exists() and not (Path(ck) / "config.json").is_file():
            raise QuantspecError(f"{ck} has no config.json.", "pass a model folder (a quantspec output folder)")
        checkpoints.append(ck if Path(ck).exists() else str(dense_folder(ck)))
    baseline = None
    if not args.url and args.baseline != "none":
        if args.baseline == "auto":
            first = next((c for c in checkpoints if is_quantized_folder(c)), None)
            src = dense_source(first) if first else None
            baseline = str(dense_folder(src)) if src else None
            if first and not src:
                say(f"{first} names no dense source: no baseline (pass --baseline MODEL)")
        else:
            baseline = str(dense_folder(args.baseline))
        if baseline in checkpoints:
            baseline = None
    targets = build_targets(checkpoints, baseline=baseline, specs=args.spec, url=args.url,
                            served_name=args.served_model_name)
    spec, engine_version = None, None
    if args.url:
        check_url(Endpoint(args.url, args.served_model_name or ""))
    else:
        spec = EngineSpec(args.engine, args.engine_python or sys.executable, shlex.split(args.engine_args),
                          _env_pairs(args.engine_env), args.startup_timeout)
        engine_version = check_engine(spec)
    tokenizer, tokenizer_path = _tokenizer(args, targets)
    # one set of prompts per level and for the warm-up: no level's prefill is a prefix-cache hit
    requests = build_workload(args.dataset, tokenizer, num_prompts=args.num_prompts * len(levels) + args.warmup,
                              input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    if (args.ppl or args.tasks) and tokenizer is None:
        raise QuantspecError("accuracy through the server needs the model's tokenizer.", "pass --tokenizer FOLDER")
    if args.ppl:
        from ..data.sources import load_text

        load_text(args.ppl)  # a missing text fails here, not after a server has started
    cfg = BenchConfig(levels=levels, num_prompts=args.num_prompts, duration=args.duration, warmup=args.warmup,
                      seed=args.seed, burstiness=args.burstiness, slo=slo, ignore_eos=args.ignore_eos, ppl_data=args.ppl,
                      ppl_seqlen=args.ppl_seqlen, ppl_windows=args.ppl_windows, tasks=args.tasks,
                      task_limit=args.task_limit, include_path=args.include_path, keep_records=args.keep_records,
                      repeats=args.repeats)
    header = {"command": "quantspec serve-bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["serve-bench"]
                                                              else sys.argv[1:]),
              "engine": {"name": args.engine, "version": engine_version, "python": spec and spec.python,
                         "args": spec and spec.args, "env": spec and spec.env},
              "dataset": args.dataset, "machine": describe_machine()}
    json_path = args.json or args.out / "serve-bench.json"
    _terminate_as_interrupt()
    say(f"{len(targets) * args.repeats} server run(s) x {len(levels)} level(s), {args.num_prompts} requests each; JSON {json_path}")
    result = serve_bench(targets, spec, requests, cfg, out_dir=args.out, json_path=json_path, tokenizer=tokenizer,
                         tokenizer_path=tokenizer_path, header=header, say=say)
    files = write_serving_report(result, args.out)
    print(serve_markdown(result))
    say(f"report: {', '.join(str(p) for p in files.values())}")
    return 0 if result["status"] == "ok" else 1
