"""Draft length: fixed, or adapted to how much of the drafts the target keeps.

Rule of ``AdaptiveK`` (applied after every target call, on the rows still generating):

* every row accepted all its drafts  -> k = min(k + 1, k_max)  (drafts are cheap to check)
* fewer than half of the drafts kept  -> k = max(k - 1, k_min)  (most of the work is thrown away)
* otherwise k stays. Calls where nothing was proposed change nothing.

With acceptance rate a the expected tokens per target call are (1 - a^(k+1)) / (1 - a); a
longer k only pays while a stays high, which is what the rule tracks step by step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedK:
    k: int

    def update(self, n_accepted: list[int], n_proposed: list[int]) -> None:
        pass


@dataclass
class AdaptiveK:
    k: int = 4
    k_min: int = 1
    k_max: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        self.k = min(max(self.k, self.k_min), self.k_max)

    def update(self, n_accepted: list[int], n_proposed: list[int]) -> None:
        """Drafts kept and drafts offered, per active row of the last target call."""
        if not n_proposed or sum(n_proposed) == 0:
            return  # nothing was proposed (e.g. no n-gram match): no evidence either way
        if all(n >= p for n, p in zip(n_accepted, n_proposed)):
            self.k = min(self.k + 1, self.k_max)
        elif sum(n_accepted) < sum(n_proposed) / 2:
            self.k = max(self.k - 1, self.k_min)
