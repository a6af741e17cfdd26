"""Project-venv side of the engine runs: write a job JSON, run the engine script in its venv
in a fresh subprocess (one checkpoint per process), read the result JSON back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from . import venvs

HERE = Path(__file__).resolve().parent
SCRIPTS = {"vllm": "engine_vllm.py", "gptqmodel": "engine_gptqmodel.py",
           "llmcompressor": "engine_llmcompressor.py"}


def engine_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):  # nothing of the project venv leaks in
        env.pop(k, None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    env.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(extra or {})
    return env


def run_engine(engine: str, job: dict, *, timeout: float = 900, venv: str | None = None) -> dict:
    """Run ``engine``'s script on ``job`` in venv ``venv`` (default: the engine's name).

    Returns the script's result dict, with ``wall_s`` and, on failure, ``log`` (its output
    tail) added; never raises for an engine failure (``ok`` is false then)."""
    py = venvs.ensure(venv or engine)
    with tempfile.TemporaryDirectory(prefix=f"qs-{engine}-") as tmp:
        jp, rp = Path(tmp) / "job.json", Path(tmp) / "result.json"
        jp.write_text(json.dumps(job))
        t0 = time.perf_counter()
        logf = Path(tmp) / "engine.log"
        with open(logf, "w") as lf:
            # own process group: vLLM leaves engine-core / worker children behind when its
            # main process exits; they are killed with the group (and never hold our pipes)
            p = subprocess.Popen([str(py), str(HERE / SCRIPTS[engine]), str(jp), str(rp)], stdout=lf,
                                 stderr=subprocess.STDOUT, env=engine_env(), cwd=tmp,
                                 start_new_session=True)
            try:
                p.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        log = logf.read_text(errors="replace")[-8000:]
        if timed_out:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s", "log": log,
                    "wall_s": round(time.perf_counter() - t0, 1)}
        wall = round(time.perf_counter() - t0, 1)
        if not rp.is_file():
            return {"ok": False, "error": f"engine exited {p.returncode} without a result", "log": log,
                    "wall_s": wall}
        res = json.loads(rp.read_text())
    res["wall_s"] = wall
    if not res.get("ok"):
        res["log"] = log
    return res
