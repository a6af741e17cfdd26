"""Checkpoint identity across implementations: every tensor of every recipe of a fixed matrix,
hashed, recorded from one checkout and checked against another (issue 28: the quantize core was
rewritten and every checkpoint must stay byte-identical).

Each case is one ``python -m quantspec quantize`` run in a child process whose ``quantspec`` is
imported from ``--root`` (PYTHONPATH), calibrated on the bundled C4 sample (16 x 256 tokens, so
that the matrix needs no local data; the "-quick" AWQ cases 8 x 128, minutes each on 2 cores). Per case: the sha256 of each tensor
(name, dtype, shape, every byte) and of the config's ``quantization_config``.

    # record from the commit before a change (a worktree of it)
    git worktree add /tmp/qs-old <commit>
    python benchmarks/identity.py record --root /tmp/qs-old --json benchmarks/results/identity-smollm2.json
    # check the working tree against the record
    python benchmarks/identity.py check --json benchmarks/results/identity-smollm2.json
    # or record both and compare the two records
    python benchmarks/identity.py compare --json old.json --against new.json

``check`` exits 1 and names every case and tensor that differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CALIB = ["--calib", "c4-bundled", "--calib-samples", "16", "--calib-seqlen", "256"]

# name -> quantize flags (model smollm2-135m unless --model)
CASES: dict[str, str] = {
    "rtn-w4g128-gptq": "--method rtn --format gptq",
    "rtn-w4g128-asym-awq": "--method rtn --no-sym --format awq",
    "rtn-w8a8-ct": "--method rtn --w8a8",
    "gptq-w4g128-sym-gptq": "--method gptq --no-act-order --no-static-groups",
    "gptq-w4g128-asym-ct": "--method gptq --no-sym --no-act-order --no-static-groups --format compressed-tensors",
    "gptq-w4g128-static-actorder-gptq": "--method gptq",
    "gptq-w4g128-gidx-actorder-gptq": "--method gptq --act-order --no-static-groups",
    "gptq-w3g128-gptq": "--method gptq --bits 3",
    "gptq-w4g128-sym-ct": "--method gptq --format compressed-tensors",
    "gptq-w4g128-inmemory": "--method gptq --no-streaming",
    "awq-w4g128-awq": "--method awq --format awq",
    "awq-w4g128-clip-ct": "--method awq --clip --format compressed-tensors",
    "awq-w3g64-gptq": "--method awq --bits 3 --group-size 64 --format gptq",
    "awq-w3g64-inmemory": "--method awq --bits 3 --group-size 64 --format gptq --no-streaming",
    "awq+gptq-w4g128-gptq": "--method awq+gptq",
    # the AWQ paths again on 8 x 128 calibration tokens (a case's flags override CALIB): minutes
    "awq-w4g128-awq-quick": "--method awq --format awq --calib-samples 8 --calib-seqlen 128",
    "awq-w3g64-gptq-quick": "--method awq --bits 3 --group-size 64 --format gptq --calib-samples 8 --calib-seqlen 128",
    "awq-w3g64-inmemory-quick": "--method awq --bits 3 --group-size 64 --format gptq --no-streaming "
                                "--calib-samples 8 --calib-seqlen 128",
    "awq+gptq-w4g128-quick": "--method awq+gptq --calib-samples 8 --calib-seqlen 128",
    "smoothquant-w8a8-ct": "--method smoothquant --w8a8",
}


def tensor_hashes(folder: Path) -> dict[str, str]:
    """sha256 of each tensor of a checkpoint's safetensors files (name, dtype, shape, bytes)."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k).contiguous()
                h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}".encode())
                if t.numel():
                    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                out[k] = h.hexdigest()
    return dict(sorted(out.items()))


