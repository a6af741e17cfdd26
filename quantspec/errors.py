"""User-facing errors.

``QuantspecError`` is bad input: the CLI prints its message as one line and exits with code 2.
The message names the problem and the fix. Anything else escaping the CLI is an internal error
(exit code 1).
"""

from __future__ import annotations


class QuantspecError(Exception):
    """Bad input from the user: a clear message naming the problem and the fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem} Fix: {fix}")
