"""What a named dataset falls back to when neither its local copy nor the hub is reachable.

Order: the named set (its ``$QUANTSPEC_DATA`` copy, else the hub) -> the C4 sample shipped in the
package (its calibration documents to calibrate, its held-out documents to measure perplexity, so
that a run never measures on the documents it calibrated on; see bundled.py) -> ``pydoc``, the last
resort (only when the install lacks the sample). Each step down warns, and the returned source's
label says what was used. Only the names in FALLBACK_FROM fall back; a file or any other name fails
as it is, and a set that loads but is too small for a request is not replaced (its error says what
fits).
"""

from __future__ import annotations

import warnings
from typing import Literal

from ..errors import QuantspecError
from .sources import TextSource, load_text

Purpose = Literal["calibration", "perplexity"]

FALLBACK_FROM = ("c4", "wikitext2")
FALLBACKS: dict[str, tuple[str, ...]] = {
    "calibration": ("c4-bundled", "pydoc"),
    "perplexity": ("c4-bundled-heldout", "pydoc"),
}
_DOING = {"calibration": "Calibrating on", "perplexity": "Measuring perplexity on"}


def load_or_fallback(name: str, purpose: Purpose) -> tuple[str, TextSource]:
    """(the name that loaded, its TextSource): ``name`` itself, or the first of FALLBACKS[purpose]
    that loads when ``name`` is a FALLBACK_FROM set out of reach (with a warning saying so)."""
    try:
        return name, load_text(name)
    except QuantspecError as exc:
        if str(name).strip().lower() not in FALLBACK_FROM:
            raise
        missing = exc
    for candidate in FALLBACKS[purpose]:
        try:
            source = load_text(candidate)
        except QuantspecError as exc:
            warnings.warn(str(exc), stacklevel=2)
            continue
        warnings.warn(f"{missing} {_DOING[purpose]} {source.label} instead.", stacklevel=2)
        return candidate, source
    raise missing
