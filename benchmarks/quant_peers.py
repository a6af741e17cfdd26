"""Quantization methods against their peers, side by side in one run: quantspec vs
llm-compressor (GPTQ, AWQ, SmoothQuant) and GPTQModel (GPTQ).

Protocol (issues: GPTQ engine; AWQ and SmoothQuant): a model in float32 (default SmolLM2-135M),
calibration 64 C4 documents x 512 tokens (the same token ids for every tool), perplexity on
wikitext2 with seqlen 512 and the first 40 windows (the same ids and the same plain NLL loop,
peers/peer_common.py, for every tool). Quantization time: the tool's quantize call only (no load, no
save); median of --runs runs, the runs of all tools interleaved so that machine noise hits them
alike. Each tool uses its own default act-order (stated in the table); AWQ is asymmetric.

Each peer runs in its own venv (the interop suite's, tests/interop/venvs.py: built by --setup or
on first use) from a runner in benchmarks/peers/ that prints one JSON line.

    python benchmarks/quant_peers.py --setup                 # once: build the peer venvs
    python benchmarks/quant_peers.py --method gptq --configs w4g128,w4g64,w3g128 [--runs 2]
    python benchmarks/quant_peers.py --method awq --configs w4g64,w3g64
    python benchmarks/quant_peers.py --method smoothquant --configs w8a8
    python benchmarks/quant_peers.py --method rtn --configs fp8-dynamic,nvfp4,mxfp4 --out results/float-peers-rtn
    python benchmarks/quant_peers.py --method gptq --configs nvfp4,mxfp4 --seeds 0,1,2 --out results/float-peers-gptq

GPTQ's rounding is chaotic in float summation order: the same draw at 1 and at 2 threads gave
SmolLM2 NVFP4 perplexities 34.465 and 34.897. ``--threads`` (OMP_NUM_THREADS of every tool,
default all cores, in the table) makes a row reproducible; ``--seeds`` repeats the comparison
over calibration draws, so that a gap is read against the spread of each tool's draws.

Float configs (FP8 / FP4, issue 30) are the names of ``quantspec --scheme`` (fp8-dynamic,
nvfp4, mxfp4), run as llm-compressor's presets FP8_DYNAMIC, NVFP4A16, MXFP4A16; fp8-dynamic
is evaluated with FP8 per-token activations on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent / "tests"))
from interop import venvs  # noqa: E402  (the engine venvs of the interop suite, shared)

from quantspec.eval.machine import describe_machine, machine_line  # noqa: E402
from quantspec.models.paths import cache_root  # noqa: E402

DATA = Path(os.environ.get("QUANTSPEC_DATA", HERE.parents[1] / "shared" / "data"))

# tool -> (its venv in tests/interop/venvs.py, or None for ours; runner; extra environment)
TOOLS = {
    "ours": (None, "ours.py", {}),
    "ours-asym": (None, "ours.py", {}),  # GPTQ with gptq.asymmetric (TOOL_ARGS)
    "ours-bf16": (None, "ours.py", {}),  # GPTQ with gptq.forward_dtype bfloat16
    "ours-asym-bf16": (None, "ours.py", {}),  # both
    "llmc": ("llmcompressor", "llmc.py", {}),
    "gptqmodel": ("gptqmodel", "gptqmodel_gptq.py", {"GPTQMODEL_CPU_WORKERS": "2"}),
}
TOOL_ARGS = {"ours-asym": ["--asymmetric"], "ours-bf16": ["--forward-dtype", "bfloat16"],
             "ours-asym-bf16": ["--asymmetric", "--forward-dtype", "bfloat16"]}
# method -> tools that run it, and each tool's default act-order (GPTQ only)
METHODS = {
    "gptq": {"ours": "static", "ours-asym": "static", "ours-bf16": "static", "ours-asym-bf16": "static",
             "llmc": "static", "gptqmodel": "default"},
    "awq": {"ours": None, "llmc": None},
    "smoothquant": {"ours": None, "llmc": None},
    "rtn": {"ours": None, "llmc": None},
    "dense": {"ours": None},
}
FLOAT_CONFIGS = ("fp8-dynamic", "nvfp4", "mxfp4")


def python_of(tool: str) -> str:
    return sys.executable if TOOLS[tool][0] is None else str(venvs.python_of(TOOLS[tool][0]))


def setup(tools) -> None:
    for tool in tools:
        if TOOLS[tool][0] is not None:
            print(tool, venvs.ensure(TOOLS[tool][0], verify=True), flush=True)


def prepare(model_dir: Path, out: Path, samples: int, seqlen: int, windows: int, seed: int = 0) -> None:
    from quantspec.data import calibration_samples, load_text
    from quantspec.eval.perplexity import cached_token_ids, window_starts
    from quantspec.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    calib = calibration_samples(tok, str(DATA / "c4" / "c4-validation-2k.jsonl"), samples, seqlen, seed=seed)
    ids = cached_token_ids(tok, load_text(str(DATA / "wikitext2" / "wikitext-2-raw-v1.test.txt")))
    ev = torch.stack([ids[s : s + seqlen] for s in window_starts(ids.numel(), seqlen, seqlen, windows)])
    torch.save({"calib": calib, "eval": ev}, out)


def parse_config(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"w(\d+)(?:g(\d+)|a8)", text)
    if not m:
        raise SystemExit(f"bad config {text!r}: use e.g. w4g128, w8a8 or one of {list(FLOAT_CONFIGS)}")
    return int(m.group(1)), int(m.group(2) or -1)


def run_tool(tool: str, method: str, model_dir: Path, data: Path, config: str, log, threads: int) -> dict:
    _, script, env = TOOLS[tool]
    actorder = METHODS[method][tool]
    cmd = [python_of(tool), str(HERE / "peers" / script), str(model_dir), str(data)]
    if config in FLOAT_CONFIGS:
        cmd += ["--scheme", config]
    else:
        bits, group = parse_config(config)
        cmd += ["--bits", str(bits), "--group", str(group)]
    if method != "gptq" or tool != "gptqmodel":
        cmd += ["--method", method]
    if actorder:
        cmd += ["--actorder", actorder]
    if method == "awq":
        cmd += ["--asym"]
    cmd += TOOL_ARGS.get(tool, [])
    env = {**os.environ, **env, "PYTHONPATH": str(HERE / "peers"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=data.parent)  # peers write logs/ there
    log.write(f"$ {' '.join(cmd)}\n{proc.stderr[-3000:]}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return {**json.loads(lines[-1]), "actorder": actorder}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="create the peer venvs, then exit")
    ap.add_argument("--method", default="gptq", choices=sorted(METHODS))
    ap.add_argument("--model", default=str(cache_root() / "models" / "smollm2-135m"))
    ap.add_argument("--configs", default="w4g128,w4g64,w3g128")
    ap.add_argument("--tools", default=None, help="comma-separated subset of the method's tools")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="CPU threads of every tool (OMP_NUM_THREADS; default all): GPTQ's result depends on it "
                         "(float summation order), so a row reproduces only at the same count")
    ap.add_argument("--seeds", default="0",
                    help="calibration draws, e.g. 0,1,2: every tool quantizes with each draw, and the table gives "
                         "the median perplexity and each draw's (GPTQ's rounding moves by ~1%% with the draw)")
    ap.add_argument("--out", type=Path, default=None, help="results prefix (default results/METHOD-peers)")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="an earlier results .json: its rows of tools not run now, for the configs run now, join the "
                         "table, marked with the file they come from (a peer that takes hours need not run again); "
                         "refused unless it was measured on the same protocol and machine line")
    args = ap.parse_args()
    tools = args.tools.split(",") if args.tools else list(METHODS[args.method])
    if args.setup:
        setup(TOOLS if args.tools is None else tools)
        return
    setup(tools)
    out = args.out or RESULTS / f"{args.method}-peers"
    configs = args.configs.split(",")
    for c in configs:
        if c not in FLOAT_CONFIGS:
            parse_config(c)
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp, open(f"{out}.log", "w") as log:
        data = {}
        for seed in seeds_of(args):
            data[seed] = Path(tmp) / f"data-{seed}.pt"
            prepare(Path(args.model), data[seed], args.samples, args.seqlen, args.windows, seed)
        for run in range(args.runs):
            for seed in seeds_of(args):
                for config in configs:
                    for tool in tools:
                        res = {**run_tool(tool, args.method, Path(args.model), data[seed], config, log, args.threads), "seed": seed}
                        print(f"run {run} seed {seed} {config} {tool}: {res}", flush=True)
                        rows.setdefault((config, tool), []).append(res)
    write_tables(out, args, rows, reused(args.reuse, args, rows))


def protocol(args) -> dict:
    """What a run's rows were measured on: model, calibration, evaluation, draws and machine line
    (its results' meta; --reuse takes rows only of the same)."""
    return {"model": args.model, "calibration": f"c4 {args.samples} x {args.seqlen}",
            "eval": f"wikitext2 seqlen {args.seqlen} x {args.windows} windows", "seeds": seeds_of(args),
            "machine": machine_line(describe_machine())}


def reused(path: Path | None, args, rows: dict) -> list[dict]:
    """The rows of an earlier run (same method, model, calibration and eval) of the tools not run
    now, for the configs run now (an older row of a tool run now would read as current)."""
    if path is None:
        return []
    old = json.loads(path.read_text())
    meta = old["meta"]
    # the machine too: GPTQ's "auto" precisions follow the CPU (bf16 Hessians where native), so
    # another machine's rows are another measurement even of the same protocol
    want = protocol(args)
    if meta.get("threads", args.threads) != args.threads:  # GPTQ's rows move with the thread count
        want["threads"] = args.threads
    if any(meta.get(k, [0] if k == "seeds" else None) != v for k, v in want.items()):
        raise SystemExit(f"{path} was measured on another protocol ({meta}), not {want}")
    configs = {config_label(args.method, config) for config, _ in rows}
    tools = {tool for _, tool in rows}
    return [{**r, "from": r.get("from") or path.name} for r in old["rows"]
            if r["method"] == args.method and r["config"] in configs and r["tool"] not in tools]


def seeds_of(args) -> list[int]:
    return [int(s) for s in str(args.seeds).split(",")]


def config_label(method: str, config: str) -> str:
    if method == "dense":
        return "fp32"
    if config in FLOAT_CONFIGS:
        return config
    bits, group = parse_config(config)
    return f"W{bits}" + ("A8" if group == -1 else f" g{group}")


def table_row(args, key: tuple, runs: list[dict]) -> dict:
    config, tool = key
    ok = [r for r in runs if "error" not in r]
    by_seed: dict[int, float] = {}
    for r in ok:  # a draw's perplexity is the same in every run of it
        by_seed.setdefault(r.get("seed", 0), r["ppl"])
    return {
        "method": args.method, "tool": tool, "config": config_label(args.method, config),
        "actorder": METHODS[args.method][tool], "ppl": statistics.median(by_seed.values()) if ok else None,
        "ppl_by_seed": {str(k): v for k, v in sorted(by_seed.items())},
        "failed_seeds": sorted({r.get("seed", 0) for r in runs if "error" in r} - set(by_seed)),
        "seconds": [round(r["seconds"], 1) for r in ok],
        "median_s": round(statistics.median(r["seconds"] for r in ok), 1) if ok else None,
        "settings": ok[0].get("settings") if ok else None,
        "error": next((r["error"] for r in runs if "error" in r), None),
    }


def write_tables(out: Path, args, rows: dict, earlier: list[dict] = ()) -> None:
    table = [table_row(args, k, v) for k, v in rows.items()] + list(earlier)
    table.sort(key=lambda r: r["config"])
    meta = {**protocol(args), "runs": args.runs, "threads": args.threads, "torch": torch.__version__,
            "command": "python benchmarks/quant_peers.py " + " ".join(sys.argv[1:])}
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=1))
    lines = [f"# {args.method} vs peers ({Path(args.model).name}; {meta['calibration']} calibration, {meta['eval']}; "
             f"{meta['machine']}, {args.threads} threads per tool)", "",
             f"Command: `{meta['command']}`; raw rows: `{Path(out).name}.json`.", ""]
    draws = len(seeds_of(args)) > 1
    if draws:
        lines += [f"Calibration draws (seeds) {seeds_of(args)}: ppl is the median over the draws, then each draw's.", ""]
    cols = ["config", "tool", "act-order", "wikitext2 ppl"] + (["ppl per draw"] if draws else []) + \
        ["quantize s (median)", "runs (s)", "measured"]
    lines += ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in table:
        ppl = f"{r['ppl']:.3f}" if r["ppl"] else f"failed: {r['error']}"
        each = [f"{v:.3f}" for v in r.get("ppl_by_seed", {}).values()] + [f"seed {k} failed" for k in r.get("failed_seeds", [])]
        each = ("| " + ", ".join(each) + " ") if draws else ""
        when = f"earlier run ({r['from']})" if r.get("from") else "this run"
        lines.append(f"| {r['config']} | {r['tool']} | {r['actorder'] or '-'} | {ppl} {each}| {r['median_s']} | {r['seconds']} | {when} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
