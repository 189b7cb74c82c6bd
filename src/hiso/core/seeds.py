"""Direction seeds derived from the run's seed: no seed is ever sent or stored.

The protocol's mixing function (published; every peer must compute exactly this)::

    mix64(x)  = SplitMix64:  x += 0x9E3779B97F4A7C15
                             x  = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
                             x  = (x ^ (x >> 27)) * 0x94D049BB133111EB
                             x  =  x ^ (x >> 31)                    (all modulo 2^64)
    key       = mix64(run_seed ^ 0x6869736F2D736565)                 ("hiso-see")
    counter   = round << 28 | attempt << 16 | (k * P + p)
    seed      = mix64(counter ^ key)

for local step k < tau and perturbation p < P of attempt ``attempt`` of round ``round``
(``attempt`` counts how often the round was planned again because nobody answered; 0
almost always). ``mix64`` is a bijection of 64-bit integers, so two different (round,
attempt, k, p) in range always give two different seeds, for any run seed: seeds never
repeat within a run and a re-planned round never reuses one. Ranges: round < 2^36,
attempt < 2^12, tau * P <= 2^16.
"""

from __future__ import annotations

import secrets

import numpy as np

MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_DOMAIN = 0x6869736F2D736565  # b"hiso-see"
MAX_ROUND = 1 << 36
MAX_ATTEMPT = 1 << 12
MAX_PER_ROUND = 1 << 16


def mix64(x: int) -> int:
    """SplitMix64 of a 64-bit integer (Python ints; the reference definition)."""
    x = (x + _GOLDEN) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


_INV1 = pow(0xBF58476D1CE4E5B9, -1, 1 << 64)
_INV2 = pow(0x94D049BB133111EB, -1, 1 << 64)


def unmix64(x: int) -> int:
    """The inverse of :func:`mix64` (each of its steps is a bijection of 64-bit integers)."""
    x = x ^ (x >> 31) ^ (x >> 62)
    x = (x * _INV2) & MASK
    x = x ^ (x >> 27) ^ (x >> 54)
    x = (x * _INV1) & MASK
    x = x ^ (x >> 30) ^ (x >> 60)
    return (x - _GOLDEN) & MASK


def round_of(seed: int, direction_seed: int) -> int:
    """The round a direction seed of run ``seed`` was derived for (what a direction family whose
    numbers depend on the round, e.g. a low-rank subspace kept for k rounds, reads from it)."""
    return (unmix64(int(direction_seed)) ^ run_key(seed)) >> 28


def _mix64_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def run_key(seed: int) -> int:
    """The key every direction seed of a run is mixed with."""
    if not 0 <= seed <= MASK:
        raise ValueError(f"run seed must be a 64-bit non-negative integer, got {seed}")
    return mix64(seed ^ _DOMAIN)


def seeds_of(seed: int, rounds, attempts, tau: int, P: int) -> np.ndarray:
    """Seeds of many rounds at once: (n, tau, P) uint64 for ``rounds``/``attempts`` of length n."""
    r = np.asarray(rounds, dtype=np.int64).reshape(-1)
    a = np.asarray(attempts, dtype=np.int64).reshape(-1)
    if r.shape != a.shape:
        raise ValueError("rounds and attempts must have the same length")
    if tau * P > MAX_PER_ROUND or tau < 1 or P < 1:
        raise ValueError(f"tau * P must be in [1, {MAX_PER_ROUND}], got {tau} * {P}")
    if r.size and (r.min() < 0 or r.max() >= MAX_ROUND):
        raise ValueError(f"round out of range [0, 2^36): {int(r.min())}..{int(r.max())}")
    if a.size and (a.min() < 0 or a.max() >= MAX_ATTEMPT):
        raise ValueError(f"attempt out of range [0, {MAX_ATTEMPT}): {int(a.min())}..{int(a.max())}")
    base = (r.astype(np.uint64) << np.uint64(28)) | (a.astype(np.uint64) << np.uint64(16))
    counter = base[:, None] | np.arange(tau * P, dtype=np.uint64)[None, :]
    return _mix64_np(counter ^ np.uint64(run_key(seed))).reshape(-1, tau, P)


def round_seeds(seed: int, round: int, attempt: int, tau: int, P: int) -> np.ndarray:
    """The (tau, P) uint64 direction seeds of attempt ``attempt`` of round ``round``."""
    return seeds_of(seed, [round], [attempt], tau, P)[0]


def secret_key(key: int | None = None) -> int:
    """A secret (a run's DP noise, a client's local noise): ``key`` as given, else a fresh one
    (63 random bits from the OS), which its holder keeps and never sends or logs."""
    return secrets.randbits(63) if key is None else int(key)
