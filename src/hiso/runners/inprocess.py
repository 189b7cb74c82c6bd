"""Clients that answer in this process: the in-process transport every simulator plays its
rounds over (:func:`hiso.core.round.play_round`), and FedKSeed's in-process runner on it.

:class:`InProcess` hands each sampled client its downlink bytes and returns its uplink bytes
(``runner.reply(client, down)``), counting them; a simulator with faults or attackers
(``runner.unreliable``) sends them through its own fates (:meth:`hiso.runners.simulate.Simulation._send`).

:class:`FedKSeedSimulation` drives FedKSeed's server (:class:`~hiso.methods.fedkseed_rounds.PoolRounds`)
over it. ``fast`` mode: one shared replica (materialised once a round) answers for every client;
``faithful`` mode: every client that was ever sampled keeps its own replica, folds the records its
downlink bytes carry and materialises x_r itself (then it must equal the server's, bit for bit:
tests check it). Clients are sampled as for every other algorithm (same seed, same clients).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..core.errors import MessageError
from ..core.perturb import Perturber
from ..core.round import PlainTransport, play_round, replay_log
from ..methods.fedkseed import PoolRecord, PoolReplica, decode_pool_downlink
from ..methods.fedkseed_rounds import PoolRounds, pool_answer, pool_replica
from .client_cost import ClientCost, Timer, model_bytes
from .common import Comm, CommTally, metric_rows, start_round
from .runner import Runner


class InProcess(PlainTransport):
    """The simulators' transport: each sampled client answers its downlink bytes in this
    process (``runner.reply``); with faults or attackers, the fates of the runner's ``_send``
    (lost, late, repeated, damaged answers, lies) and a CRC-32 frame (``runner.sealed``)."""

    def __init__(self, runner):
        self.runner = runner

    def exchange(self, plan, downlink, tally) -> list:
        sim = self.runner
        if sim.unreliable:
            # late answers arrive once their round has closed. (Not in a re-planned attempt of
            # the same round: an uplink names its round by number only, so an answer to the
            # earlier attempt's seeds would pass for a valid one; Flower matches replies to messages.)
            return [(None, d) for d in sim._send(plan, sim._live_answer, downlink)]
        out = []
        for cid in plan.participants:
            up = sim.reply(cid, downlink(cid))
            tally.up(cid, len(up))
            out.append((cid, up))
        return out

    def unwrap(self, reply: bytes) -> bytes:
        return self.runner._unseal(reply) if self.runner.sealed else reply


def _refused(plan, client, code: str, why: str) -> None:
    raise MessageError(why)  # a reliable run: an answer that cannot be used stops it, as it says


class FedKSeedSimulation(Runner):
    """FedKSeed's in-process runner (see the module docstring), with
    :class:`~hiso.runners.simulate.Simulation`'s interface (``run``, ``comm``, ``state``,
    ``model``, ``state_dict``, ``resume``)."""

    def __init__(self, task, cfg, on_record: Callable | None = None):
        self.task, self.cfg = task, cfg
        self.rounds = PoolRounds(pool_replica(cfg, task.build_model), task.num_clients, cfg.sampled, cfg.seed,
                                 cfg.scalar_dtype, on_record)
        self.replica = self.rounds.replica
        self.state, self.zo = self.replica.state, self.replica.state.cfg
        self.perturber = self._perturber(self.replica)
        self.clients: dict[int, tuple[PoolReplica, Perturber]] = {}
        self.comm = Comm.zeros(task.num_clients)
        self.tally, self.transport, self.cost = CommTally(self.comm), InProcess(self), ClientCost()
        self.rounds.joins(self.tally)  # every client joins once, at x_0

    def _perturber(self, rep: PoolReplica) -> Perturber:
        return Perturber(rep.state.model, rep.state.params, self.cfg.perturb_mode, self.cfg.batch_memory_bytes)

    @property
    def model(self):
        return self.state.model

    @property
    def records(self) -> list[PoolRecord]:
        return self.rounds.records

    def _answer(self, cid: int, rep: PoolReplica, perturber: Perturber, count: bool = True) -> bytes:
        up, work = pool_answer(cid, rep, perturber, self.task.loss,
                               lambda r, k: self.task.batch(cid, r, k, self.cfg.batch_size), self.cfg.seed,
                               self.cfg.scalar_dtype)
        if count:
            self.cost.add(work, 0.0)  # its seconds are added by the caller, who times the whole answer
        return up

    def measure_client(self) -> None:
        """A client's resident bytes (its model and x_0's trainable tensors) and the transient
        peak of one answer, on the shared replica (left as it was)."""
        st = self.replica.state
        self.cost.measure(lambda: self._answer(0, self.replica, self.perturber, count=False),
                          model_bytes(st.model, self.replica.x0), st.params[0].device)

    def _client(self, cid: int) -> tuple[PoolReplica, Perturber]:
        """The faithful-mode client ``cid``, created at x_0 the first time it is sampled."""
        if cid not in self.clients:
            rep = pool_replica(self.cfg, self.task.build_model)
            self.clients[cid] = (rep, self._perturber(rep))
        return self.clients[cid]

    def reply(self, cid: int, down: bytes) -> bytes:
        """Client ``cid``'s encoded uplink to its downlink bytes (timed)."""
        if self.cfg.mode == "faithful":
            rep, pert = self._client(cid)
            with Timer() as t:
                rnd, missed = decode_pool_downlink(down, self.rounds.tau, self.rounds.K, self.rounds.dtype)
                rep.catch_up(missed[rep.round - (rnd - len(missed)):])
                up = self._answer(cid, rep, pert)
        else:
            with Timer() as t:
                up = self._answer(cid, self.replica, self.perturber)
        self.cost.seconds += t.s
        return up

    def step(self) -> float:
        """One round (:func:`hiso.core.round.play_round`); the participants' mean training loss."""
        played = play_round(self.rounds, self.transport, self.tally, on_reject=_refused)
        return float(np.mean([u.loss for u in played.answers]))

    def run(self, rounds: int, start: int | None = None, wall: float = 0.0) -> Iterator[dict]:
        """As :meth:`hiso.runners.simulate.Simulation.run`: up to round ``rounds``, from where it is."""
        return metric_rows(self.task, self.model, self.comm, self.step, rounds, self.cfg.eval_every,
                           start=start_round(len(self.records), rounds, start), wall=wall, cost=self.cost)

    def resume(self, records: list[PoolRecord]) -> None:
        """Bring a new simulation to the end of an interrupted run's log as if it had run it
        (:func:`hiso.core.round.replay_log`); in faithful mode each client
        that took part is rebuilt at the round it last answered."""
        if self.rounds.round:
            raise RuntimeError("resume() needs a simulation that has not run yet")
        last = replay_log(self.rounds, records, self.tally)
        if self.cfg.mode == "faithful":
            for cid, r in last.items():
                rep = pool_replica(self.cfg, self.task.build_model)
                rep.catch_up(records[:r])
                self.clients[cid] = (rep, self._perturber(rep))

    def state_dict(self) -> dict:
        return self.replica.state_dict()

    def sync_all(self) -> None:
        """Bring every faithful client to the server's round (tests)."""
        for rep, _ in self.clients.values():
            rep.catch_up(self.records[rep.round:])
