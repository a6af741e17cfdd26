"""The requests of a serving run: prompts and output lengths.

``build_workload(source, tokenizer, ...)`` accepts
  - a named text or text file (``wikitext2``, ``c4``, ``c4-bundled-heldout``, ``pydoc``, a
    ``.txt`` or ``.jsonl`` of ``{"text"}`` documents, see data/sources.py): prompts are windows of
    ``input_len`` tokens drawn (seeded) from the tokenized text, decoded back to text; every
    request asks for ``output_len`` tokens;
  - a ``.jsonl`` of ``{"prompt": str, "max_tokens"|"output_len": int (optional)}`` rows;
  - a ShareGPT-style ``.json`` (a list of ``{"conversations": [{"from", "value"}, ...]}``): the
    first human turn is the prompt, the tokens of the first reply are its output length
    (``output_len`` overrides).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import QuantspecError


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None


def _fix(path: Path) -> str:
    return (f"fix {path}: a .jsonl of {{\"prompt\": ...}} rows, a .jsonl of {{\"text\": ...}} documents, "
            "or a ShareGPT .json list of {\"conversations\": [...]}")


def _prompt_rows(path: Path, rows: list[dict], output_len: int | None, tokenizer) -> list[Request]:
    out = []
    for i, row in enumerate(rows, 1):
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise QuantspecError(f"{path} row {i} has no non-empty string \"prompt\".", _fix(path))
        n = output_len or row.get("max_tokens") or row.get("output_len")
        if not isinstance(n, int) or n < 1:
            raise QuantspecError(f"{path} row {i} gives no output length.",
                                 "add \"max_tokens\" to each row or pass --output-len")
        out.append(Request(prompt, n, len(tokenizer.encode(prompt)) if tokenizer else None))
    return out


def _sharegpt(path: Path, data, output_len: int | None, tokenizer) -> list[Request]:
    out = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str) or not prompt.strip():
            continue
        n = output_len or (len(tokenizer.encode(reply)) if tokenizer else None)
        if not n:
            raise QuantspecError(f"{path}: output lengths of a ShareGPT file need a tokenizer.",
                                 "pass --output-len")
        if n < 2:
            continue  # vLLM's sharegpt loader drops replies under 4 tokens; we keep what TPOT can time
        out.append(Request(prompt, n, len(tokenizer.encode(prompt)) if tokenizer else None))
    if not out:
        raise QuantspecError(f"{path} holds no ShareGPT conversation with a prompt and a reply.", _fix(path))
    return out


def _text_windows(source: str, tokenizer, n: int, input_len: int, output_len: int, seed: int) -> list[Request]:
    from ..data.sources import load_text

    if tokenizer is None:
        raise QuantspecError(f"prompts drawn from {source!r} need the model's tokenizer.",
                             "pass a model folder with its tokenizer files, or a .jsonl of prompts")
    ids = tokenizer.encode(load_text(source).text)
    if len(ids) < input_len + 1:
        raise QuantspecError(f"{source!r} has {len(ids)} tokens, fewer than --input-len {input_len}.",
                             "lower --input-len or pass a longer text")
    rng = random.Random(seed)
    span = len(ids) - input_len
    starts = rng.sample(range(span), n) if n <= span else [rng.randrange(span) for _ in range(n)]
    return [Request(tokenizer.decode(ids[s:s + input_len]), output_len, input_len) for s in starts]


def build_workload(source: str, tokenizer, *, num_prompts: int, input_len: int = 256,
                   output_len: int | None = None, seed: int = 0) -> list[Request]:
    """``num_prompts`` requests from ``source`` (see module docstring); file rows are cycled when
    fewer than ``num_prompts`` and shuffled with ``seed``."""
    if num_prompts < 1:
        raise QuantspecError(f"--num-prompts {num_prompts} must be at least 1.", "e.g. --num-prompts 64")
    if output_len is not None and output_len < 2:
        raise QuantspecError(f"--output-len {output_len} is too short to time tokens.", "use 2 or more")
    path = Path(source).expanduser()
    if path.suffix.lower() in (".json", ".jsonl") and not path.is_file():
        raise QuantspecError(f"workload file {path} does not exist.", "check the path")
    rows = None
    if path.is_file() and path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise QuantspecError(f"{path} is not a JSON file ({exc}).", _fix(path)) from exc
        if not isinstance(data, list):
            raise QuantspecError(f"{path} is not a JSON list of conversations.", _fix(path))
        reqs = _sharegpt(path, data, output_len, tokenizer)
    elif path.is_file() and path.suffix.lower() == ".jsonl":
        try:
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (ValueError, UnicodeDecodeError) as exc:
            raise QuantspecError(f"{path} has a line that is not JSON ({exc}).", _fix(path)) from exc
        if rows and all(isinstance(r, dict) and "prompt" in r for r in rows):
            reqs = _prompt_rows(path, rows, output_len, tokenizer)
        else:
            rows = None
    if rows is None and not (path.is_file() and path.suffix.lower() == ".json"):
        return _text_windows(source, tokenizer, num_prompts, input_len, output_len or 128, seed)
    rng = random.Random(seed)
    rng.shuffle(reqs)
    return [reqs[i % len(reqs)] for i in range(num_prompts)]


def write_prompts(requests: list[Request], path: Path) -> None:
    """The workload as a ``{"prompt", "max_tokens"}`` JSONL (what vLLM's ``bench serve
    --dataset-name custom`` reads), so another client can replay the same requests."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "max_tokens": r.max_tokens, "output_tokens": r.max_tokens}) + "\n")


def split_levels(pool: list[Request], levels: int, per_level: int, warmup: int
                 ) -> tuple[list[Request], list[list[Request]], bool]:
    """(warm-up requests, one list of ``per_level`` requests per level, whether no prompt is sent
    twice). Each level gets its own prompts while the pool has them, so an engine's prefix cache
    cannot answer a later level's prefill from an earlier one; a shorter pool (a small file) is
    cycled and the flag says so."""
    need = levels * per_level + warmup
    distinct = len({r.prompt for r in pool[:need]}) == need
    take = [pool[i % len(pool)] for i in range(need)]
    lists = [take[i * per_level:(i + 1) * per_level] for i in range(levels)]
    return take[levels * per_level:], lists, distinct
