"""Text sources for evaluation and calibration.

``load_text(name)`` accepts
  - ``wikitext2``: wikitext-2-raw-v1 test split, rows joined with "\\n\\n" (the GPTQ/AWQ
    perplexity protocol);
  - ``c4``: allenai/c4 en validation documents (joined with "\\n\\n" for eval; calibration
    samples documents individually);
  - ``c4-bundled`` / ``c4-bundled-heldout``: the 400-document C4 sample shipped in the package,
    its 300 calibration documents / its 100 held-out documents (lines 0-299 / 300-399 of
    ``c4-validation-2k.jsonl``; lines 400-1999 are not shipped and stay free for validation; see
    bundled.py);
  - ``pydoc``: the built-in last-resort corpus, the English text of ``pydoc_data.topics``;
  - ``python-stdlib``: code, the ``.py`` files of the running interpreter's standard library
    (one document per file; test suites left out);
  - a path to a ``.txt`` file (one text) or ``.jsonl`` file (one document per line, field "text").
Local copies come first: ``$QUANTSPEC_DATA/wikitext2/wikitext-2-raw-v1.test.txt`` and
``$QUANTSPEC_DATA/c4/c4-validation-2k.jsonl``; then the ``datasets`` hub (skipped at once when
offline or unreachable). ``load_text`` never substitutes one set for another; fallback.py does,
warned and labelled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import QuantspecError
from ..models.hub import hub_reachable
from . import bundled

C4_HUB_DOCS = 2000  # documents taken from the hub's first validation shard, as in the local copy
LOCAL_FILES = {
    "wikitext2": Path("wikitext2") / "wikitext-2-raw-v1.test.txt",
    "c4": Path("c4") / "c4-validation-2k.jsonl",
}
PYDOC_LABEL = "pydoc (built-in fallback corpus)"


@dataclass
class TextSource:
    """A loaded text: ``text`` (documents joined with "\\n\\n"), a human ``label`` (also the
    token-cache key), its ``origin`` (file path or hub dataset), and ``documents`` for document
    sets (c4, jsonl) or None for one running text."""

    text: str
    label: str
    origin: str
    documents: list[str] | None = None


def _read_utf8(path: Path) -> str:
    if not path.is_file():
        raise QuantspecError(f"data file not found: {path}.", "check the path, or use wikitext2, c4 or pydoc.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise QuantspecError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}).",
                             "convert it to UTF-8 (e.g. iconv -t UTF-8) or pass another file.") from exc
    if not text.strip():
        raise QuantspecError(f"data file {path} is empty.", "pass a file with text in it.")
    return text


def read_jsonl_rows(path: Path, field: str = "text") -> list[tuple[int, dict]]:
    """(line number, object) of every line of a JSONL file (blank ones skipped); a line that is
    not a JSON object with a string ``field`` raises QuantspecError naming the line."""
    rows = []
    for lineno, line in enumerate(_read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QuantspecError(f"{path} line {lineno} is not valid JSON ({exc.msg}).",
                                 f"write one JSON object per line, each with a \"{field}\" field.") from exc
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise QuantspecError(f"{path} line {lineno} has no string field \"{field}\".",
                                 f"write one JSON object per line, each with a \"{field}\" field.")
        rows.append((lineno, row))
    return rows


def read_jsonl(path: Path, field: str = "text") -> list[str]:
    """The string ``field`` of every line of a JSONL file (``read_jsonl_rows``; blank strings
    skipped)."""
    docs = [row[field] for _, row in read_jsonl_rows(path, field) if row[field].strip()]
    if not docs:
        raise QuantspecError(f"{path} has no non-empty \"{field}\" documents.", "pass a file with text in it.")
    return docs


def _from_file(path: Path, label: str | None = None) -> TextSource:
    label = label or f"file:{path.resolve()}"
    if path.suffix.lower() == ".jsonl":
        docs = read_jsonl(path)
        return TextSource("\n\n".join(docs), label, str(path), docs)
    return TextSource(_read_utf8(path), label, str(path), None)


def _local_copy(name: str) -> Path | None:
    root = os.environ.get("QUANTSPEC_DATA")
    if not root:
        return None
    path = Path(root).expanduser() / LOCAL_FILES[name]
    return path if path.is_file() else None


def _from_hub(name: str) -> TextSource:
    import datasets

    if name == "wikitext2":
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
        return TextSource("\n\n".join(rows), "wikitext2", "hub:wikitext/wikitext-2-raw-v1:test")
    ds = datasets.load_dataset("allenai/c4", data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"},
                               split="validation")
    docs = [t for t in ds.select(range(min(C4_HUB_DOCS, len(ds))))["text"] if t.strip()]
    return TextSource("\n\n".join(docs), "c4", "hub:allenai/c4:en/validation[:2000]", docs)


def _pydoc() -> TextSource:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key].strip() for key in sorted(topics))
    return TextSource(text, PYDOC_LABEL, "python:pydoc_data.topics", None)


STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}


def _python_stdlib() -> TextSource:
    import platform
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if STDLIB_SKIP & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            docs.append(text)
    if not docs:
        raise QuantspecError(f"python-stdlib: no .py files under {root}.",
                             "use another source (c4, pydoc, a .txt/.jsonl file).")
    return TextSource("\n\n".join(docs), f"python-stdlib {platform.python_version()}", f"python:{root}", docs)


def _bundled(name: str) -> TextSource:
    docs = bundled.split_documents(name)
    origin = f"quantspec:data/{bundled.SAMPLE_DIR}/{bundled.SAMPLE_FILE}"
    return TextSource("\n\n".join(docs), bundled.split_label(name), origin, docs)


def source_names() -> list[str]:
    """The data names ``load_text`` knows, besides file paths."""
    return [*LOCAL_FILES, *bundled.SPLITS, "pydoc", "python-stdlib"]


def load_text(name: str) -> TextSource:
    """Load a named dataset, the built-in corpus or a local file (see module docstring)."""
    key = str(name).strip()
    if key.lower() == "pydoc":
        return _pydoc()
    if key.lower() == "python-stdlib":
        return _python_stdlib()
    if key.lower() in bundled.SPLITS:
        return _bundled(key.lower())
    if key.lower() in LOCAL_FILES:
        key = key.lower()
        local = _local_copy(key)
        if local is not None:
            source = _from_file(local, label=key)
            return TextSource(source.text, key, source.origin, source.documents)
        if hub_reachable():
            try:
                return _from_hub(key)
            except Exception as exc:
                raise QuantspecError(f"could not load {key} from the hub: {type(exc).__name__}: {exc}",
                                     "set QUANTSPEC_DATA to a folder of local copies, or use c4-bundled or a local file.") from exc
        raise QuantspecError(
            f"{key} is not available: QUANTSPEC_DATA is {'not set' if not os.environ.get('QUANTSPEC_DATA') else 'set but lacks ' + str(LOCAL_FILES[key])}"
            " and the Hugging Face hub is not reachable.",
            f"set QUANTSPEC_DATA to a folder holding {LOCAL_FILES[key]}, or use the C4 sample shipped with "
            "quantspec (c4-bundled to calibrate, c4-bundled-heldout for perplexity) or a local .txt/.jsonl file.",
        )
    path = Path(key).expanduser()
    if path.suffix.lower() in {".txt", ".jsonl", ".text", ".md"} or path.exists():
        return _from_file(path)
    raise QuantspecError(f"unknown data source '{name}'.",
                         f"use {', '.join(source_names())}, or a path to a .txt or .jsonl file.")
