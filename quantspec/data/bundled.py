"""The C4 sample shipped inside the package: general web text for calibration and perplexity offline.

``c4_sample/c4-validation-0-399.jsonl.gz`` holds 400 documents of allenai/c4 (en, validation;
ODC-By 1.0, attribution and terms in ``c4_sample/NOTICE``): the first 400 lines (0-399) of the
local copy ``$QUANTSPEC_DATA/c4/c4-validation-2k.jsonl`` (sha256 ``SOURCE_SHA256``), byte for byte,
one ``{"text": ...}`` per line. Lines 400-1999 of that file are not shipped: they stay free as a
validation split for tuning defaults (benchmarks/awq_tune_defaults.py validates on 1800-1999).
``tools/make_c4_sample.py`` rebuilds the file from the local copy and checks it.

The sample is split once, by line, and the halves are never mixed:

- ``c4-bundled``: lines 0-299 (300 documents), the calibration documents;
- ``c4-bundled-heldout``: lines 300-399 (100 documents), for perplexity (what the demo measures
  when wikitext2 is out of reach), never drawn for calibration.

With SmolLM2's tokenizer the calibration documents hold 163k tokens (87 documents of at least
512 tokens, so the CPU default of 64 x 512 takes one window of one document per sample, as the
GPTQ paper samples C4); the held-out ones 49k (the demo's 40 x 512 windows need 20.5k).
The GPU default (128 x 2048) does not fit: calibrating on this sample asks for fewer samples.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

from ..errors import QuantspecError

SAMPLE_DIR = "c4_sample"
SAMPLE_FILE = "c4-validation-0-399.jsonl.gz"
NOTICE_FILE = "NOTICE"
SOURCE_FILE = "c4-validation-2k.jsonl"
SOURCE_SHA256 = "cd69544909ef2fdc8829cd6bb8eaa211ff98009fa8d73bd1840e051984a2e30c"
FIRST_LINE = 0  # 0-based line of SOURCE_FILE where the sample starts
DOCUMENTS = 400
CALIBRATION_DOCUMENTS = 300  # the first 300 of the sample; the last 100 are held out
SAMPLE_SHA256 = "fb09e229715168cf0b26c3cb6a21d7575af3dc68998106bc0cff0ad9fde292a3"  # of the decompressed file

SPLITS = {  # name -> (first, end) index into the sample's documents
    "c4-bundled": (0, CALIBRATION_DOCUMENTS),
    "c4-bundled-heldout": (CALIBRATION_DOCUMENTS, DOCUMENTS),
}


def split_label(name: str) -> str:
    """Human label of a split, naming its lines of SOURCE_FILE (also its token-cache key)."""
    first, end = SPLITS[name]
    role = "calibration" if name == "c4-bundled" else "held-out"
    return (f"c4 (bundled {DOCUMENTS}-doc sample: {role} docs "
            f"{FIRST_LINE + first}-{FIRST_LINE + end - 1})")


def sample_path():
    """The shipped file, as an importlib.resources Traversable."""
    return resources.files(__package__) / SAMPLE_DIR / SAMPLE_FILE


def read_sample_bytes() -> bytes:
    """The decompressed sample (JSON lines), or QuantspecError when the install lacks it."""
    path = sample_path()
    try:
        with path.open("rb") as fh:
            return gzip.decompress(fh.read())
    except (OSError, EOFError) as exc:
        raise QuantspecError(
            f"the bundled C4 sample ({SAMPLE_DIR}/{SAMPLE_FILE}) is missing or unreadable in this "
            f"install: {type(exc).__name__}: {exc}.",
            "reinstall quantspec (the file is package data), or set QUANTSPEC_DATA to a folder "
            f"holding c4/{SOURCE_FILE}.",
        ) from exc


def split_documents(name: str) -> list[str]:
    """The documents of split ``name`` (a key of SPLITS), in file order."""
    docs = [json.loads(line)["text"] for line in read_sample_bytes().decode("utf-8").splitlines()]
    if len(docs) != DOCUMENTS:
        raise QuantspecError(f"the bundled C4 sample has {len(docs)} documents, not {DOCUMENTS}.",
                             "reinstall quantspec: its package data is damaged.")
    first, end = SPLITS[name]
    return docs[first:end]
