"""Rebuild (or check) the C4 sample shipped in quantspec/data/c4_sample/ from the local copy.

    python tools/make_c4_sample.py                      # write the .jsonl.gz
    python tools/make_c4_sample.py --check              # compare the shipped file with a rebuild
    python tools/make_c4_sample.py --source PATH/c4-validation-2k.jsonl

The sample is lines FIRST_LINE .. FIRST_LINE + DOCUMENTS - 1 (0-based; 0-399) of
c4-validation-2k.jsonl, copied byte for byte (each line ends with "\\n"), gzip level 9 with no
file name and mtime 0, so the same source gives the same bytes. The source's sha256 and the
decompressed sample's sha256 are checked against quantspec/data/bundled.py; a user can verify
by hand with ``head -n 400 c4-validation-2k.jsonl | sha256sum`` against SAMPLE_SHA256.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import sys
from pathlib import Path

from quantspec.data import bundled

OUT = Path(__file__).resolve().parents[1] / "quantspec" / "data" / bundled.SAMPLE_DIR / bundled.SAMPLE_FILE


def sample_bytes(source: Path) -> bytes:
    raw = source.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != bundled.SOURCE_SHA256:
        sys.exit(f"{source}: sha256 {digest}, expected {bundled.SOURCE_SHA256} (another copy of the file)")
    lines = raw.split(b"\n")
    picked = lines[bundled.FIRST_LINE : bundled.FIRST_LINE + bundled.DOCUMENTS]
    return b"".join(line + b"\n" for line in picked)


def gzip_bytes(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as fh:
        fh.write(data)
    return buffer.getvalue()


def main() -> int:
    default = Path(os.environ.get("QUANTSPEC_DATA", "../shared/data")) / "c4" / bundled.SOURCE_FILE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=default, help=f"path of {bundled.SOURCE_FILE}")
    parser.add_argument("--check", action="store_true", help="compare the shipped file with a rebuild")
    args = parser.parse_args()
    data = sample_bytes(args.source)
    digest = hashlib.sha256(data).hexdigest()
    if digest != bundled.SAMPLE_SHA256:
        print(f"sample sha256 {digest} differs from bundled.SAMPLE_SHA256 {bundled.SAMPLE_SHA256}")
        return 1
    if args.check:
        same = gzip.decompress(OUT.read_bytes()) == data
        print(f"{OUT}: {'matches' if same else 'DIFFERS FROM'} lines {bundled.FIRST_LINE}-"
              f"{bundled.FIRST_LINE + bundled.DOCUMENTS - 1} of {args.source}")
        return 0 if same else 1
    OUT.write_bytes(gzip_bytes(data))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes; {bundled.DOCUMENTS} documents, sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
