"""quantspec serve-bench's client against vLLM's own ``vllm bench serve``, side by side.

One vLLM server is started; for each load level and each repeat both clients replay the same
requests (our workload written as vLLM's ``custom`` JSONL, no shuffle, no chat template, the
same seed, ``ignore_eos``) against it. Which client goes first is drawn per repeat and level
(``--order random``, seeded by ``--seed``; ``alternate`` flips it per repeat), and before each
pair a warm-up of ``--warmup`` requests at that level (our client, discarded) leaves the server
in the same state for whichever goes first. The table gives, per level, the median over repeats
of each tool's median TTFT, median TPOT, output token throughput and request throughput, and
their ratio; a second table splits each tool's TTFT and TPOT by whether it ran first or second
(an order effect shows there, a difference in how the clients time shows in both halves). The
issue's check: TTFT and TPOT medians within 10 %, throughputs within 5 %.

    python benchmarks/serve_vs_vllm_bench.py ~/.cache/quantspec/models/smollm2-135m \\
        --engine-python ~/.cache/quantspec/interop-venvs/vllm/bin/python \\
        --levels c1,c4,r2 --num-prompts 16 --output-len 64 --repeats 8 \\
        --json benchmarks/results/serve-vs-vllm-bench.json --md benchmarks/results/serve-vs-vllm-bench.md
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from quantspec.eval.machine import describe_machine, machine_line
from quantspec.serving.load import Level, run_level
from quantspec.serving.server import EngineServer, EngineSpec, check_engine
from quantspec.serving.stats import summarize
from quantspec.serving.workload import build_workload, write_prompts

VLLM_BENCH = ("import json, sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "p = FlexibleArgumentParser(); add_cli_args(p)\n"
              "r = main(p.parse_args(sys.argv[2:]))\n"
              "json.dump({k: v for k, v in r.items() if isinstance(v, (int, float, str))}, open(sys.argv[1], 'w'))\n")
FIGURES = {  # ours (summary path) -> vLLM's result key, and the allowed relative gap
    "ttft_p50_ms": ("median_ttft_ms", 0.10),
    "tpot_p50_ms": ("median_tpot_ms", 0.10),
    "output_throughput": ("output_throughput", 0.05),
    "request_throughput": ("request_throughput", 0.05),
}


def parse_level(text: str) -> Level:
    kind = {"c": "concurrency", "r": "rate"}[text[0]]
    return Level(kind, float(text[1:]))


def ours(srv: EngineServer, requests, level: Level, seed: int) -> dict:
    recs, wall = run_level(srv.endpoint, requests, level, seed=seed)
    s = summarize(recs, wall)
    return {"ttft_p50_ms": s["ttft"]["p50_ms"], "tpot_p50_ms": s["tpot"]["p50_ms"],
            "output_throughput": s["output_throughput"], "request_throughput": s["request_throughput"],
            "completed": s["completed"], "requests": s["requests"]}


def vllm_bench(py: str, srv: EngineServer, tokenizer: str, prompts: Path, n: int, level: Level, seed: int,
               out: Path, log: Path) -> dict:
    args = ["--backend", "vllm", "--base-url", srv.endpoint.base, "--endpoint", "/v1/completions",
            "--model", srv.name, "--tokenizer", tokenizer, "--dataset-name", "custom",
            "--dataset-path", str(prompts), "--custom-output-len", "-1", "--disable-shuffle", "--skip-chat-template", "--num-prompts", str(n),
            "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    if level.kind == "concurrency":
        args += ["--request-rate", "inf", "--max-concurrency", str(int(level.value))]
    else:
        args += ["--request-rate", str(level.value)]
    with open(log, "a") as lf:
        lf.write("$ vllm bench serve " + shlex.join(args) + "\n")
        lf.flush()
        p = subprocess.run([py, "-c", VLLM_BENCH, str(out), *args], check=False, stdout=lf, stderr=subprocess.STDOUT,
                           timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}); see {log}")
    r = json.loads(out.read_text())
    return {k: r.get(v) for k, (v, _) in FIGURES.items()} | {"completed": r.get("completed")}


def order_split(runs: dict[str, dict[str, list]]) -> list[dict]:
    """Per level and latency figure: (median, count) of each tool's runs when it went first and
    when second, in the order ours-first, ours-second, vllm-first, vllm-second."""
    out = []
    for lv, by in runs.items():
        for k in ("ttft_p50_ms", "tpot_p50_ms"):
            cells = []
            for tool in ("ours", "vllm"):
                for first in (True, False):
                    xs = [x[k] for x in by[tool] if x.get("first") == first]
                    cells.append((statistics.median(xs) if xs else math.nan, len(xs)))
            out.append({"level": lv, "figure": k, "cells": cells})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--engine-python", required=True)
    # no prefix caching: both clients replay the same prompts, and neither may find the other's
    # prefills cached
    ap.add_argument("--engine-args", default="--dtype bfloat16 --max-model-len 2048 --no-enable-prefix-caching")
    ap.add_argument("--engine-env", default="VLLM_CPU_KVCACHE_SPACE=2")
    ap.add_argument("--levels", default="c1,c4,r2")
    ap.add_argument("--dataset", default="c4-bundled-heldout")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--order", choices=["random", "alternate"], default="random",
                    help="which client goes first in each repeat and level: drawn (seeded by --seed) or flipped")
    ap.add_argument("--warmup", type=int, default=4, help="requests our client sends, discarded, before each pair")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    env = dict(kv.split("=", 1) for kv in args.engine_env.split(",") if kv)
    spec = EngineSpec(python=args.engine_python, args=shlex.split(args.engine_args), env=env)
    version = check_engine(spec)
    tok = AutoTokenizer.from_pretrained(args.model)
    requests = build_workload(args.dataset, tok, num_prompts=args.num_prompts, input_len=args.input_len,
                              output_len=args.output_len, seed=args.seed)
    levels = [parse_level(x) for x in args.levels.split(",")]
    runs: dict[str, dict[str, list]] = {str(lv): {"ours": [], "vllm": []} for lv in levels}
    with tempfile.TemporaryDirectory(prefix="qs-svb-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(requests, prompts)
        log = args.json.with_suffix(".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        with EngineServer(spec, args.model, log=Path(tmp) / "server.log", name="model") as srv:
            print(f"server ready in {srv.startup_s:.0f} s", file=sys.stderr)
            draw = random.Random(args.seed)
            for r in range(args.repeats):
                for lv in levels:
                    first = draw.choice(["ours", "vllm"]) if args.order == "random" else ("ours", "vllm")[r % 2]
                    if args.warmup:
                        ours(srv, requests[: args.warmup], lv, args.seed)
                    for tool in (first, "vllm" if first == "ours" else "ours"):
                        res = (ours(srv, requests, lv, args.seed) if tool == "ours" else
                               vllm_bench(args.engine_python, srv, args.model, prompts, args.num_prompts, lv,
                                          args.seed, Path(tmp) / "v.json", log))
                        runs[str(lv)][tool].append(res | {"repeat": r, "first": tool == first})
                        print(f"repeat {r} {lv} {tool}: {res}", file=sys.stderr, flush=True)
    table = []
    for lv, by in runs.items():
        for k, (_, tol) in FIGURES.items():
            a = statistics.median(x[k] for x in by["ours"])
            b = statistics.median(x[k] for x in by["vllm"])
            gap = abs(a - b) / b if b else math.inf
            table.append({"level": lv, "figure": k, "ours": a, "vllm_bench": b, "rel_gap": gap, "tolerance": tol,
                          "within": gap <= tol})
    machine = describe_machine()
    result = {"command": "python " + shlex.join(sys.argv), "engine": {"name": "vllm", "version": version},
              "machine": machine, "protocol": f"{args.repeats} repeats, the first client {'drawn at random' if args.order == 'random' else 'alternating'} per repeat and level, {args.warmup} warm-up requests before each pair; medians over repeats",
              "config": vars(args) | {"json": str(args.json), "md": str(args.md)}, "table": table, "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        lines = [f"# serve-bench client vs `vllm bench serve` (vLLM {version})", "",
                 f"Machine: {machine_line(machine)}. Model: {Path(args.model).name}. {result['protocol']}.", "",
                 f"Command: `{result['command']}`", "", f"Raw: `{args.json.name}`", "",
                 "| level | figure | quantspec | vllm bench serve | gap | within |", "|---|---|---|---|---|---|"]
        lines += [f"| {t['level']} | {t['figure']} | {t['ours']:.2f} | {t['vllm_bench']:.2f} | "
                  f"{100 * t['rel_gap']:.1f}% | {'yes' if t['within'] else 'NO'} (<= {100 * t['tolerance']:.0f}%) |"
                  for t in table]
        lines += ["", "By position (median over the repeats where the tool ran first / second; n in brackets):", "",
                  "| level | figure | quantspec first | quantspec second | vllm bench first | vllm bench second |",
                  "|---|---|---|---|---|---|"]
        for row in order_split(runs):
            cells = [f"{v:.2f} ({n})" if n else "-" for v, n in row["cells"]]
            lines.append(f"| {row['level']} | {row['figure']} | " + " | ".join(cells) + " |")
        args.md.write_text("\n".join(lines) + "\n")
    print(json.dumps(table, indent=1))
    return 0 if all(t["within"] for t in table) else 1


if __name__ == "__main__":
    sys.exit(main())
