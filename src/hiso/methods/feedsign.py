"""FeedSign (Cai, Chen, Zhu, arXiv 2501.17610): one seed and one bit per client-step.

Each local step k of round r uses one direction z (P = 1, seed derived as for every
algorithm) and a two-point (central, MeZO-style) estimate of the directional derivative

    g_i = (f_i(x + mu z) - f_i(x - mu z)) / (2 mu).

The client uploads only b_i = sign(g_i) (one bit: +1 if g_i > 0, else -1; a flat loss, g = 0,
counts as -1), the server takes the majority vote v = sign(sum_i w_i b_i) (0 on an exact tie:
no step), logs v as the round's scalar, and every replica applies x <- x - eta v z, the
DeComFL step with P = 1 and the vote as its scalar (:class:`~hiso.core.state.ModelState`
folds it unchanged). With tau > 1 a client's local step k+1 starts from x - eta b_i z_k.

On the wire (:mod:`hiso.core.messages`, with this module's codec :data:`SIGNS`, the method's
``uplink``) an uplink's tau signs are packed 8 to a byte (bit j of byte j // 8, least
significant first, is sign j in (k, p) order: 1 is +1; pad bits 0). The
votes are logged and sent down in the run's scalar dtype (they take the values -1, 0, +1).

Against the paper (arXiv 2501.17610, its abstract): its payload is one bit per step
*both ways* (the seed comes from a PRNG shared by all devices, the broadcast is the vote's
sign). Ours matches it uplink; downlink the vote costs a scalar (2 or 4 bytes, not 1 bit),
since it travels in the history the other algorithms share and may be 0 (a tie: no step);
``hiso compare``'s byte columns therefore overstate FeedSign's downlink against the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..core.aggregate import combine
from ..core.method import Method
# the one-bit format is the core's (a scalar format like int8, the log's "sign"): re-exported here
from ..core.scalars import pack_signs as pack, packed_signs_size as packed_size, unpack_signs as unpack  # noqa: F401


def signs(g) -> np.ndarray:
    """float32 +1 where g > 0, else -1 (what a client uploads; same shape as g)."""
    return np.where(np.asarray(g) > 0, np.float32(1), np.float32(-1)).astype(np.float32)


def vote(mean) -> np.ndarray:
    """The majority vote from the (weighted) mean of the clients' signs: float32 -1, 0 or +1."""
    return np.sign(np.asarray(mean, dtype=np.float64)).astype(np.float32)


def sign_vote(g: np.ndarray, w: np.ndarray | None = None, rule: str = "mean", trim: float = 0.25) -> np.ndarray:
    """The (weighted) majority vote of answers ``g`` (n, ...): float32 -1, 0 or +1 per entry.

    Under the mean it is the sign of the weighted *sum*: exact for equal (or integer) weights, so
    a tie is 0, where the mean's w / w.sum() (1/6, 1/10, ...) can leave +-5e-17 and a step."""
    g = np.asarray(g, dtype=np.float64)
    w = np.ones(len(g)) if w is None else np.asarray(w, dtype=np.float64)
    agg = combine(g, w, rule, trim)  # also checks the rule, the weights and that there are answers
    return np.sign(np.tensordot(w, g, axes=1) if rule == "mean" else agg).astype(np.float32)


@dataclass(frozen=True)
class Signs:
    """The uplink codec (:mod:`hiso.core.uplink`): one bit an answer (+1 / -1), packed 8 to a byte."""

    name: ClassVar[str] = "signs"

    def size(self, wire) -> int:
        return packed_size(wire.n)

    def encode(self, scalars, wire, check: bool = True) -> bytes:
        if check and not np.all(np.abs(np.asarray(scalars, np.float32)) == 1):
            raise ValueError("FeedSign sends signs (+1 / -1), got other values")
        return pack(scalars)

    def decode(self, data, off: int, wire) -> np.ndarray:
        return unpack(data, off, wire.n).reshape(wire.shape)


SIGNS = Signs()


@dataclass(frozen=True)
class FeedSign(Method):
    """Seeds and one sign bit per client-step, majority vote.

    A client keeps the signs of its scalars and uploads them as bits, the server logs the
    (weighted) majority vote; the fold is DeComFL's with the vote as scalar."""

    uplink = SIGNS

    display: ClassVar[str] = "FeedSign"
    gradient: ClassVar[str] = "zo"
    options: ClassVar[frozenset] = frozenset({"zo_estimate"})
    can: ClassVar[frozenset] = frozenset({"faults", "robust", "weighted", "lr_decay", "step_norm", "refresh",
                                          "structured", "one-seed"})

    def step_scalars(self, g):
        return signs(g)

    def combine(self, g, w, rule, trim):
        return sign_vote(g, w, rule, trim)
