"""How long a Flower round waits for its answers, and the ServerApp for its nodes to join, when
no fixed value is given: from what the run measures instead of a fixed 30 s and 60 s.

* The join wait scales with a model load: the ServerApp times its own build of the task and
  the model (``load_s``, on a node's kind of machine) and gives every node that long for each
  partition it serves (a node builds a replica per partition when it joins), ``JOIN_LOADS``
  times over, and never less than ``JOIN_MIN_S``.
* Round 1 waits up to a generous bound (``FIRST_ROUND_LOADS`` model loads per partition of a
  node, at least ``FIRST_ROUND_MIN_S``): a plain ClientApp loads the model for every message.
* Every later round waits ``ROUND_FACTOR`` times the slowest of the last ``WINDOW`` rounds
  that every sampled node answered (the time from sending to the last answer), at least
  ``ROUND_MIN_S``; a round that closed without some answer tells nothing about the cost.

An explicit ``--round-timeout`` / ``--join-timeout`` overrides either.
"""

from __future__ import annotations

import math

JOIN_MIN_S = 60.0
JOIN_LOADS = 10.0
FIRST_ROUND_MIN_S = 300.0
FIRST_ROUND_LOADS = 20.0
ROUND_MIN_S = 30.0
ROUND_FACTOR = 5.0
WINDOW = 3


def per_node(partitions: int, nodes: int) -> int:
    """The most partitions one of ``nodes`` nodes serves (they are dealt in turn)."""
    return max(1, math.ceil(partitions / max(1, nodes)))


def join_wait(fixed: float | None, load_s: float, partitions_per_node: int = 1) -> float:
    """Seconds the ServerApp waits for its nodes before round 1 (``fixed``: given, > 0)."""
    if fixed:
        return float(fixed)
    return max(JOIN_MIN_S, JOIN_MIN_S + JOIN_LOADS * load_s * partitions_per_node)


class RoundTimeout:
    """A round's wait for its answers: ``fixed`` (given, > 0), else from the measured rounds."""

    def __init__(self, fixed: float | None = None, load_s: float = 0.0, partitions_per_node: int = 1):
        self.fixed = float(fixed) if fixed else None
        self.first = max(FIRST_ROUND_MIN_S, FIRST_ROUND_LOADS * load_s * partitions_per_node)
        self.measured: list[float] = []  # the complete rounds' exchange times, newest last

    def now(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if not self.measured:
            return self.first
        return max(ROUND_MIN_S, ROUND_FACTOR * max(self.measured[-WINDOW:]))

    def observe(self, seconds: float, complete: bool) -> None:
        """A closed round's exchange took ``seconds``; ``complete``: every sampled node answered."""
        if complete and seconds >= 0:
            self.measured.append(float(seconds))

    def describe(self) -> str:
        """The wait, what it comes from, and how to change it (for a round that failed)."""
        if self.fixed is not None:
            return f"{self.fixed:g} s (--round-timeout; a larger one waits longer)"
        how = "--round-timeout S fixes it"
        if not self.measured:
            return f"{self.first:.0f} s (round 1's bound, 20 model loads; {how})"
        return f"{self.now():.0f} s ({ROUND_FACTOR:g}x the slowest of the last {WINDOW} complete rounds; {how})"
