"""FedKSeed's server and client sides of a round (:mod:`hiso.methods.fedkseed`'s pool, replica and
wire), as :func:`hiso.core.round.play_round` drives every method's rounds.

* :class:`PoolRounds`, the server: clients sampled by the run seed's stream (the same clients
  as every other algorithm), each given the records it has not folded yet (its downlink), the
  answers of those who answered combined, in sampled order, into the round's
  :class:`~hiso.methods.fedkseed.PoolRecord`, which is logged and folded into the server's replica.
  A round nobody answered is planned again (partial rounds only). The in-process simulator and
  the Flower ServerApp both drive it, so both write the same log, model and bytes.
* :func:`pool_answer`, the client: its tau pool indices drawn from p, its ZO steps on its
  batches, its encoded uplink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from ..core.config import ZOConfig
from ..core.errors import MessageError
from ..core.estimator import local_update
from ..core.messages import Hello, encode_hello, encode_welcome, quantize, welcome_for
from ..core.perturb import Perturber
from ..core.server import client_sampler, sample_clients
from .fedkseed import PoolRecord, PoolReplica, decode_pool_uplink, draw_indices, encode_pool_downlink, encode_pool_uplink


def pool_config(cfg) -> ZOConfig:
    """The ZO step a FedKSeed client takes (one pool direction per step); ``cfg``: the run's
    configuration (a :class:`~hiso.config.RunConfig`)."""
    return ZOConfig(lr=cfg.lr, mu=cfg.mu, perturbations=1, local_steps=cfg.local_steps, difference=cfg.difference,
                    directions=cfg.directions, scalar_dtype=cfg.scalar_dtype, lr_decay=cfg.lr_decay)


def pool_replica(cfg, build_model: Callable[[], Any]) -> PoolReplica:
    """A replica of the run ``cfg`` at x_0 (``build_model()``: the task's model)."""
    from .fedkseed_method import FedKSeed
    method = FedKSeed.of(cfg)
    return PoolReplica(build_model(), pool_config(cfg), method.seed_pool, cfg.seed, method.seed_sampling)


def pool_answer(cid: int, rep: PoolReplica, perturber: Perturber, loss, batch: Callable[[int, int], Any],
                run_seed: int, dtype: str):
    """Client ``cid``'s encoded uplink for the round ``rep`` holds (its tau pool indices drawn
    from p, its ZO steps on ``batch(round, k)``, k < tau, scored by ``loss``) and the
    :class:`~hiso.core.work.Work` it took; ``rep`` is left as it was. The one computation behind
    the simulator and the Flower ClientApp."""
    r, tau = rep.round, rep.tau
    idx = draw_indices(rep.p(), run_seed, r, cid, tau)
    batches = [batch(r, k) for k in range(tau)]
    res = local_update(rep.state, perturber, loss, batches, rep.seeds[idx].reshape(tau, 1))
    return encode_pool_uplink(cid, r, idx, res.scalars.reshape(-1), res.loss, dtype), res.work


@dataclass(frozen=True)
class PoolPlan:
    round: int
    participants: tuple[int, ...]
    attempt: int = 0


class PoolAnswer(NamedTuple):
    """A decoded pool uplink."""

    client: int
    round: int
    idx: np.ndarray
    g: np.ndarray
    loss: float | None


class PoolRounds:
    """FedKSeed's server as :func:`~hiso.core.round.play_round` drives it (see the module
    docstring): ``records`` (the log), ``synced`` (the round each client holds) and ``replica``
    (the server's x_r). ``on_record(record)`` hears each committed round (the log file)."""

    def __init__(self, replica: PoolReplica, num_clients: int, sampled: int, seed: int, dtype: str,
                 on_record: Callable[[PoolRecord], None] | None = None):
        self.replica, self.num_clients, self.sampled, self.seed = replica, num_clients, sampled, seed
        self.K, self.tau, self.dtype, self.on_record = replica.K, replica.tau, dtype, on_record
        self._sampler = client_sampler(seed)
        self.records: list[PoolRecord] = []
        self.synced = np.zeros(num_clients, dtype=np.int64)
        self.replanned = 0  # plans that closed with no answer
        self._plan: PoolPlan | None = None
        self._attempt = 0
        self._rejected: list[tuple[str, str]] = []

    @property
    def round(self) -> int:
        return len(self.records)

    def joins(self, tally) -> None:
        """Every client's join (its hello up, the welcome down) counted, as before round 1."""
        welcome = encode_welcome(welcome_for(self.replica.state.cfg, self.seed, self.replica.state.params))
        for c in range(self.num_clients):
            tally.up(c, len(encode_hello(Hello(c, 0))))
            tally.down(c, len(welcome))

    def client_holds(self, client: int, round: int) -> None:
        """A node reports the round its pool state holds: its next downlink starts there."""
        self.synced[client] = min(int(round), self.round)

    def plan(self) -> PoolPlan:
        parts = sample_clients(self._sampler, self.num_clients, self.sampled)
        self._plan = PoolPlan(self.round, tuple(parts), self._attempt)
        return self._plan

    def downlink(self, client: int) -> bytes:
        return encode_pool_downlink(self.round, self.records[self.synced[client]:], self.dtype)

    def decode(self, client: int | None, reply: bytes, plan: PoolPlan) -> PoolAnswer:
        u = PoolAnswer(*decode_pool_uplink(reply, self.tau, self.K, self.dtype))
        if (client is not None and u.client != client) or u.round != plan.round:
            raise MessageError(f"partition {client} answered for client {u.client}, round {u.round}")
        return u

    def close(self, answers: list[PoolAnswer], partial: bool) -> PoolRecord | None:
        """The record of those who answered (sampled order; the first answer of each counts),
        or None if nobody did (partial: planned again); strict: every participant must answer."""
        plan, by, self._rejected = self._plan, {}, []
        for u in answers:
            if u.client not in plan.participants or u.client in by:
                self._rejected.append(("duplicate" if u.client in by else "not_sampled",
                                       f"client {u.client}'s answer to round {plan.round} is not counted"))
                continue
            by[u.client] = u
        answered = tuple(c for c in plan.participants if c in by)
        if len(answered) < len(plan.participants) and not partial:
            raise MessageError(f"round {plan.round}: no answer from clients "
                               f"{sorted(set(plan.participants) - set(answered))}")
        if not answered:
            self.replanned += 1
            self._attempt += 1
            return None
        ups = [by[c] for c in answered]
        return PoolRecord(plan.round, answered, np.stack([u.idx for u in ups]),
                          quantize(np.stack([u.g for u in ups]), self.dtype))

    def rejections(self) -> list[tuple[str, str]]:
        return list(self._rejected)

    def commit(self, rec: PoolRecord) -> None:
        """Logged; those who answered hold x_r (their local steps are not kept); the replica moves on."""
        self.records.append(rec)
        self.synced[list(rec.participants)] = rec.round
        self._attempt = 0
        self.replica.catch_up([rec])
        if self.on_record is not None:
            self.on_record(rec)

    def replay(self, records: list[PoolRecord], tally) -> dict[int, int]:
        """Bring a new server to the end of an interrupted run's log as if it had run it: the
        clients sampled again (checked against the log), the bytes of every message counted in
        ``tally`` (as if every sampled client answered), the replica folded and materialised
        once. Returns the round each client last answered."""
        if self.records:
            raise RuntimeError("resume() needs a server that has not run yet")
        last = {}
        for rec in records:
            r = self.round
            parts = sample_clients(self._sampler, self.num_clients, self.sampled)
            if rec.round != r or tuple(parts) != rec.participants:
                raise ValueError(f"history.bin's round {rec.round} was answered by {list(rec.participants)}, "
                                 f"but the run seed samples {list(parts)}: not this run's log")
            for j, cid in enumerate(parts):
                tally.down(cid, len(self.downlink(cid)))
                tally.up(cid, len(encode_pool_uplink(cid, r, rec.idx[j], rec.g[j], 0.0, self.dtype)))
                last[cid] = r
            self.records.append(rec)
            self.synced[list(parts)] = r
        self.replica.catch_up(records)
        return last
