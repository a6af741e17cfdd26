"""One streamed request to an OpenAI-compatible ``/v1/completions`` endpoint, timed.

Timing follows vLLM's ``bench serve``: TTFT is the arrival of the first chunk carrying text,
each later text chunk adds an inter-token latency (ITL), TPOT is
``(latency - ttft) / (output_tokens - 1)``; output tokens come from the final ``usage`` chunk
(``stream_options.include_usage``), else the count of text chunks.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit


@dataclass
class Endpoint:
    """Where requests go: ``base`` like ``http://127.0.0.1:8000`` and the served model name."""

    base: str
    model: str
    timeout: float = 600.0

    @property
    def host_port(self) -> tuple[str, int, bool]:
        u = urlsplit(self.base if "://" in self.base else f"http://{self.base}")
        tls = u.scheme == "https"
        return u.hostname or "127.0.0.1", u.port or (443 if tls else 80), tls

    @property
    def prefix(self) -> str:
        path = urlsplit(self.base if "://" in self.base else f"http://{self.base}").path.rstrip("/")
        return path[:-3] if path.endswith("/v1") else path

    def connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        host, port, tls = self.host_port
        cls = http.client.HTTPSConnection if tls else http.client.HTTPConnection
        return cls(host, port, timeout=self.timeout if timeout is None else timeout)


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; ``start`` is on the load's own clock."""

    index: int
    prompt_tokens: int | None
    max_tokens: int
    start: float = 0.0
    ok: bool = False
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self, keep_text: bool = False) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        if not keep_text:
            d.pop("text")
        return d


def _sse_events(resp):
    """Yield the JSON payloads of a ``text/event-stream`` response until ``[DONE]``."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def stream_completion(endpoint: Endpoint, prompt: str | list[int], max_tokens: int, *, index: int = 0,
                      prompt_tokens: int | None = None, ignore_eos: bool = True, clock=time.perf_counter,
                      extra: dict | None = None) -> RequestRecord:
    """Send one streamed greedy completion and time it; never raises for a failed request
    (``ok`` false, ``error`` set)."""
    rec = RequestRecord(index=index, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    body = {"model": endpoint.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    payload = json.dumps(body).encode()
    conn = endpoint.connection()
    rec.start = t0 = clock()
    last = None
    chunks = 0
    usage_tokens = None
    pieces: list[str] = []
    try:
        conn.request("POST", endpoint.prefix + "/v1/completions", body=payload,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read(500).decode(errors='replace').strip()}"
            return rec
        for event in _sse_events(resp):
            now = clock()
            if event.get("error"):
                rec.error = f"server error: {event['error']}"
                return rec
            usage = event.get("usage")
            if usage:
                usage_tokens = usage.get("completion_tokens", usage_tokens)
                if usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = usage["prompt_tokens"]
            choices = event.get("choices") or []
            text = choices[0].get("text") if choices else None
            if text:
                if last is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
                pieces.append(text)
        rec.latency = clock() - t0
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
        rec.text = "".join(pieces)
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "the stream ended without any text"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return rec


def get_json(endpoint: Endpoint, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
    """GET (or POST ``body``) a JSON endpoint; raises OSError / http.client.HTTPException /
    ValueError (bad JSON, or an HTTP status other than 200, with the server's message)."""
    conn = endpoint.connection(timeout)
    try:
        if body is None:
            conn.request("GET", endpoint.prefix + path)
        else:
            conn.request("POST", endpoint.prefix + path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status} from {path}: {data[:500].decode(errors='replace').strip()}")
        return json.loads(data)
    finally:
        conn.close()


def get_text(endpoint: Endpoint, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET; raises OSError / http.client.HTTPException when unreachable."""
    conn = endpoint.connection(timeout)
    try:
        conn.request("GET", endpoint.prefix + path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()