def run_case(root: Path, model: str, flags: str, work: Path) -> dict:
    out = work / "ckpt"
    cmd = [sys.executable, "-m", "quantspec", "quantize", model, *CALIB, *shlex.split(flags),
           "--out", str(out), "--no-compare", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    seconds = round(time.perf_counter() - t0, 1)
    if proc.returncode:
        return {"exit": proc.returncode, "stderr": proc.stderr[-3000:], "seconds": seconds}
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    return {"exit": 0, "seconds": seconds, "tensors": tensor_hashes(out),
            "quantization_config": hashlib.sha256(json.dumps(qcfg, sort_keys=True).encode()).hexdigest()}


def commit_of(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_all(root: Path, model: str, names: list[str], after_each=None) -> dict:
    """Every case of ``names``; ``after_each(cases so far)`` after each one (a cut run keeps them)."""
    cases = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="qs-identity-") as work:
            cases[name] = run_case(root, model, CASES[name], Path(work))
        print(f"{name}: exit {cases[name]['exit']} in {cases[name]['seconds']} s", flush=True)
        if after_each is not None:
            after_each(cases)
    return cases


def differences(recorded: dict, now: dict) -> list[str]:
    """One line per case or tensor that differs between two ``cases`` dicts."""
    lines = []
    for name, old in recorded.items():
        new = now.get(name)
        if new is None:
            continue
        if old["exit"] or new["exit"]:
            if old["exit"] != new["exit"]:
                lines.append(f"{name}: exit {old['exit']} recorded, {new['exit']} now")
            continue
        if old["quantization_config"] != new["quantization_config"]:
            lines.append(f"{name}: quantization_config differs")
        for key in sorted(set(old["tensors"]) | set(new["tensors"])):
            if old["tensors"].get(key) != new["tensors"].get(key):
                lines.append(f"{name}: tensor {key} differs"
                             + (" (missing now)" if key not in new["tensors"] else "")
                             + (" (new)" if key not in old["tensors"] else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["record", "check", "compare"])
    p.add_argument("--against", type=Path, help="compare: a second record (e.g. of the new code) to check against --json")
    p.add_argument("--md", type=Path, help="check/compare: also write the verdict per case as a markdown table")
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose quantspec runs (default: this one)")
    p.add_argument("--json", type=Path, required=True, help="the record (written by record, read by check)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cases", help="comma-separated subset of the cases")
    args = p.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    if args.phase == "record":  # a subset updates those cases of an existing record of the same commit
        commit = commit_of(args.root)
        old = json.loads(args.json.read_text()) if args.json.is_file() else {}
        kept = old.get("cases", {}) if old.get("commit") == commit else {}
        commands = old.get("commands", [old["command"]] if "command" in old else []) if kept else []
        command = "python benchmarks/identity.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

        def save(cases: dict) -> None:
            args.json.write_text(json.dumps({
                "commands": commands + [command], "commit": commit, "model": args.model, "calibration": CALIB,
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "date": time.strftime("%Y-%m-%d"),
                "cases": {**kept, **{n: {"flags": CASES[n], **c} for n, c in cases.items()}},
            }, indent=1) + "\n")

        cases = run_all(args.root.resolve(), args.model, names, save)
        failed = [n for n, c in cases.items() if c["exit"]]
        print(f"recorded {len(cases)} cases in {args.json}" + (f"; failed: {failed}" if failed else ""))
        return 0
    if args.phase == "compare":
        names = [n for n in names if n in json.loads(args.against.read_text())["cases"]]
        cases = {n: json.loads(args.against.read_text())["cases"][n] for n in names}
    else:
        cases = run_all(args.root.resolve(), args.model, names)
    recorded = json.loads(args.json.read_text())["cases"]
    diff = differences({n: recorded[n] for n in names if n in recorded}, cases)
    missing = [n for n in names if n not in recorded]
    for line in diff:
        print(line)
    print(f"{len(names) - len(missing)} cases checked against commit "
          f"{json.loads(args.json.read_text())['commit'][:10]}: "
          + ("identical" if not diff else f"{len(diff)} difference(s)")
          + (f"; not recorded: {missing}" if missing else ""))
    if args.md:
        write_md(args.md, json.loads(args.json.read_text()), cases, diff, args.against)
    return 1 if diff else 0


def write_md(path: Path, record: dict, cases: dict, diff: list[str], against: Path | None) -> None:
    bad = {line.split(":")[0] for line in diff}
    lines = [f"# Checkpoint identity: commit {record['commit'][:10]} vs " + (f"`{against.name}`" if against else "this tree"),
             "", f"Model {record['model']}, calibration `{' '.join(record['calibration'])}` (a case's flags override it). "
             "Every tensor of every checkpoint hashed (sha256 of dtype, shape and bytes). Raw data: the JSON of the "
             "same name (the reference record) and the commands in it.", "",
             "| case | flags | tensors | identical |", "|---|---|---:|---|"]
    for name, case in cases.items():
        ok = "failed" if case["exit"] else ("no" if name in bad else "yes")
        lines.append(f"| {name} | `{CASES[name]}` | {len(case.get('tensors', {}))} | {ok} |")
    if diff:
        lines += ["", "Differences:", ""] + [f"- {d}" for d in diff]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
