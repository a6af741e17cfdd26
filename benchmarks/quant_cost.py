"""Quantization time and peak memory, side by side: each job is one `quantspec quantize` run in its
own subprocess (wall seconds; user and system CPU seconds and minor page faults, which hold up when
other work shares the machine; the process's peak resident set size, Linux VmHWM: the whole
process, Python and torch included), jobs interleaved over
``--repeats`` rounds, medians reported.

A job is ``LABEL=PYTHON`` (``--impl``): the same quantize command run by another interpreter or
checkout, e.g. an old commit's worktree, to compare implementations. Every implementation runs the
same arguments, and their checkpoints' tensors are compared (``--check-identical``).

    python benchmarks/quant_cost.py --name memory-qwen-rtn -- qwen2.5-coder-0.5b --method rtn --no-compare
    python benchmarks/quant_cost.py --name memory-qwen-rtn --variant streaming= --variant in-memory=--no-streaming \\
        -- qwen2.5-coder-0.5b --method rtn --no-compare
    python benchmarks/quant_cost.py --impl old=/tmp/wt-old/.venv/bin/python --impl new=.venv/bin/python \\
        --check-identical --name quant-cost-gptq -- smollm2-135m --no-compare

Writes ``benchmarks/results/NAME.json`` (every run, the command, the machine) and ``NAME.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


# Runs `python -m quantspec ARGS` and writes, at exit, the process's VmHWM (peak RSS, kB), its CPU
# seconds (user, system) and minor page faults as JSON. Measured inside the child: wait4's
# ru_maxrss would include the parent's pages copied before exec. CPU seconds and page faults
# hold up when other work shares the machine; wall seconds do not.
_WRAPPER = """
import atexit, json, resource, runpy, sys
out = sys.argv.pop(1)
def report():
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    use = resource.getrusage(resource.RUSAGE_SELF)
    with open(out, "w") as f:
        json.dump({"hwm_kb": int(hwm.split()[1]), "user_s": use.ru_utime, "sys_s": use.ru_stime,
                   "minor_faults": use.ru_minflt}, f)
atexit.register(report)
sys.argv[0] = "quantspec"
runpy.run_module("quantspec", run_name="__main__", alter_sys=True)
"""


def run_measured(python: str, args: list[str], env: dict) -> dict:
    """Run ``python -m quantspec ARGS`` to completion: wall seconds, the process's peak RSS (MB,
    Linux VmHWM: the whole process, Python and torch included), its user and system CPU seconds
    and minor page faults, and its exit code."""
    with tempfile.NamedTemporaryFile(suffix=".json") as rec:
        t0 = time.perf_counter()
        proc = subprocess.run([python, "-c", _WRAPPER, rec.name, *args], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - t0
        text = Path(rec.name).read_text().strip()
    use = json.loads(text) if text else {}
    return {"seconds": round(wall, 2), "peak_rss_mb": round(use["hwm_kb"] / 1024, 1) if use else None,
            "user_s": round(use["user_s"], 2) if use else None, "sys_s": round(use["sys_s"], 2) if use else None,
            "minor_faults": use.get("minor_faults"), "exit": proc.returncode,
            "stderr_tail": proc.stderr.decode(errors="replace")[-2000:] if proc.returncode else ""}


def tensors_digest(folder: Path) -> str:
    """One digest over every tensor (name, dtype, shape, bytes) of a checkpoint's safetensors."""
    import torch
    from safetensors import safe_open

    h = hashlib.blake2b(digest_size=16)
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in sorted(st.keys()):
                t = st.get_tensor(k).contiguous()
                h.update(f"{k}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def schedule(labels: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, label) in run order: every label once per round, the order rotated each round so
    that no job always runs first (first runs meet colder caches)."""
    out = []
    for r in range(repeats):
        k = r % len(labels)
        out += [(r, lab) for lab in labels[k:] + labels[:k]]
    return out


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["exit"] == 0 and r["peak_rss_mb"] is not None]
    if not ok:
        return {"ok": False}
    med = lambda key, nd=2: round(statistics.median(r[key] for r in ok), nd)  # noqa: E731
    return {"ok": True, "median_s": med("seconds"), "median_user_s": med("user_s"), "median_sys_s": med("sys_s"),
            "median_minor_faults": int(med("minor_faults", 0)),
            "median_peak_rss_mb": med("peak_rss_mb", 1),
            "max_peak_rss_mb": max(r["peak_rss_mb"] for r in ok), "runs": len(ok)}


def markdown(result: dict) -> str:
    lines = [f"# Quantize cost: `{' '.join(result['args'])}`", "",
             f"Machine: {result['machine']}; {result['date']}. Command: `{result['command']}`.",
             f"Each job in its own process, {result['repeats']} interleaved rounds, medians; peak RSS of "
             "the whole quantize process (VmHWM). Raw data: the JSON of the same name.", "",
             "| job | median s | median user CPU s | median system CPU s | median minor faults "
             "| median peak RSS MB | max peak RSS MB | runs | checkpoint digest |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, s in result["summary"].items():
        if not s["ok"]:
            lines.append(f"| {label} | failed | - | - | - | - | - | 0 | - |")
            continue
        lines.append(f"| {label} | {s['median_s']} | {s['median_user_s']} | {s['median_sys_s']} "
                     f"| {s['median_minor_faults']} | {s['median_peak_rss_mb']} | {s['max_peak_rss_mb']} "
                     f"| {s['runs']} | {result['digests'].get(label, '-')} |")
    if result.get("identical") is not None:
        lines += ["", f"Checkpoint tensors identical across jobs: **{result['identical']}**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: quant_cost.py [options] -- MODEL [quantize flags]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", action="append", default=[], metavar="LABEL=PYTHON",
                        help="an interpreter (venv python) whose quantspec runs the job")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                        help="extra quantize flags of one job (e.g. in-memory=--no-streaming)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", required=True, help="result file stem under --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--check-identical", action="store_true",
                        help="keep each job's first checkpoint and compare their tensors")
    args = parser.parse_args(argv[:split])
    qargs = argv[split + 1:]
    impls = dict(x.split("=", 1) for x in args.impl) or {"quantspec": sys.executable}
    variants = dict(x.split("=", 1) for x in args.variant) or {"": ""}
    jobs = {(f"{i} {v}".strip() or i): (py, shlex.split(flags)) for i, py in impls.items()
            for v, flags in variants.items()}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    runs: dict[str, list[dict]] = {label: [] for label in jobs}
    digests: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="quant-cost-") as tmp:
        for r, label in schedule(list(jobs), args.repeats):
            py, extra = jobs[label]
            out = Path(tmp) / f"{label.replace(' ', '_')}-{r}"
            res = run_measured(py, ["quantize", *qargs, *extra, "--out", str(out), "--no-progress"], env)
            print(f"round {r} {label}: {res['seconds']} s, peak {res['peak_rss_mb']} MB, exit {res['exit']}",
                  flush=True)
            runs[label].append({"round": r, **res})
            if res["exit"] == 0 and args.check_identical and label not in digests:
                digests[label] = tensors_digest(out)
    from quantspec.eval.machine import describe_machine, machine_line

    result = {
        "args": qargs, "jobs": {k: {"python": v[0], "extra": v[1]} for k, v in jobs.items()},
        "repeats": args.repeats, "runs": runs, "summary": {k: summarize(v) for k, v in runs.items()},
        "digests": digests,
        "identical": (len(set(digests.values())) == 1) if len(digests) > 1 else None,
        "machine": machine_line(describe_machine()), "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/quant_cost.py " + " ".join(shlex.quote(a) for a in argv),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0 if all(s["ok"] for s in result["summary"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
