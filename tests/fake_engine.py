"""A small real OpenAI-compatible HTTP server with known timings, for the serving tests.

Standard library only, so it runs as the "engine" of ``EngineServer`` (``fake_engine.py
--model M --served-model-name N --host H --port P``, the flags vLLM's server takes) or in a
thread of the test (``start_in_thread``). Timings come from the environment (or ``Behaviour``):

  FAKE_TTFT_MS (default 20)    delay before the first token
  FAKE_SLOW_TTFT_MS (300)      the same for prompts that contain "slow"
  FAKE_TPOT_MS (10)            delay between tokens
  FAKE_DIE_AFTER (0)           exit the whole process after this many completions (0: never)
  FAKE_FAIL_START ("")         print this as an error and exit 1 before listening
  FAKE_STARTUP_S (0)           wait this long before listening
  FAKE_CHILD ("")              spawn a sleeping child process and write its pid to this file
  FAKE_REJECT_ECHO ("")        answer non-streamed (log-probability) requests with HTTP 400

Every streamed token is the text " t"; echo + logprobs returns log(1/2) for every prompt token
after the first, so the perplexity through it is exactly 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    model: str = "fake"
    ttft_ms: float = 20.0
    slow_ttft_ms: float = 300.0
    tpot_ms: float = 10.0
    die_after: int = 0

    @classmethod
    def from_env(cls, model: str) -> Behaviour:
        e = os.environ
        return cls(model, float(e.get("FAKE_TTFT_MS", 20)), float(e.get("FAKE_SLOW_TTFT_MS", 300)),
                   float(e.get("FAKE_TPOT_MS", 10)), int(e.get("FAKE_DIE_AFTER", 0)))


def make_handler(b: Behaviour):
    state = {"completions": 0, "generated": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _json(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": b.model, "object": "model"}]})
            elif self.path == "/metrics":
                text = (f"# HELP x\nvllm:num_requests_running{{model_name=\"{b.model}\"}} 0\n"
                        f"vllm:kv_cache_usage_perc{{model_name=\"{b.model}\"}} 0.25\n"
                        f"vllm:generation_tokens_total{{model_name=\"{b.model}\"}} {state['generated']}\n"
                        "vllm:num_preemptions_total 0\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/completions":
                return self._json(404, {"error": "not found"})
            if body.get("model") != b.model:
                return self._json(404, {"error": f"model {body.get('model')} does not exist"})
            with lock:
                state["completions"] += 1
                n_done = state["completions"]
            if b.die_after and n_done > b.die_after:
                os._exit(3)
            prompt = body["prompt"]
            n = int(body.get("max_tokens", 16))
            if not body.get("stream"):
                if os.environ.get("FAKE_REJECT_ECHO"):
                    return self._json(400, {"error": "prompt logprobs are not supported"})
                ids = prompt if isinstance(prompt, list) else prompt.split()
                lps = [None] + [math.log(0.5)] * (len(ids) - 1) + [math.log(0.5)] * n
                return self._json(200, {"choices": [{"text": " t" * n, "logprobs": {"token_logprobs": lps}}],
                                        "usage": {"prompt_tokens": len(ids), "completion_tokens": n}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(obj) -> None:
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            slow = isinstance(prompt, str) and "slow" in prompt
            time.sleep((b.slow_ttft_ms if slow else b.ttft_ms) / 1e3)
            for i in range(n):
                if i:
                    time.sleep(b.tpot_ms / 1e3)
                chunk({"choices": [{"index": 0, "text": " t"}]})
                with lock:
                    state["generated"] += 1
            n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            chunk({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n}})
            chunk(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def start_in_thread(b: Behaviour, host: str = "127.0.0.1") -> tuple[ThreadingHTTPServer, str]:
    srv = ThreadingHTTPServer((host, 0), make_handler(b))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://{host}:{srv.server_address[1]}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-m")  # "-m vllm.entrypoints.openai.api_server" when run as an engine python
    p.add_argument("module", nargs="?")
    p.add_argument("--model")
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int)
    args, _ = p.parse_known_args()
    if os.environ.get("FAKE_FAIL_START"):
        print(f"ValueError: {os.environ['FAKE_FAIL_START']}", flush=True)
        return 1
    time.sleep(float(os.environ.get("FAKE_STARTUP_S", 0)))
    if os.environ.get("FAKE_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_CHILD"], "w") as f:
            f.write(str(child.pid))
    srv = ThreadingHTTPServer((args.host, args.port), make_handler(Behaviour.from_env(args.served_model_name)))
    srv.daemon_threads = True
    print(f"fake engine listening on {args.host}:{args.port}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
