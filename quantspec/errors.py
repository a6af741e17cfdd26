"""User-facing errors.

``QuantspecError`` is bad input: the CLI prints its message as one line and exits with code 2.
The message names the problem and the fix. Anything else escaping the CLI is an internal error
(exit code 1).
"""

from __future__ import annotations


def one_line(text: object, limit: int | None = None) -> str:
    """``text`` (an exception's message, say) with every run of whitespace one space, cut to
    ``limit`` characters: what a one-line error quotes of another message."""
    folded = " ".join(str(text).split())
    return folded if limit is None else folded[:limit]


class QuantspecError(Exception):
    """Bad input from the user: a clear message naming the problem and the fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem} Fix: {fix}")
