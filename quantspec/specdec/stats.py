"""What one speculative generation did, returned (never printed) by ``speculative_generate``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass
class SpecStats:
    """Counters of one call. A *verification* is one row checked by one target call.

    proposed / accepted: draft tokens offered and kept, summed over verifications (a token
    tree offers all its nodes and keeps one path of them).
    hist: accepted drafts per verification -> count. k_used: draft length (a tree's depth) of
    each target call.
    offered_at / reached_at / accepted_at: per draft position d (1-based), the verifications that
    proposed at least d drafts (a tree: had a node at depth d) / of those, the ones that accepted
    the first d-1 / accepted at least d (``by_depth`` turns them into rates).
    draft_s / target_s: wall time inside the proposer and inside verifying target forwards (the
    rest of wall_s is the prompt's prefill and the loop's own work).
    cache_copies: times the draft took the target's keys and values instead of its own (after the
    prompt's prefill and after each target call; ``Proposer.adopt_prompt`` / ``adopt_accepted``).
    """

    target_calls: int = 0
    draft_calls: int = 0
    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    cache_copies: int = 0
    hist: Counter = field(default_factory=Counter)
    k_used: list[int] = field(default_factory=list)
    offered_at: Counter = field(default_factory=Counter)
    accepted_at: Counter = field(default_factory=Counter)
    reached_at: Counter = field(default_factory=Counter)

    def record(self, n_accepted: list[int], n_proposed: list[int], depths: list[int] | None = None) -> None:
        """One verification per active row of one target call: drafts accepted, draft tokens
        offered, and the draft positions offered (a tree's depth; None: chains, ``n_proposed``)."""
        for n, p, depth in zip(n_accepted, n_proposed, n_proposed if depths is None else depths):
            self.verifications += 1
            self.proposed += p
            self.accepted += n
            self.hist[n] += 1
            for d in range(1, depth + 1):
                self.offered_at[d] += 1
                self.reached_at[d] += n >= d - 1
                self.accepted_at[d] += n >= d

    @classmethod
    def merged(cls, parts: list[SpecStats]) -> SpecStats:
        """The stats of runs one after another (rows decoded alone) as one run's."""
        total = cls()
        for part in parts:
            for f in fields(cls):
                mine, theirs = getattr(total, f.name), getattr(part, f.name)
                if isinstance(mine, list):
                    mine.extend(theirs)
                elif isinstance(mine, Counter):
                    mine.update(theirs)
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verification (the bonus/correction token not counted)."""
        return self.accepted / self.verifications if self.verifications else 0.0

    @property
    def tokens_per_call(self) -> float:
        """New tokens per row and target call (accepted drafts + 1, up to stops)."""
        return self.new_tokens / self.verifications if self.verifications else 0.0

    def by_depth(self) -> list[dict]:
        """Per draft position d = 1..max: ``offered`` (verifications with a d-th draft),
        ``accept_rate`` (of those, the share that accepted at least d drafts) and
        ``accept_given_previous`` (the share accepting the d-th draft among those that offered it
        and accepted the first d-1: the draft's agreement with the target at that position)."""
        out = []
        for d in range(1, max(self.offered_at, default=0) + 1):
            offered, acc, reached = self.offered_at[d], self.accepted_at[d], self.reached_at[d]
            out.append({"depth": d, "offered": offered, "accept_rate": round(acc / offered, 4) if offered else None,
                        "accept_given_previous": round(acc / reached, 4) if reached else None})
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def merge(self, other: "SpecStats") -> "SpecStats":
        """The sum of two runs (e.g. over prompts)."""
        return SpecStats(
            target_calls=self.target_calls + other.target_calls,
            draft_calls=self.draft_calls + other.draft_calls,
            verifications=self.verifications + other.verifications,
            proposed=self.proposed + other.proposed,
            accepted=self.accepted + other.accepted,
            new_tokens=self.new_tokens + other.new_tokens,
            wall_s=self.wall_s + other.wall_s,
            draft_s=self.draft_s + other.draft_s,
            target_s=self.target_s + other.target_s,
            cache_copies=self.cache_copies + other.cache_copies,
            hist=self.hist + other.hist,
            k_used=self.k_used + other.k_used,
            offered_at=self.offered_at + other.offered_at,
            accepted_at=self.accepted_at + other.accepted_at,
            reached_at=self.reached_at + other.reached_at,
        )

    def to_dict(self) -> dict:
        return {
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted": round(self.mean_accepted, 4),
            "tokens_per_call": round(self.tokens_per_call, 4),
            "hist": {str(n): c for n, c in sorted(self.hist.items())},
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "verifications": self.verifications,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 4),
            "draft_s": round(self.draft_s, 4),
            "target_s": round(self.target_s, 4),
            "cache_copies": self.cache_copies,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mean_k": round(sum(self.k_used) / len(self.k_used), 3) if self.k_used else 0.0,
            "mean_proposed": round(self.proposed / self.verifications, 3) if self.verifications else 0.0,
            "mean_accepted_length": round(self.tokens_per_call, 4),
            "by_depth": self.by_depth(),
        }
