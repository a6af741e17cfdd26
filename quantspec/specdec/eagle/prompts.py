"""Requests for self-distilled training text: a user's prompt file, or ones made from local text.

A head drafts what the target writes in reply to its users, so it learns best from the
target's own replies to requests of that kind (EAGLE and Medusa train on chat conversations for
this reason). ``training_prompts`` reads them from a JSONL file (``{"prompt": ...}`` per line,
the format of ``bench-specdec --prompts``), or with the name ``instructions`` writes them from the
local text sources (``instruction_prompts``): requests about C4 passages (summarise, explain,
continue, rewrite, write about their topic), requests to write a Python function from a
standard-library function's signature and docstring, and requests to edit or explain such a
function (annotate, document, rename, simplify). The wording is this module's own: it shares no
prompt with the benchmark or validation prompt files.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from pathlib import Path

from ...errors import QuantspecError

BUILTIN = "instructions"
TEXT = "text"  # no requests: train on the text windows as they are (or on replies to their first tokens)

PROSE = (
    "Summarize the following text in three or four sentences:\n\n{text}",
    "What is the main point of this passage? Answer in a short paragraph.\n\n{text}",
    "Continue this text with another paragraph in the same style:\n\n{text}",
    "Rewrite this paragraph in plain, simple English:\n\n{text}",
    "Write a short story that begins with this sentence: {first}",
    "Explain to a ten-year-old what this passage is about:\n\n{text}",
    "List three questions a reader might ask after reading this, and answer them briefly:\n\n{text}",
)
WRITE = (
    "Write a Python function `{signature}` that {summary} Include a docstring.",
    "Implement `{signature}` in Python. It should {summary}",
    "Please write the Python function `{name}`: {summary} Show the complete code.",
)
EDIT = (
    "Add Python type annotations to the function below. Reply with the complete code.\n\n```python\n{code}\n```",
    "Write a docstring for this function and give back the whole function:\n\n```python\n{code}\n```",
    ("In the code below, rename `{var}` to `{new_var}` wherever it appears, and show the updated function:\n\n"
     "```python\n{code}\n```"),
    "Explain step by step what this Python function does:\n\n```python\n{code}\n```",
    ("Make this function shorter and easier to read without changing its behaviour. Give the full new "
     "version.\n\n```python\n{code}\n```"),
    "Find a possible bug or edge case in this function and show a corrected version:\n\n```python\n{code}\n```",
)


def _passage(doc: str, rng: random.Random, words: int = 90) -> tuple[str, str] | None:
    """(a passage of about ``words`` words ending at a sentence, its first sentence) of a document."""
    text = " ".join(doc.split())
    sentences = re.split(r"(?<=[.!?])\s+", text)
    if len(sentences) < 3:
        return None
    start = rng.randrange(0, max(1, len(sentences) - 3))
    out: list[str] = []
    for s in sentences[start:]:
        out.append(s)
        if sum(len(x.split()) for x in out) >= words:
            break
    if sum(len(x.split()) for x in out) < 25:
        return None
    return " ".join(out), out[0]


def python_functions(sources: list[str], min_lines: int = 3, max_lines: int = 30) -> list[dict]:
    """Top-level functions of Python ``sources`` with ``min_lines``-``max_lines`` lines: their
    ``code`` (dedented, decorators dropped), ``name``, ``signature``, docstring ``summary``
    (first sentence, "" without one) and local ``names`` (assigned variables and arguments)."""
    out = []
    for src in sources:
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            n = node.end_lineno - node.lineno + 1
            if not min_lines <= n <= max_lines:
                continue
            code = ast.get_source_segment(src, node)
            if not code or "\t" in code:
                continue
            doc = ast.get_docstring(node) or ""
            summary = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0] if doc else ""
            args = ast.unparse(node.args)
            names = sorted({a.arg for a in node.args.args if a.arg not in ("self", "cls")}
                           | {t.id for sub in ast.walk(node) if isinstance(sub, ast.Assign)
                              for t in sub.targets if isinstance(t, ast.Name)})
            out.append({"code": textwrap.dedent(code), "name": node.name, "signature": f"{node.name}({args})",
                        "summary": summary, "names": names})
    return out


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:2] != s[:2].upper() else s


def instruction_prompts(n: int, seed: int, prose_docs: list[str], code_docs: list[str]) -> list[str]:
    """``n`` requests, a third each about prose, writing a function and editing one (seeded)."""
    rng = random.Random(seed)
    funcs = python_functions(code_docs)
    documented = [f for f in funcs if len(f["summary"].split()) >= 4]
    if not prose_docs or not funcs or not documented:
        raise QuantspecError("instruction prompts need prose documents and Python functions with docstrings.",
                             "check the c4 and python-stdlib sources, or pass --prompts FILE.jsonl.")
    out: list[str] = []
    while len(out) < n:
        kind = len(out) % 3
        if kind == 0:
            got = _passage(rng.choice(prose_docs), rng)
            if got is None:
                continue
            text, first = got
            out.append(rng.choice(PROSE).format(text=text, first=first))
        elif kind == 1:
            f = rng.choice(documented)
            summary = _lower_first(f["summary"].rstrip(".")) + "."
            out.append(rng.choice(WRITE).format(signature=f["signature"], name=f["name"], summary=summary))
        else:
            f = rng.choice(funcs)
            template = rng.choice(EDIT if f["names"] else [t for t in EDIT if "{var}" not in t])
            var = rng.choice(f["names"]) if f["names"] else ""
            out.append(template.format(code=f["code"], var=var, new_var=f"{var}_value"))
    return out


def prompts_from_file(path: str | Path) -> list[str]:
    """The ``prompt`` field of every line of a JSONL file."""
    from ...data.sources import read_jsonl

    path = Path(path).expanduser()
    if not path.is_file():
        raise QuantspecError(f"prompts file {path} does not exist.", "pass a JSONL file with a \"prompt\" per line.")
    return read_jsonl(path, "prompt")


def training_prompts(spec: str, n: int, seed: int, prose: str = "c4") -> list[str]:
    """``n`` requests: ``instructions`` (made from the documents of the ``prose`` source and the
    Python standard library's code), or the first ``n`` of a JSONL file (fewer there: refused,
    saying how many it has)."""
    if spec == BUILTIN:
        from ...data.sources import load_text

        source = load_text(prose)
        docs = source.documents or [p for p in source.text.split("\n\n") if p.strip()]
        return instruction_prompts(n, seed, docs, load_text("python-stdlib").documents or [])
    rows = prompts_from_file(spec)
    if len(rows) < n:
        raise QuantspecError(f"{spec} holds {len(rows)} prompts, fewer than --samples {n}.",
                             f"use --samples {len(rows)} or a longer file.")
    return rows[:n]
