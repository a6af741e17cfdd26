"""Small helpers shared by the subcommands."""

from __future__ import annotations

import json
import os
from typing import Any

from ..checkpoint.atomic import atomic_write_text


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
