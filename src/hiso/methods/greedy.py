"""Greedy direction choice (in the spirit of MeZO-GV and greedy ZO): a client scores a step's P
candidate directions and sends only the best one, as (index, scalar).

A local step's candidates are its P seeds s_{r,k,p}, derived from the run seed like every
round's, so every replica knows them and no seed is sent; P (``--perturbations``) is the pool
size K. The client estimates g_p = (f(x + mu u_p) - f(x)) / mu for each (P + 1 forwards, or 2P
central) and keeps the candidate of largest |g_p| (the lowest index on a tie), zeroing the rest.

Why largest |g|: stepping x - eta g_p u_p changes the loss by -eta g_p <grad f, u_p> + O(eta^2)
= -eta g_p^2 + O(eta^2), since g_p estimates <grad f, u_p>: the first-order decrease of each
candidate's own step is eta g_p^2, so the largest |g_p| is the candidate whose step descends
most, and, among directions of equal norm (Rademacher: |u|^2 = d), the one best aligned with
the client's gradient. Evaluating the loss after each candidate's step would pick on the same
criterion plus curvature at P more forwards; this rule costs none beyond the estimate.

The answer is the (tau, P) estimate with one nonzero a row: ``step_scalars`` keeps it, so the
ZO estimate of :mod:`hiso.core.estimator` steps along the chosen direction alone between local
steps, and the wire sends one (index, value) pair a row (``uplink = "choice"``: a byte of index
up to P = 256, then the value in the run's scalar dtype; :func:`hiso.core.scalars.encode_choices`).
In principle a choice is log2(P) bits; on the wire it is a byte, so an uplink carries tau (1 + 4)
bytes of answer in float32 against DeComFL's 4 tau P. The server averages the answers as usual:
its record is the (tau, P) mean, entry p the mean over clients of the scalars that chose p (0
where none did), logged and sent down in the run's scalar dtype (P scalars a record, as
DeComFL's), and every replica folds it with DeComFL's chain:

    x_{r+1} = x_r - lr sum_k (1/P) sum_p gbar_{r,k,p} u_{r,k,p},

the chosen directions only (the others have gbar = 0). The 1/P is DeComFL's: at equal lr a
client's chosen direction enters the step at lr / P, so greedy's lr grid sits above DeComFL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.method import Method


def choose(g) -> np.ndarray:
    """float32 g with every entry but the first of largest |g| set to 0 (what a client keeps of a step)."""
    g = np.asarray(g, dtype=np.float32)
    out = np.zeros_like(g)
    if g.size:
        j = int(np.argmax(np.abs(g)))
        out[j] = g[j]
    return out


@dataclass(frozen=True)
class Greedy(Method):
    """Each local step keeps the one of its P candidate directions with the largest |g| and
    sends (index, scalar); the fold is DeComFL's with the others at 0."""

    display = "Greedy"
    gradient = "zo"
    options = frozenset({"zo_estimate"})
    can = frozenset({"weighted", "lr_decay", "momentum", "int8"})
    uplink = "choice"

    @classmethod
    def from_config(cls, cfg) -> "Greedy":
        if cfg.perturbations < 2:
            raise ValueError(f"greedy chooses among the P = --perturbations candidates a step: needs P >= 2, "
                             f"got {cfg.perturbations}")
        return cls()

    def step_scalars(self, g: np.ndarray) -> np.ndarray:
        return choose(g)
