"""The server's side of the protocol: sampling, seeds, aggregation and the history log.

The server needs no model: it decides who trains and with which seeds, averages the scalars
it receives and remembers, per client, which round's state that client holds, so the
downlink can carry exactly the history the client missed. (A runner may keep a
:class:`~hiso.core.state.ModelState` beside it for evaluation.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .aggregate import check_rule, combine
from .history import RoundRecord
from .messages import Downlink, MessageError, Uplink


def client_sampler(seed: int) -> np.random.Generator:
    """The generator that picks each round's clients for a run seed."""
    return np.random.default_rng([seed, 0])


def sample_clients(rng: np.random.Generator, num_clients: int, k: int) -> tuple[int, ...]:
    """k of num_clients uniformly without replacement, sorted."""
    return tuple(int(c) for c in np.sort(rng.choice(num_clients, size=k, replace=False)))


@dataclass(frozen=True)
class RoundPlan:
    round: int
    participants: tuple[int, ...]
    seeds: np.ndarray  # (tau, P) uint64


class Server:
    """Seeded state machine: ``plan()`` -> ``downlink(c)`` for each participant -> ``aggregate()``.

    Over a real network a round closes with whoever answered: ``aggregate(uplinks,
    partial=True)`` averages the valid answers it got, records exactly those clients as the
    round's participants and drops the rest (foreign, duplicate, wrong round or shape; see
    ``rejected``). A client that did not answer keeps its old ``synced`` round, so its next
    downlink starts there; the client skips the records it already holds (it may have caught
    up before its reply was lost). A round with no valid answer at all is *re-planned*:
    nothing is logged, the round number stays, and the next ``plan()`` draws a fresh sample
    and fresh (never reused) seeds. So the log only ever holds rounds somebody computed, and
    an empty round never moves x or H.
    """

    def __init__(self, num_clients: int, clients_per_round: int, local_steps: int,
                 perturbations: int, seed: int = 0, weights: list[float] | None = None,
                 rule: str = "mean", trim: float = 0.25):
        if num_clients < 1:
            raise ValueError(f"need at least one client, got {num_clients}")
        if not 1 <= clients_per_round <= num_clients:
            raise ValueError(f"clients per round must be in [1, {num_clients}], got {clients_per_round}")
        if weights is not None and (len(weights) != num_clients or min(weights) <= 0):
            raise ValueError("weights must be one positive number per client")
        check_rule(rule, trim)
        self.M, self.m = num_clients, clients_per_round
        self.rule, self.trim = rule, trim  # how answers are combined (see hiso.core.aggregate)
        self.shape = (local_steps, perturbations)
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        # separate streams: who is sampled does not depend on how many seeds a round draws,
        # so every algorithm (scalar-only or full-model) sees the same participants for a seed
        self._sample_rng = client_sampler(seed)
        self._rng = np.random.default_rng([seed, 1])
        self._used: set[int] = set()
        self.history: list[RoundRecord] = []
        self.synced = np.zeros(num_clients, dtype=np.int64)  # round whose start state each client holds
        self.plan_: RoundPlan | None = None
        self.rejected: list[str] = []  # why the last partial aggregate dropped answers
        # the same as codes: wrong_round, not_sampled, duplicate, shape, non_finite
        self.rejected_reasons: list[str] = []
        self.replanned = 0  # rounds closed with no valid answer (and planned again)

    @property
    def round(self) -> int:
        return len(self.history)

    def _fresh_seeds(self) -> np.ndarray:
        n = self.shape[0] * self.shape[1]
        out = []
        while len(out) < n:
            s = int(self._rng.integers(0, 2**64, dtype=np.uint64))
            if s not in self._used:
                self._used.add(s)
                out.append(s)
        return np.array(out, dtype=np.uint64).reshape(self.shape)

    def plan(self) -> RoundPlan:
        """Sample this round's clients (uniformly, without replacement) and draw its seeds."""
        if self.plan_ is not None:
            raise RuntimeError(f"round {self.round} is already planned; aggregate it first")
        self.plan_ = RoundPlan(self.round, sample_clients(self._sample_rng, self.M, self.m), self._fresh_seeds())
        return self.plan_

    def downlink(self, client: int) -> Downlink:
        """The message for a sampled client: the round's seeds and every record it missed."""
        plan = self._current()
        if client not in plan.participants:
            raise ValueError(f"client {client} is not sampled in round {plan.round}")
        since = int(self.synced[client])
        return Downlink(plan.round, plan.seeds, since, tuple(self.history[since:]))

    def aggregate(self, uplinks: list[Uplink], *, partial: bool = False) -> RoundRecord | None:
        """Combine the answers' scalars (by ``rule``: the weighted mean by default; see
        :mod:`hiso.core.aggregate`), log and close the round.

        Strict (default): every participant must answer exactly once; otherwise nothing
        changes. ``partial=True``: the valid answers are averaged and the others dropped (the
        reasons go to ``rejected``); with no valid answer the round is re-planned and None
        is returned (nothing logged, nobody's ``synced`` round moves).
        """
        plan = self._current()
        by_client: dict[int, Uplink] = {}
        rejected: list[str] = []
        reasons: list[str] = []
        for up in uplinks:
            why = code = None
            if up.round != plan.round:
                why, code = f"uplink from client {up.client} is for round {up.round}, not {plan.round}", "wrong_round"
            elif up.client not in plan.participants:
                why, code = f"client {up.client} was not sampled in round {plan.round}", "not_sampled"
            elif up.client in by_client:
                why, code = f"client {up.client} answered twice in round {plan.round}", "duplicate"
            elif up.scalars.shape != self.shape:
                why = f"client {up.client} sent scalars of shape {up.scalars.shape}, expected {self.shape}"
                code = "shape"
            elif not np.all(np.isfinite(up.scalars)):
                why, code = f"client {up.client} sent a non-finite scalar in round {plan.round}", "non_finite"
            if why is None:
                by_client[up.client] = up
            elif partial:
                rejected.append(why)
                reasons.append(code)
            else:
                raise MessageError(why)
        missing = set(plan.participants) - set(by_client)
        if missing and not partial:
            raise MessageError(f"round {plan.round}: no answer from clients {sorted(missing)}")
        self.rejected, self.rejected_reasons = rejected, reasons
        if not by_client:  # nobody computed this round: plan it again, log nothing
            self.plan_ = None
            self.replanned += 1
            return None
        answered = tuple(c for c in plan.participants if c in by_client)
        g = np.stack([by_client[c].scalars.astype(np.float64) for c in answered])
        w = np.ones(len(g)) if self.weights is None else self.weights[list(answered)]
        agg = combine(g, w, self.rule, self.trim).astype(np.float32)
        rec = RoundRecord(plan.round, plan.seeds, agg, answered)
        self.history.append(rec)
        self.synced[list(answered)] = plan.round
        self.plan_ = None
        return rec

    def plan_logged(self, rec: RoundRecord, max_draws: int = 1000) -> RoundPlan:
        """Resume: plan round ``rec.round`` again, as the interrupted run did. The server's
        draws are seeded, so planning again draws the same clients and seeds; a draw whose
        seeds are not the logged ones is a round the run re-planned (nobody answered): it is
        dropped and counted in ``replanned``, as it was. Close it with :meth:`close_logged`."""
        if rec.round != self.round:
            raise ValueError(f"the server is at round {self.round}, cannot replay record {rec.round}")
        for _ in range(max_draws):
            plan = self.plan()
            if np.array_equal(plan.seeds, rec.seeds):
                if not set(rec.participants) <= set(plan.participants):
                    raise ValueError(f"round {rec.round}: logged participants {list(rec.participants)} were not "
                                     f"sampled ({list(plan.participants)}): the log is not this run's")
                return plan
            self.plan_ = None
            self.replanned += 1
        raise ValueError(f"round {rec.round}: the logged seeds are not among the next {max_draws} this server "
                         f"draws: the log was written with another seed or configuration")

    def close_logged(self, rec: RoundRecord) -> None:
        """Resume: close the round planned by :meth:`plan_logged` with its logged record."""
        plan = self._current()
        if rec.round != plan.round or not np.array_equal(rec.seeds, plan.seeds):
            raise ValueError(f"record {rec.round} does not match the planned round {plan.round}")
        self.history.append(rec)
        self.synced[list(rec.participants)] = plan.round
        self.plan_ = None

    def client_holds(self, client: int, round: int) -> None:
        """A client told us which round's state it holds (e.g. it restarted from an older
        copy, or from x_0): its next downlink starts there. Only ever moves ``synced`` back."""
        if not 0 <= round <= self.round:
            raise MessageError(f"client {client} claims round {round}; the server is at round {self.round}")
        self.synced[client] = min(int(self.synced[client]), round)

    def _current(self) -> RoundPlan:
        if self.plan_ is None:
            raise RuntimeError("no round is planned; call plan() first")
        return self.plan_
