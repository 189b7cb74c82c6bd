"""Secure aggregation's arithmetic: a client's scalars on an integer grid, so that the server can
be given only the sum of a round's answers (Flower's SecAgg+ masks integers modulo 2^k) and
that sum is exact; every replica then replays the same logged mean.

The grid: each value is clipped to [-c, c] (``clip``, a power of two) and rounded to the
nearest multiple of ``step = 2c / 2^bits`` (ties to even):

    q = rint(clip(x, -c, c) / step)        an integer in [-2^(bits-1), 2^(bits-1)]

so a value moves by at most ``step / 2`` (nothing is lost beyond that unless it was outside
[-c, c]). A round's n answers are summed as integers, S = sum_i q_i, which the masks of SecAgg+
leave intact as long as the sum of the shifted values, n 2^bits, stays below the modulus
2^modulus_bits (checked). The server's mean is then ``(S step + noise) / n`` in float64:
the same numbers in the in-process simulator (which quantises the answers it holds) and on
Flower (which learns only S), so the two runs are bit-identical.

With central differential privacy (:mod:`hiso.methods.privacy`) the clients clip their own
scalars to the DP norm C before quantising (the server cannot: it never sees an answer) and
the server adds its noise to the secure sum. Rounding moves a clipped answer by at most
``sqrt(tau P) step / 2`` in L2 norm, so the sensitivity the accountant uses (C per client) is
exceeded by at most that (3e-5 relative at the defaults, tau P = 5, C = 1); pick ``bits``
larger to make it smaller still.

Every power of two here is exact in binary, so Flower's quantiser (``(x + c) 2^bits / 2c``
in float64 for x on the grid) lands on integers exactly, and its stochastic rounding has
nothing to round: the masked sum is exact, not a random draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .privacy import DPConfig, clip, noise

MAX_BITS = 30  # Flower's quantiser casts to int32: q + 2^(bits-1) must fit
MAX_MODULUS_BITS = 62  # masks are int64 (sums wrap modulo 2^64, a multiple of the modulus)


def is_power_of_two(x: float) -> bool:
    """Whether ``x`` is 2^k for an integer k (negative k allowed: 0.5, 0.25, ...)."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


@dataclass(frozen=True)
class SecAggConfig:
    """The grid (``clip`` c, ``bits``), the masks' modulus 2^``modulus_bits``, and the number of
    shares (``threshold``) that rebuild a dropped client's masks."""

    clip: float = 256.0
    bits: int = 24
    modulus_bits: int = 32
    threshold: int = 2

    def __post_init__(self) -> None:
        if not is_power_of_two(self.clip):
            raise ValueError(f"secagg clip must be a power of two (e.g. 64, 256), got {self.clip:g}")
        if not 2 <= self.bits <= MAX_BITS:
            raise ValueError(f"secagg bits must be in [2, {MAX_BITS}], got {self.bits}")
        if not self.bits < self.modulus_bits <= MAX_MODULUS_BITS:
            raise ValueError(f"secagg modulus bits must be in ({self.bits}, {MAX_MODULUS_BITS}], "
                             f"got {self.modulus_bits}")
        if self.threshold < 2:
            raise ValueError(f"secagg threshold must be >= 2, got {self.threshold}")

    @property
    def step(self) -> float:
        """The grid's spacing, 2c / 2^bits (a power of two)."""
        return self.clip * 2.0 ** (1 - self.bits)

    @property
    def levels(self) -> int:
        """2^bits: Flower's ``quantization_range``."""
        return 1 << self.bits

    @property
    def modulus(self) -> int:
        """2^modulus_bits: Flower's ``modulus_range``."""
        return 1 << self.modulus_bits

    def max_clients(self) -> int:
        """The most answers a round may sum: n 2^bits must stay below the modulus."""
        return (self.modulus - 1) >> self.bits

    def check_clients(self, n: int) -> None:
        if n > self.max_clients():
            raise ValueError(f"secagg: {n} answers a round overflow the modulus 2^{self.modulus_bits} at {self.bits} "
                             f"bits (at most {self.max_clients()}): raise secagg_modulus_bits to "
                             f"{self.bits + n.bit_length()} or more")

    def quantise(self, x) -> np.ndarray:
        """Values to grid levels (int64): clipped to [-c, c], rounded to the nearest step."""
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError("secagg: a non-finite value cannot be quantised")
        return np.rint(np.clip(x, -self.clip, self.clip) / self.step).astype(np.int64)

    def values(self, q) -> np.ndarray:
        """Grid levels back to values (float64, exact): what a client hands Flower's quantiser."""
        return np.asarray(q, dtype=np.int64).astype(np.float64) * self.step

    # the hooks the core's server calls (the secure sum as transport)
    def answer_levels(self, scalars, dp: DPConfig | None = None) -> np.ndarray:
        return answer_levels(scalars, self, dp)

    def secure_mean(self, total, n: int, dp: DPConfig | None = None, noise_seed: int = 0, round: int = 0,
                    attempt: int = 0) -> np.ndarray:
        return secure_mean(total, n, self, dp, noise_seed, round, attempt)

    def clipped(self, x) -> int:
        """How many of ``x``'s values lie outside [-c, c] (moved by more than a step)."""
        return int(np.count_nonzero(np.abs(np.asarray(x, dtype=np.float64)) > self.clip))


def answer_levels(scalars, grid: SecAggConfig, dp: DPConfig | None = None) -> np.ndarray:
    """What a client puts into the secure sum: its (tau, P) scalars, clipped to the DP norm
    first under central DP (the server cannot clip an answer it never sees), on the grid."""
    g = np.asarray(scalars, dtype=np.float64)
    if dp is not None and dp.mode == "central":
        g = clip(g, dp.clip)
    return grid.quantise(g)


def loss_level(loss: float | None, grid: SecAggConfig) -> int:
    """A client's training loss on the grid (summed securely too: the server sees the mean
    loss, not a client's); non-finite or missing counts as c (the mean then says so)."""
    if loss is None or not math.isfinite(loss):
        return int(grid.quantise(grid.clip))
    return int(grid.quantise(loss))


def secure_mean(total, n: int, grid: SecAggConfig, dp: DPConfig | None = None, noise_seed: int = 0,
                round: int = 0, attempt: int = 0) -> np.ndarray:
    """The round's aggregate from the integer sum ``total`` of n answers' levels (float64):
    ``(total step + noise) / n``, the noise (central DP) added to the sum as
    :func:`hiso.methods.privacy.private_mean` does."""
    if n < 1:
        raise ValueError("secagg: nothing to aggregate")
    s = grid.values(total)
    if dp is not None and dp.mode == "central":
        s = s + noise(noise_seed, round, attempt, s.shape, dp.std)
    return s / n


def mean_loss(total: int, n: int, grid: SecAggConfig) -> float:
    """The mean training loss from the sum of n clients' loss levels."""
    return float(grid.values(int(total)) / n)


def sum_from_mean(mean, n: int, grid: SecAggConfig) -> np.ndarray:
    """The integer sum of n answers' levels back from a mean of them that was computed in
    float64 as ``(sum step) x fl(1/n)`` (Flower's workflow divides this way): exact while
    |sum| < 2^50; a value more than a quarter step off an integer means the sum overflowed
    the modulus or was damaged, and raises."""
    t = np.asarray(mean, dtype=np.float64) * n / grid.step
    s = np.rint(t)
    if not np.all(np.isfinite(t)) or np.any(np.abs(t - s) > 0.25):
        raise ValueError("secagg: the secure sum is not on the grid (modulus overflow or a damaged answer)")
    return s.astype(np.int64)
