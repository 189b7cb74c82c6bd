"""The server's side of the protocol: sampling, seeds, aggregation and the history log.

The server decides who trains, derives each round's seeds from the run's seed, the round and
the round's attempt (:mod:`hiso.core.seeds`: nothing to draw, store or send), averages the
scalars it receives and remembers, per client, which round's state that client holds, so the
downlink can carry exactly the history the client missed.

Bounded catch-up: given the runner's replica of the model (``replica``, the
:class:`~hiso.core.state.ModelState` it keeps for evaluation anyway), a client that missed
more than ``snapshot_after`` rounds gets a *snapshot* (the replica's trainable tensors, H and
round) instead of the history. Without an explicit K the server picks the K where a snapshot
becomes cheaper: in bytes, or, given a ``bandwidth`` (bytes/s), in transfer plus replay time.
The server then keeps only the last K records (what a client within K rounds still needs):
memory K x (tau*P scalars + participants), whatever the run's length. Without a replica it
keeps the whole history and never sends snapshots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from .aggregate import SecureSum, build_combine
from .history import RoundRecord
from .messages import Downlink, MessageError, Uplink, Wire, encode_state, quantize, state_size, varint_size
from .method import DECOMFL
from .uplink import uplink_codec

# parameter-directions replayed per second, for the automatic snapshot choice with a bandwidth
# (one direction of one parameter: a Gaussian draw and a multiply-add; measured order on a CPU)
REPLAY_RATE = 1e8


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
    attempt: int = 0


def auto_snapshot_after(state_bytes: int, record_bytes: int, *, bandwidth: float | None = None,
                        replay_s: float = 0.0) -> int:
    """The K beyond which a snapshot (``state_bytes``) is cheaper than K missed records of
    ``record_bytes`` each: in bytes, or with ``bandwidth`` (bytes/s) in time, each missed round
    also costing ``replay_s`` seconds of replay."""
    per_round = record_bytes + (bandwidth * replay_s if bandwidth is not None else 0.0)
    return int(state_bytes // max(per_round, 1e-12))


class Server:
    """Seeded state machine: ``plan()`` -> ``downlink(c)`` for each participant -> ``aggregate()``.

    Over a real network a round closes with whoever answered: ``aggregate(uplinks,
    partial=True)`` averages the valid answers it got, records exactly those clients as the
    round's participants and drops the rest (foreign, duplicate, wrong round or shape; see
    ``rejected``). A client that did not answer keeps its old ``synced`` round, so its next
    downlink starts there; the client skips the records it already holds (it may have caught
    up before its reply was lost). A round with no valid answer at all is *re-planned*:
    nothing is logged, the round number stays, and the next ``plan()`` draws a fresh sample
    and derives fresh (never reused) seeds from the round's next attempt; the record keeps its
    attempt, so any replica derives the same seeds. So the log only ever holds rounds somebody
    computed, and an empty round never moves x or H.

    ``history`` holds the kept records, rounds ``first`` .. ``round - 1`` (all of them
    without a replica; the last ``snapshot_after`` with one): see :meth:`records_since`.
    """

    def __init__(self, num_clients: int, clients_per_round: int, local_steps: int,
                 perturbations: int, seed: int = 0, weights: list[float] | None = None, *,
                 rule: str = "mean", trim: float = 0.25,
                 scalar_dtype: str = "float32", replica=None, snapshot_after: int | None = None,
                 bandwidth: float | None = None, replay_rate: float = REPLAY_RATE,
                 dp=None, noise_seed: int = 0, secagg=None, method=None):
        if num_clients < 1:
            raise ValueError(f"need at least one client, got {num_clients}")
        if not 1 <= clients_per_round <= num_clients:
            raise ValueError(f"clients per round must be in [1, {num_clients}], got {clients_per_round}")
        if weights is not None and (len(weights) != num_clients or min(weights) <= 0):
            raise ValueError("weights must be one positive number per client")
        method = DECOMFL if method is None else method  # (hiso.core.method: its hooks' defaults)
        # the uplink's codec (hiso.core.uplink): the method's
        wire = Wire(local_steps, perturbations, scalar_dtype, seed, uplink_codec(method))
        # how the answers become the round's aggregate: the method's combine over the base rule
        # (hiso.core.aggregate), wrapped by central DP and the secure sum, built once here
        own = type(method).combine is not type(DECOMFL).combine  # its own rule (a vote, ...)
        self.combine = build_combine(method.combine, rule, trim, weighted=weights is not None, own=own, dp=dp,
                                     noise_seed=noise_seed, secagg=secagg)
        self.M, self.m = num_clients, clients_per_round
        self.shape = (local_steps, perturbations)
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        # separate streams: who is sampled does not depend on how many seeds a round draws,
        # so every algorithm (scalar-only or full-model) sees the same participants for a seed
        self._sample_rng = client_sampler(seed)
        self.wire = wire
        self.attempt = 0  # how often the current round was planned and abandoned
        self.history: list[RoundRecord] = []  # the kept records: rounds first .. round-1
        self.first = 0
        self.replica = replica
        self.snapshot_after: int | None = None
        if replica is not None:
            if snapshot_after is not None and snapshot_after < 0:
                raise ValueError(f"snapshot_after must be >= 0, got {snapshot_after}")
            d = sum(p.numel() for p in replica.params)
            self.snapshot_after = snapshot_after if snapshot_after is not None else auto_snapshot_after(
                self.snapshot_bytes(), self.wire.record_bytes, bandwidth=bandwidth,
                replay_s=self.wire.n * d / replay_rate)
        self._snap: tuple[int, bytes] | None = None  # (round, encoded state) of the current round
        self.synced = np.zeros(num_clients, dtype=np.int64)  # round whose start state each client holds
        self._plan: RoundPlan | None = None
        self.rejected: list[str] = []  # why the last partial aggregate dropped answers
        # the same as codes: wrong_round, not_sampled, duplicate, shape, non_finite
        self.rejected_reasons: list[str] = []
        self.replanned = 0  # rounds closed with no valid answer (and planned again)

    @property
    def round(self) -> int:
        return self.first + len(self.history)

    @property
    def planned(self) -> RoundPlan | None:
        """The open round's plan (from :meth:`plan`, until it is aggregated or re-planned), or None."""
        return self._plan

    def snapshot_bytes(self) -> int:
        """Bytes of a snapshot downlink now (header and state), 0 without a replica."""
        if self.replica is None:
            return 0
        return 2 + varint_size(self.round) + varint_size(self.attempt) + state_size(self.replica)

    def records_since(self, r: int) -> tuple[RoundRecord, ...]:
        """The kept records of rounds r .. round-1 (r must not be before ``first``)."""
        if r < self.first:
            raise ValueError(f"round {r} is no longer kept (the server keeps rounds {self.first}..{self.round - 1})")
        return tuple(self.history[r - self.first:])

    def _log(self, rec: RoundRecord) -> None:
        self.history.append(rec)
        self._snap = None  # the next round's snapshot is another state
        if self.snapshot_after is not None and len(self.history) > self.snapshot_after:
            drop = len(self.history) - self.snapshot_after
            del self.history[:drop]
            self.first += drop

    def plan(self) -> RoundPlan:
        """Sample this round's clients (uniformly, without replacement); its seeds derive from
        the run seed, the round and the attempt (a re-planned round gets fresh ones)."""
        if self._plan is not None:
            raise RuntimeError(f"round {self.round} is already planned; aggregate it first")
        self._plan = RoundPlan(self.round, sample_clients(self._sample_rng, self.M, self.m),
                               self.wire.seeds(self.round, self.attempt), self.attempt)
        return self._plan

    def downlink(self, client: int) -> Downlink:
        """The message for a sampled client: the round's seeds and every record it missed, or
        the replica's state if it missed more than ``snapshot_after`` rounds."""
        plan = self._current()
        if client not in plan.participants:
            raise ValueError(f"client {client} is not sampled in round {plan.round}")
        since = int(self.synced[client])
        if self.snapshot_after is not None and plan.round - since > self.snapshot_after:
            return Downlink(plan.round, plan.seeds, plan.round, (), plan.attempt, self._snapshot())
        return Downlink(plan.round, plan.seeds, since, self.records_since(since), plan.attempt)

    def _snapshot(self) -> bytes:
        if self.replica.round != self.round:
            raise RuntimeError(f"the replica is at round {self.replica.round}, the server at {self.round}: apply "
                               f"every record to the replica before the next round's downlinks")
        if self._snap is None or self._snap[0] != self.round:
            self._snap = (self.round, encode_state(self.replica))
        return self._snap[1]

    def aggregate(self, uplinks: list[Uplink], *, partial: bool = False) -> RoundRecord | None:
        """Combine the answers' scalars (by ``rule``: the weighted mean by default; see
        :mod:`hiso.core.aggregate`), log and close the round.

        Strict (default): every participant must answer exactly once; otherwise nothing
        changes. ``partial=True``: the valid answers are averaged and the others dropped (the
        reasons go to ``rejected``); with no valid answer (under secure aggregation: fewer than
        its threshold) the round is re-planned and None is returned (nothing logged, nobody's
        ``synced`` round moves).
        """
        plan = self._current()
        by_client: dict[int, Uplink] = {}
        rejected: list[str] = []
        reasons: list[str] = []
        for up in uplinks:
            why = code = None
            if up.round != plan.round:
                why, code = f"uplink from client {up.client} is for round {up.round}, not {plan.round}", "wrong_round"
            elif up.attempt != plan.attempt:
                why = f"uplink from client {up.client} answers an abandoned plan of round {plan.round}"
                code = "abandoned_attempt"
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
        # nobody computed this round, or fewer than the combine needs (secure aggregation's threshold:
        # SecAgg+ cannot unmask a sum of fewer, and a sum of one is that client's answer): plan it
        # again, log nothing
        if len(by_client) < max(1, self.combine.min_answers):
            self._plan = None
            self.replanned += 1
            self.attempt += 1
            return None
        answered = tuple(c for c in plan.participants if c in by_client)
        g = np.stack([by_client[c].scalars.astype(np.float64) for c in answered])
        w = np.ones(len(g)) if self.weights is None else self.weights[list(answered)]
        return self._close(plan, answered, np.asarray(self.combine(g, w, plan)).astype(np.float32))

    def close_secure(self, answered, total) -> RoundRecord:
        """Close the open round with the integer sum ``total`` (tau, P) of the grid levels of
        ``answered``'s answers (:mod:`hiso.methods.secagg`): all a secure aggregation tells the
        server. Its mean (plus the DP noise, central mode) is logged as :meth:`aggregate` would."""
        plan = self._current()
        if not isinstance(self.combine, SecureSum):
            raise RuntimeError("this server was built without secure aggregation")
        answered = tuple(int(c) for c in answered)
        if not answered or len(set(answered)) != len(answered) or not set(answered) <= set(plan.participants):
            raise MessageError(f"round {plan.round}: a secure sum of {list(answered)} is not of distinct sampled clients")
        total = np.asarray(total, dtype=np.int64)
        if total.shape != self.shape:
            raise MessageError(f"round {plan.round}: a secure sum of shape {total.shape}, expected {self.shape}")
        agg = self.combine.from_sum(total, len(answered), plan)
        return self._close(plan, tuple(c for c in plan.participants if c in answered), agg.astype(np.float32))

    def _close(self, plan: RoundPlan, answered: tuple[int, ...], agg: np.ndarray) -> RoundRecord:
        # logged (and so applied by every replica) as the wire carries it: exact by construction
        rec = RoundRecord(plan.round, plan.seeds, quantize(agg, self.wire.dtype), answered, plan.attempt)
        self._log(rec)
        self.synced[list(answered)] = plan.round
        self._plan = None
        self.attempt = 0
        return rec

    def plan_logged(self, rec: RoundRecord, max_draws: int = 1000, on_plan=None) -> RoundPlan:
        """Resume: plan round ``rec.round`` again, as the interrupted run did: ``rec.attempt``
        abandoned plans (each draws its sample, counted in ``replanned`` as it was), then the
        logged one, whose seeds must be the logged ones and whose sample must hold the logged
        participants. Close it with :meth:`close_logged`. ``on_plan(plan)`` is called for each
        plan, abandoned ones included, while it is open (its downlinks can be made)."""
        if rec.round != self.round:
            raise ValueError(f"the server is at round {self.round}, cannot replay record {rec.round}")
        if not 0 <= rec.attempt < max_draws:
            raise ValueError(f"round {rec.round}: attempt {rec.attempt} is out of range")
        for _ in range(rec.attempt - self.attempt):
            plan = self.plan()
            if on_plan is not None:
                on_plan(plan)
            self._plan = None
            self.replanned += 1
            self.attempt += 1
        plan = self.plan()
        if not np.array_equal(plan.seeds, rec.seeds) or plan.attempt != rec.attempt:
            self._plan = None
            raise ValueError(f"round {rec.round}: the logged seeds are not the ones this run derives: the log was "
                             f"written with another seed or by hiso before protocol v2")
        if not set(rec.participants) <= set(plan.participants):
            self._plan = None
            raise ValueError(f"round {rec.round}: logged participants {list(rec.participants)} were not "
                             f"sampled ({list(plan.participants)}): the log is not this run's")
        if on_plan is not None:
            on_plan(plan)
        return plan

    def close_logged(self, rec: RoundRecord) -> None:
        """Resume: close the round planned by :meth:`plan_logged` with its logged record."""
        plan = self._current()
        if rec.round != plan.round or not np.array_equal(rec.seeds, plan.seeds):
            raise ValueError(f"record {rec.round} does not match the planned round {plan.round}")
        self._log(rec)
        self.synced[list(rec.participants)] = plan.round
        self._plan = None
        self.attempt = 0

    def state_dict(self) -> dict:
        """What this server needs to continue, between rounds (torch.optim style; see
        :meth:`load_state_dict`): the kept records and ``first``, each client's ``synced``
        round, the open round's ``attempt``, ``replanned`` and the client sampler's position.
        The configuration (clients, shape, run seed, rule, weights, replica) is the
        constructor's; the replica has its own :meth:`ModelState.state_dict`."""
        if self._plan is not None:
            raise RuntimeError(f"round {self.round} is planned: save the server between rounds")
        return {"first": self.first, "history": list(self.history), "synced": self.synced.copy(),
                "attempt": self.attempt, "replanned": self.replanned,
                "sampler": copy.deepcopy(self._sample_rng.bit_generator.state)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved into a server built with the same arguments.
        Everything is checked first (keys, the records' rounds, shape and seeds against this
        run's seed, one synced round per client), so a mismatch raises ValueError and changes
        nothing."""
        if self._plan is not None:
            raise RuntimeError(f"round {self.round} is planned: load a state between rounds")
        keys = {"first", "history", "synced", "attempt", "replanned", "sampler"}
        if set(state) != keys:
            raise ValueError(f"server state must have keys {sorted(keys)}, got {sorted(state)}")
        first, history = int(state["first"]), list(state["history"])
        synced = np.asarray(state["synced"])
        if synced.shape != self.synced.shape:
            raise ValueError(f"server state has {synced.size} clients' synced rounds, this server has {self.M} clients")
        for i, rec in enumerate(history):
            if rec.round != first + i:
                raise ValueError(f"server state's record {i} is round {rec.round}, expected {first + i}")
            if rec.seeds.shape != self.shape:
                raise ValueError(f"server state's record {rec.round} has shape {rec.seeds.shape}, expected {self.shape}")
            if not np.array_equal(rec.seeds, self.wire.seeds(rec.round, rec.attempt)):
                raise ValueError(f"server state's record {rec.round} has seeds of another run seed")
        rnd = first + len(history)
        if first < 0 or synced.min(initial=0) < 0 or synced.max(initial=0) > rnd:
            raise ValueError(f"server state's synced rounds must lie in [0, {rnd}]")
        sampler = state["sampler"]
        if sampler.get("bit_generator") != self._sample_rng.bit_generator.state["bit_generator"]:
            raise ValueError(f"server state's sampler is a {sampler.get('bit_generator')}, "
                             f"not this server's {self._sample_rng.bit_generator.state['bit_generator']}")
        self._sample_rng.bit_generator.state = copy.deepcopy(sampler)
        self.first, self.history = first, history
        self.synced = synced.astype(np.int64, copy=True)
        self.attempt, self.replanned = int(state["attempt"]), int(state["replanned"])
        self._snap = None
        self.rejected, self.rejected_reasons = [], []

    def client_holds(self, client: int, round: int) -> None:
        """A client told us which round's state it holds (e.g. it restarted from an older
        copy, or from x_0): its next downlink starts there. Only ever moves ``synced`` back."""
        if not 0 <= round <= self.round:
            raise MessageError(f"client {client} claims round {round}; the server is at round {self.round}")
        self.synced[client] = min(int(self.synced[client]), round)

    def _current(self) -> RoundPlan:
        if self._plan is None:
            raise RuntimeError("no round is planned; call plan() first")
        return self._plan
