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

Under either mode nothing else of a client's data leaves it: its answer carries no training
loss (the runners ask for none, :func:`reports_loss`), so ``metrics.jsonl``'s ``train_loss`` is
null; the server's evaluation (on data of its own) is reported as always.

What every replica applies is the noised aggregate the server logs: H, momentum and the lr
read only that record (post-processing), and replicas and ``hiso rebuild`` replay it bit for
bit. The noise comes from a generator keyed by a secret (``noise_seed``) that is never sent
or logged with the run, and by the round and attempt, so a resumed run draws the same noise
as the uninterrupted one, and a client that knows the run seed cannot subtract it.

Threat models and accounting (Google's ``dp-accounting``, RDP accountant, replace-one relation:
replacing one client's data moves a round's clipped sum by at most 2C, so the noise multiplier
relative to that sensitivity is z / 2). Who is sampled decides which epsilon holds:

* ``public-sample`` (every hiso run): the reader may know which clients took part in each
  round. In hiso they all can: the sample follows from the run seed, which every client gets
  in the server's welcome and config.json records, and ``history.bin`` lists each round's
  participants. So there is no amplification by sampling: a client that took part in n rounds
  has spent the n-fold composition of a Gaussian mechanism with multiplier z / 2
  (:func:`epsilon_spent`), and a run reports the epsilon of its worst client, the one that
  took part in the most rounds (a client that took part in fewer has spent less). Central
  mode holds it against every client and whoever reads the run's log (not the server, which
  sees the answers before its noise); local mode against everybody, the server included.
  (The simulator, ``hiso run``, keys the clients' local noise with the run's secret too, so
  there the server's side is simulated; a Flower node draws its own.)
* ``secret-sample``: a reader who cannot tell who was sampled (m of M drawn without
  replacement, so a client's data enter a round with probability q = m / M) faces the
  epsilon amplified by sampling (:func:`epsilon_amplified`; ``SampledWithoutReplacementDpEvent``,
  Wang, Balle and Kasiviswanathan 2019): far smaller (1,000 clients, 10 a round, z = 1, 500
  rounds, delta 1e-5: 15.6, against 59.3 for the client that seed 0's sample puts in 13
  rounds). No reader of a hiso run is in that position (see above), so no run reports it; it
  is here for comparison with papers that quote it.

Planning (``dp_epsilon``, :func:`noise_for`): the noise multiplier is solved so that the
worst client of the run's own sample spends at most the budget. The sample is a function of
the run seed alone (not of any data), so it is known before the run:
:func:`planned_participations` draws it as the server will. A round planned again (faults,
dropouts) draws a fresh sample, so a run can see more participations than planned; the
runner then stops before the round that would pass the budget.
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
        raise ImportError("privacy accounting needs dp-accounting: pip install -e '.[privacy]' in hiso's clone") from e
    return dp_accounting


THREAT_MODELS = ("public-sample", "secret-sample")
# what each run's reported epsilon holds against, by DP mode (summary.json's "holds_against")
HOLDS_AGAINST = {
    "central": ("every client and whoever reads the run's log (config.json, history.bin, metrics.jsonl; not "
                "dp_secret.json, the noise's key), all of whom may know which clients took part in each round; "
                "not the server, which sees each answer before its noise"),
    "local": ("everybody, the server included, all of whom may know which clients took part in each round"),
}


def reports_loss(dp: DPConfig | None) -> bool:
    """Whether a client's answer may carry its training loss: not under DP (in any mode), where
    the loss would leave the client neither clipped, noised nor accounted for."""
    return dp is None


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"dp delta must be in (0, 1), got {delta}")


@functools.lru_cache(maxsize=4096)
def epsilon_spent(noise_multiplier: float, participations: int, delta: float) -> float:
    """The epsilon at ``delta`` of a client whose clipped answers entered ``participations``
    rounds, each with Gaussian noise of std z C (central: on the sum; local: on its answer),
    against a reader who knows the sample: the n-fold composition of a Gaussian mechanism with
    multiplier z / 2, no amplification by sampling (``public-sample``; module docstring)."""
    _check_delta(delta)
    if participations <= 0:
        return 0.0
    if noise_multiplier == 0:
        return float("inf")
    return _rdp_epsilon(lambda dpa, gauss: dpa.SelfComposedDpEvent(gauss, int(participations)), noise_multiplier,
                        delta)


@functools.lru_cache(maxsize=4096)
def epsilon_amplified(noise_multiplier: float, rounds: int, delta: float, *, clients: int, sampled: int) -> float:
    """The epsilon at ``delta`` after ``rounds`` rounds of ``sampled`` of ``clients`` drawn
    without replacement, amplified by sampling: it holds only against a reader who cannot tell
    who was sampled (``secret-sample``), which no reader of a hiso run is (module docstring)."""
    _check_delta(delta)
    if rounds <= 0:
        return 0.0
    if noise_multiplier == 0:
        return float("inf")
    return _rdp_epsilon(lambda dpa, gauss: dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(clients, sampled, gauss), rounds), noise_multiplier, delta)


def _rdp_epsilon(event, noise_multiplier: float, delta: float) -> float:
    """The RDP accountant's epsilon at ``delta`` of ``event(dpa, gauss)``, ``gauss`` the Gaussian
    mechanism with multiplier z / 2 (the replace-one sensitivity of a clipped sum is 2C)."""
    dpa = _accountant()
    acc = dpa.rdp.RdpAccountant(list(RDP_ORDERS), dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(event(dpa, dpa.GaussianDpEvent(noise_multiplier / 2.0)))
    return float(acc.get_epsilon(delta))


def noise_for(target_epsilon: float, participations: int, delta: float, tol: float = 1e-2) -> float:
    """The smallest noise multiplier z (to ``tol`` relative) at which a client that takes part in
    ``participations`` rounds spends at most ``target_epsilon`` (:func:`epsilon_spent`; bisection)."""
    if not target_epsilon > 0:
        raise ValueError(f"dp epsilon must be > 0, got {target_epsilon}")

    def eps(z):
        return epsilon_spent(z, participations, delta)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon} over {participations} "
                             f"participations")
    while hi - lo > tol * hi:
        mid = (lo + hi) / 2
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def participation_counts(seed: int, clients: int, sampled: int, rounds: int) -> np.ndarray:
    """How many of the first ``rounds`` samples each client is in, drawn as the server draws
    them for run seed ``seed`` (its client sampler; no round planned again)."""
    from ..core.server import client_sampler, sample_clients  # (the core imports this module)
    rng, counts = client_sampler(seed), np.zeros(clients, dtype=np.int64)
    for _ in range(rounds):
        counts[list(sample_clients(rng, clients, sampled))] += 1
    return counts


@functools.lru_cache(maxsize=64)
def planned_participations(seed: int, clients: int, sampled: int, rounds: int) -> int:
    """The most rounds any one client takes part in over a run's ``rounds`` planned samples
    (what :func:`noise_for` plans a budget for; module docstring, "Planning")."""
    return int(participation_counts(seed, clients, sampled, rounds).max(initial=0))
