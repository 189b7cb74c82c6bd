"""Client-level differential privacy for the scalar uplink: clip, add Gaussian noise, account.

A client releases tau x P scalars a round, not a d-vector, so the Gaussian mechanism is cheap
here: per round each participating client's scalars ``g`` (one (tau, P) array) are clipped to
L2 norm ``C``,

    clip(g) = g * min(1, C / ||g||_2)        (float64; ||g|| over all tau x P values)

and Gaussian noise of standard deviation ``z C`` per entry is added:

* ``central`` (default): the server sums the clipped answers, adds one draw of N(0, (z C)^2)
  per entry to the sum and divides by the number of answers (the server is trusted with the
  raw answers; everybody else, including every client and whoever reads the log, sees only
  the noised mean);
* ``local``: each client clips and adds its own draw of N(0, (z C)^2) before it sends, and the
  server averages what it gets (the server itself learns only noised answers).

What every replica applies is the noised aggregate the server logs: H, momentum and the lr
read only that record (post-processing), and replicas and ``hiso rebuild`` replay it bit for
bit. The noise comes from a generator keyed by a secret (``noise_seed``) that is never sent
or logged with the run, and by the round and attempt, so a resumed run draws the same noise
as the uninterrupted one, and a client that knows the run seed cannot subtract it.

Accounting (:func:`epsilon`, with Google's ``dp-accounting``, RDP accountant): clients are
sampled m of M without replacement each round, so a client's data enter a round with
probability q = m / M. Central mode is the subsampled Gaussian mechanism under the
replace-one relation (``SampledWithoutReplacementDpEvent``, Wang, Balle and Kasiviswanathan
2019): replacing one client's data moves the clipped sum by at most 2C, so the noise
multiplier relative to that sensitivity is z / 2. Local mode protects each client against the
server too, which knows who was sampled: no amplification by sampling; a client that took part
in n rounds has spent the n-fold composition of a Gaussian mechanism with multiplier z / 2
(reported for a client that took part in every round: an upper bound for every client).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..core.seeds import secret_key

MODES = ("central", "local")
_SALT_NOISE = 0x6870DB  # keys the noise streams apart from every other stream of a run
# RDP orders: a coarse grid (each order of the without-replacement bound costs a sum over alpha
# terms): epsilon is the minimum over them, so a coarser grid can only report a larger epsilon
RDP_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 64.0)


@dataclass(frozen=True)
class DPConfig:
    """Clip norm C, noise multiplier z (noise std z C per entry), and where the noise is added."""

    clip: float
    noise_multiplier: float
    mode: Literal["central", "local"] = "central"

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"dp clip must be > 0, got {self.clip}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"dp noise multiplier must be >= 0, got {self.noise_multiplier}")
        if self.mode not in MODES:
            raise ValueError(f"dp mode must be central or local, got {self.mode!r}")

    @property
    def std(self) -> float:
        """The noise's standard deviation per entry: z C."""
        return self.noise_multiplier * self.clip

    # the hooks the core calls (the server's central wrapper, a client's local answer)
    def private_mean(self, answers, noise_seed: int, round: int, attempt: int = 0) -> np.ndarray:
        return private_mean(answers, self, noise_seed, round, attempt)

    def private_answer(self, g, noise_seed: int, round: int, attempt: int, client: int) -> np.ndarray:
        return private_answer(g, self, noise_seed, round, attempt, client)


noise_key = secret_key  # the secret that keys a run's noise (hiso.core.seeds.secret_key)


def clip(g: np.ndarray, c: float) -> np.ndarray:
    """``g * min(1, c / ||g||_2)`` over all of ``g``'s values, in float64."""
    g = np.asarray(g, dtype=np.float64)
    norm = float(np.sqrt(np.sum(g * g)))
    return g * (c / norm) if norm > c else g.copy()


def noise(noise_seed: int, round: int, attempt: int, shape: tuple[int, ...], std: float,
          client: int | None = None) -> np.ndarray:
    """The Gaussian noise of a round (``client`` None: the server's draw; else that client's
    own draw in local mode), float64, a pure function of the secret and the round."""
    key = [_SALT_NOISE, int(noise_seed), int(round), int(attempt), 0 if client is None else int(client) + 1]
    return np.random.default_rng(key).normal(0.0, std, size=shape)


def private_mean(answers: np.ndarray, cfg: DPConfig, noise_seed: int, round: int, attempt: int = 0) -> np.ndarray:
    """Central mode: the noised mean of the clipped answers (n, tau, P) -> (tau, P), float64."""
    answers = np.asarray(answers, dtype=np.float64)
    total = np.zeros(answers.shape[1:])
    for g in answers:  # in the participants' order: the same sum on every run
        total += clip(g, cfg.clip)
    total += noise(noise_seed, round, attempt, total.shape, cfg.std)
    return total / len(answers)


def private_answer(g: np.ndarray, cfg: DPConfig, noise_seed: int, round: int, attempt: int, client: int) -> np.ndarray:
    """Local mode: what client ``client`` sends: its clipped scalars plus its own noise (float32)."""
    out = clip(g, cfg.clip) + noise(noise_seed, round, attempt, np.shape(g), cfg.std, client)
    return out.astype(np.float32)


def _accountant():
    try:
        import dp_accounting
    except ImportError as e:  # an optional extra
        raise ImportError("privacy accounting needs dp-accounting: pip install 'hiso[privacy]'") from e
    return dp_accounting


def epsilon(noise_multiplier: float, rounds: int, delta: float, *, clients: int, sampled: int,
            mode: str = "central", participations: int | None = None) -> float:
    """The epsilon spent after ``rounds`` rounds at ``delta`` (see the module docstring): central
    mode with sampling m = ``sampled`` of M = ``clients`` per round; local mode for a client that
    took part in ``participations`` rounds (default: every round)."""
    if not 0 < delta < 1:
        raise ValueError(f"dp delta must be in (0, 1), got {delta}")
    if rounds <= 0:
        return 0.0
    if noise_multiplier == 0:
        return float("inf")
    dpa = _accountant()
    acc = dpa.rdp.RdpAccountant(list(RDP_ORDERS), dpa.NeighboringRelation.REPLACE_ONE)
    gauss = dpa.GaussianDpEvent(noise_multiplier / 2.0)  # replace-one sensitivity of a clipped sum: 2C
    if mode == "central":
        event = dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(clients, sampled, gauss), rounds)
    else:
        n = rounds if participations is None else participations
        if n <= 0:
            return 0.0
        event = dpa.SelfComposedDpEvent(gauss, n)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


epsilon = functools.lru_cache(maxsize=4096)(epsilon)


def noise_for(target_epsilon: float, rounds: int, delta: float, *, clients: int, sampled: int,
              mode: str = "central", tol: float = 1e-2) -> float:
    """The smallest noise multiplier z (to ``tol`` relative) whose epsilon after ``rounds``
    rounds is at most ``target_epsilon`` (bisection on :func:`epsilon`)."""
    if not target_epsilon > 0:
        raise ValueError(f"dp epsilon must be > 0, got {target_epsilon}")

    def eps(z):
        return epsilon(z, rounds, delta, clients=clients, sampled=sampled, mode=mode)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon} in {rounds} rounds")
    while hi - lo > tol * hi:
        mid = (lo + hi) / 2
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi
