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
steps, and the wire sends one (index, value) pair a row (``uplink = CHOICE``, this module's codec:
a byte of index up to P = 256, then the value in the run's scalar dtype; :func:`encode_choices`).
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
from typing import ClassVar

import numpy as np

from ..core.method import Method
from ..core.scalars import block_size, decode_scalars, encode_scalars


def choose(g) -> np.ndarray:
    """float32 g with every entry but the first of largest |g| set to 0 (what a client keeps of a step)."""
    g = np.asarray(g, dtype=np.float32)
    out = np.zeros_like(g)
    if g.size:
        j = int(np.argmax(np.abs(g)))
        out[j] = g[j]
    return out


# ------------------------------------------------------------------ one chosen column a row
#
# A (rows, cols) block with at most one nonzero a row travels as the rows' column indices (u8,
# or u16 little-endian past 256 columns), then the rows' values as one block of the run's scalar
# dtype. A row of zeros is index 0 with value 0 (the only encoding of it: a decoder refuses a
# zero at another index, so the same values never have other bytes).


def choice_index_bytes(cols: int) -> int:
    """Bytes of one row's column index: 1 up to 256 columns, else 2."""
    if not 1 <= cols <= 65536:
        raise ValueError(f"a choice is one of 1 to 65536 columns, got {cols}")
    return 1 if cols <= 256 else 2


def choices_size(rows: int, cols: int, dtype: str) -> int:
    """Bytes of a (rows, cols) block as one (index, value) pair a row."""
    return rows * choice_index_bytes(cols) + block_size(rows, dtype)


def encode_choices(x, dtype: str, check: bool = True) -> bytes:
    """A (rows, cols) block with at most one nonzero a row as its indices and values. Without
    ``check`` (a lost answer's size, a simulated attacker) a row's largest |value| is kept."""
    x32 = np.asarray(x, dtype=np.float32)
    if x32.ndim != 2:
        raise ValueError(f"choices are for a (rows, cols) block, got shape {x32.shape}")
    rows, cols = x32.shape
    nz = x32 != 0  # NaN counts as nonzero
    if check and np.any(nz.sum(axis=1) > 1):
        raise ValueError("a choice row has more than one nonzero value")
    idx = np.argmax(np.where(nz, np.abs(x32), np.float32(-1)), axis=1)  # (NaN counts as the largest)
    vals = x32[np.arange(rows), idx]
    kind = "<u1" if choice_index_bytes(cols) == 1 else "<u2"
    return idx.astype(kind).tobytes() + encode_scalars(vals, dtype, check)


def decode_choices(data, off: int, rows: int, cols: int, dtype: str) -> np.ndarray:
    """A (rows, cols) float32 block from ``data[off:]`` (``choices_size`` bytes); an index past
    the columns or a zero value at an index other than 0: ValueError."""
    ib = choice_index_bytes(cols)
    idx = np.frombuffer(data, "<u1" if ib == 1 else "<u2", rows, off).astype(np.int64)
    if np.any(idx >= cols):
        raise ValueError(f"choice: an index past the {cols} columns")
    vals = decode_scalars(data, off + rows * ib, rows, dtype)
    if np.any((vals == 0) & (idx != 0)):
        raise ValueError("choice: a zero value at an index other than 0 (not one an encoder makes)")
    out = np.zeros((rows, cols), np.float32)
    out[np.arange(rows), idx] = vals
    return out


@dataclass(frozen=True)
class Choice:
    """The uplink codec (:mod:`hiso.core.uplink`): one (index, value) pair a row of the answer."""

    name: ClassVar[str] = "choice"

    def size(self, wire) -> int:
        return choices_size(wire.tau, wire.P, wire.dtype)

    def encode(self, scalars, wire, check: bool = True) -> bytes:
        return encode_choices(scalars, wire.dtype, check)

    def decode(self, data, off: int, wire) -> np.ndarray:
        return decode_choices(data, off, wire.tau, wire.P, wire.dtype)


CHOICE = Choice()


@dataclass(frozen=True)
class Greedy(Method):
    """Each local step keeps the one of its P candidate directions with the largest |g| and
    sends (index, scalar); the fold is DeComFL's with the others at 0."""

    display = "Greedy"
    gradient = "zo"
    options = frozenset({"zo_estimate"})
    can = frozenset({"weighted", "lr_decay", "momentum", "int8"})
    uplink = CHOICE

    @classmethod
    def from_config(cls, cfg) -> "Greedy":
        if cfg.perturbations < 2:
            raise ValueError(f"greedy chooses among the P = --perturbations candidates a step: needs P >= 2, "
                             f"got {cfg.perturbations}")
        return cls()

    def step_scalars(self, g: np.ndarray) -> np.ndarray:
        return choose(g)
