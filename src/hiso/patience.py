"""Bounds on waiting that a busy machine stretches instead of failing.

A wait for a round, a process or a file needs a bound (a stuck run must fail, not hang), but a
bound in wall-clock seconds fails a run that is merely slow because the machine is shared: on 2
cores running 6 busy processes each gets a third of a core, and does in 3 s what it does in 1 s
alone. :class:`Patience` counts seconds at the speed the machine offers a process: while the
1-minute load average L exceeds the cores C available to this process, a second counts C/L of
one. An idle machine keeps the bound as given; a loaded one lengthens it in proportion.
"""

from __future__ import annotations

import os
import time


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def share() -> float:
    """The share of a core a runnable process gets now (1 on an idle machine): C / max(C, L)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this system: count wall time
        return 1.0
    c = cores()
    return c / max(c, load)


class Patience:
    """``seconds`` of waiting counted at the speed the machine offers (see the module)."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.restart()

    def restart(self) -> None:
        """Count from zero again (progress was made)."""
        self.used, self._t = 0.0, time.monotonic()

    def spent(self) -> bool:
        """Whether the bound is used up; call it as you poll."""
        now = time.monotonic()
        self.used += (now - self._t) * share()
        self._t = now
        return self.used > self.seconds
