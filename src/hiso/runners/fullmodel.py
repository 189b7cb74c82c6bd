"""In-process federation for the full-model baselines: FedZO, FedAvg, FedAdam, FedYogi, FedAdagrad.

Each round: the same clients as HiSo would get for this seed (the shared sampling stream of
:func:`hiso.core.server.client_sampler`) receive the global model as an encoded d-vector,
train locally from the decoded vector, and send back their encoded update; the server
decodes, averages (weighted by data size if ``weighted``) and applies its optimiser
(:mod:`hiso.baselines.server_opt`). Bytes are counted per client from the encoded messages,
exactly as :class:`~hiso.runners.simulate.Simulation` counts HiSo's, so ``bytes_up`` and
``bytes_down`` compare like with like. The round is :func:`hiso.core.round.play_round` over
:class:`FullRounds` (the server's side, also the Flower ServerApp's) and the clients in process.

Memory: one global model, plus one client copy for the first-order algorithms (reloaded for
each client) or for FedZO with a lossy wire dtype. FedZO over float32 reads the global
model directly: the decoded downlink is bit-identical to it and the ZO steps never write it.

Only trainable parameters travel; buffers stay as :meth:`Task.build_model` made them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..baselines.local import local_work, sgd_local, zo_local
from ..baselines.messages import (FullDownlink, FullUplink, decode_downlink, decode_uplink,
                                  encode_downlink, encode_uplink, flatten, unflatten)
from ..baselines.server_opt import make_server_opt
from ..methods.fullmodel import method_of
from ..config import RunConfig
from ..core.config import ZOConfig
from ..core.messages import MessageError
from ..core.perturb import Perturber
from ..core.round import PlainTransport, play_round
from ..core.server import client_sampler, sample_clients
from ..core.state import ModelState, trainable_params
from ..tasks.base import Task
from .client_cost import ClientCost, Timer, model_bytes
from .common import Comm, CommTally, metric_rows, start_round
from .runner import Runner


def fedzo_config(cfg: RunConfig) -> ZOConfig:
    """The ZO configuration of a FedZO client (no preconditioner; its seeds are private)."""
    return ZOConfig(lr=cfg.lr, mu=cfg.mu, perturbations=cfg.perturbations, local_steps=cfg.local_steps,
                    difference=cfg.difference)


class FullModelSimulation(Runner):
    """Runner with the interface of :class:`~hiso.runners.simulate.Simulation`: ``run``, ``comm``, ``state_dict``."""

    def __init__(self, task: Task, cfg: RunConfig):
        if cfg.method.server_opt is None:  # (a full-model run steps the server optimiser its entry names)
            raise ValueError(f"{cfg.algorithm} is a scalar-only algorithm: use hiso.runners.simulate.Simulation")
        M = task.num_clients
        if not 1 <= cfg.sampled <= M:
            raise ValueError(f"sampled must be in [1, {M}], got {cfg.sampled}")
        self.task, self.cfg = task, cfg
        self.dtype = method_of(cfg).wire_dtype
        self.model = task.build_model()
        self.params = [p for _, p in trainable_params(self.model)]
        self.d = sum(p.numel() for p in self.params)
        self.opt = make_server_opt(cfg)
        self.opt_state = self.opt.init(self.params)
        self.weights = None
        if cfg.weighted:
            self.weights = np.asarray(task.client_sizes(), dtype=np.float64)
            if len(self.weights) != M or self.weights.min() <= 0:
                raise ValueError("weighted aggregation needs one positive client size per client")
        self._sampler = client_sampler(cfg.seed)  # same participants as HiSo for this seed
        self.comm = Comm.zeros(M)
        self.round = 0
        self.participants: tuple[int, ...] = ()  # the last round's clients
        self.cost = ClientCost()
        self.work = local_work(cfg.method.gradient == "first-order", cfg.local_steps, cfg.perturbations, cfg.difference)
        self.is_zo = cfg.method.gradient == "zo"
        shared = self.is_zo and self.dtype == "float32"
        self.worker = self.model if shared else task.build_model()
        self._worker_params = self.params if shared else [p for _, p in trainable_params(self.worker)]
        self._load_worker = not shared
        if self.is_zo:
            self._zo_state = ModelState(self.worker, fedzo_config(cfg))
            self._perturber = Perturber(self.worker, self._zo_state.params, cfg.perturb_mode,
                                        cfg.batch_memory_bytes)
        self.rounds = FullRounds(self, fold=True)  # strict, in sampled order: each update summed as it arrives
        self.transport = _InProcess(self)
        self.tally = CommTally(self.comm)

    @torch.no_grad()
    def _local(self, cid: int, rnd: int, received: torch.Tensor) -> tuple[list[torch.Tensor], float]:
        """Client ``cid``'s update from the model it received (decoded downlink)."""
        if self._load_worker:
            for p, v in zip(self._worker_params, unflatten(received, self._worker_params)):
                p.copy_(v)
        cfg = self.cfg
        if self.is_zo:
            delta, loss = zo_local(self._zo_state, self._perturber, self.task, cid, rnd, cfg.seed, cfg.batch_size)
        else:
            delta, loss = sgd_local(self.worker, self._worker_params, self.task, cid, rnd, cfg.lr,
                                    cfg.local_steps, cfg.batch_size)
        if not (math.isfinite(loss) and all(bool(torch.isfinite(t).all()) for t in delta)):
            raise FloatingPointError(f"client {cid} diverged in round {rnd} (non-finite update: lower lr)")
        return delta, loss

    def measure_client(self) -> None:
        """A client's resident bytes (its model) and the transient peak of one local update
        from the decoded global model (left as it was), the received d-vector included."""
        self.cost.measure(lambda: self._local(0, self.round, flatten(self.params)), model_bytes(self.worker),
                          self.params[0].device)

    def step(self) -> float:
        """One round (:func:`hiso.core.round.play_round`, strict: a client that fails fails the
        round); returns the participants' mean local training loss."""
        return play_round(self.rounds, self.transport, self.tally).record.loss

    def round_weights(self, clients) -> np.ndarray:
        """Aggregation weights of ``clients`` (those whose updates are averaged), summing to 1."""
        if self.weights is None:
            return np.full(len(clients), 1.0 / len(clients))
        w = self.weights[list(clients)]
        return w / w.sum()

    def apply_mean(self, agg: torch.Tensor) -> None:
        """The server's half of a round: its optimiser's step from the weighted mean update
        ``agg`` (flat, float32), applied to the global model; the round closes."""
        r = self.round
        step, self.opt_state = self.opt.update(self.opt_state, unflatten(agg, self.params))
        with torch.no_grad():
            # written only if every new value is finite: a diverged run keeps its last finite model
            for p, s in zip(self.params, step):
                if not bool(torch.isfinite(p + s.to(p.device, p.dtype)).all()):
                    raise FloatingPointError(f"the server step of round {r + 1} makes the model non-finite (lower lr or server_lr)")
            for p, s in zip(self.params, step):
                p.add_(s.to(p.device, p.dtype))
        self.round += 1

    def run(self, rounds: int) -> Iterator[dict]:
        """Yield one metrics row per round up to round ``rounds`` (plus row 0: the initial
        evaluation), continuing from the round it is at, as Simulation does."""
        return metric_rows(self.task, self.model, self.comm, self.step, rounds, self.cfg.eval_every,
                           start=start_round(self.round, rounds), cost=self.cost)

    def state_dict(self) -> dict:
        """The server's final model and round, as saved in ``model.pt``."""
        return {"round": self.round, "model": self.model.state_dict()}


# --------------------------------------------------------------------------------- the round


@dataclass(frozen=True)
class FullPlan:
    """A planned round: its clients (the shared sampling stream) and how often it was planned before."""

    round: int
    participants: tuple[int, ...]
    attempt: int


@dataclass(frozen=True)
class FullRecord:
    """A closed round: the clients whose updates count (in sampled order), their weighted mean
    update (flat, float32) and their mean local loss."""

    round: int
    participants: tuple[int, ...]
    mean: torch.Tensor
    loss: float


@dataclass(frozen=True)
class Summed:
    """An answer whose update is already in the round's sum (``FullRounds(fold=True)``)."""

    client: int
    round: int
    loss: float


class FullRounds:
    """The full-model server (a :class:`FullModelSimulation`: its model, sampler, weights and
    optimiser) as :func:`hiso.core.round.play_round` drives it (:class:`hiso.core.round.Rounds`).

    Each plan's downlink is encoded once (:meth:`encode`) and sent to every sampled client; an
    answer is decoded and checked (:meth:`read`: round, client, d, dtype, finiteness). A round
    closes with the weighted mean of the answered clients' updates, in sampled order
    (``round_weights`` over those who answered); with none, it is planned again (``replanned``),
    unless an answer was non-finite: then the run diverged (FloatingPointError). ``fold``: a
    strict round whose answers come in sampled order (in process): each update is added to the
    sum as it is decoded (one d-vector held, not one per client) and the first refused answer
    ends the round (the transport asks no one after it)."""

    def __init__(self, sim: FullModelSimulation, fold: bool = False):
        self.sim, self.fold = sim, fold
        self.replanned = 0
        self.errors: list[MessageError] = []  # the answers refused in the current plan
        self._attempt = 0
        self._plan: FullPlan | None = None
        self._down: Any = None

    def plan(self) -> FullPlan:
        sim = self.sim
        self._plan = FullPlan(sim.round, sample_clients(sim._sampler, sim.task.num_clients, sim.cfg.sampled),
                              self._attempt)
        self._down, self.errors = None, []
        if self.fold:
            self._sum, self._summed = torch.zeros(sim.d, dtype=torch.float32), []
            self._w = sim.round_weights(self._plan.participants)
        return self._plan

    def encode(self, plan: FullPlan) -> Any:
        """The plan's downlink: the global model, encoded in the wire dtype."""
        return encode_downlink(FullDownlink(plan.round, flatten(self.sim.params)), self.sim.dtype)

    def downlink(self, client: int) -> Any:
        if self._down is None:
            self._down = self.encode(self._plan)
        return self._down

    def read(self, client: int | None, reply: Any, plan: FullPlan) -> FullUplink:
        """The checked answer in ``reply``; MessageError if it cannot be used."""
        sim, r = self.sim, plan.round
        ans = decode_uplink(reply, expect_round=r, expect_d=sim.d, expect_dtype=sim.dtype)
        if client is not None and ans.client != client:
            raise MessageError(f"round {r}: answer from client {ans.client}, expected {client}")
        return ans

    def decode(self, client: int | None, reply: Any, plan: FullPlan) -> FullUplink | Summed:
        try:
            ans = self.read(client, reply, plan)
            if self.fold:
                k = len(self._summed)
                if k >= len(plan.participants) or ans.client != plan.participants[k]:
                    raise MessageError(f"round {plan.round}: answer from client {ans.client} out of the sampled order")
        except MessageError as e:
            self.errors.append(e)
            raise
        if not self.fold:
            return ans
        self._sum.add_(ans.delta, alpha=float(self._w[k]))
        self._summed.append(ans.client)
        return Summed(ans.client, ans.round, ans.loss)

    def close(self, answers: list, partial: bool) -> FullRecord | None:
        plan = self._plan
        first: dict[int, Any] = {}
        for a in answers:
            first.setdefault(a.client, a)
        answered = tuple(c for c in plan.participants if c in first)
        if not partial and answered != plan.participants:
            if self.errors:
                raise self.errors[0]
            raise MessageError(f"round {plan.round}: clients {[c for c in plan.participants if c not in first]} "
                               f"did not answer")
        if not answered:
            nonfinite = [str(e) for e in self.errors if "non-finite" in str(e)]
            if nonfinite:
                raise FloatingPointError(f"{nonfinite[0]} (diverged: lower lr)")
            self.replanned += 1
            self._attempt += 1
            return None
        if self.fold:
            mean = self._sum
        else:
            mean = torch.zeros(self.sim.d, dtype=torch.float32)
            for c, wi in zip(answered, self.sim.round_weights(answered)):
                mean.add_(first[c].delta, alpha=float(wi))
        return FullRecord(plan.round, answered, mean, float(np.mean([first[c].loss for c in answered])))

    def rejections(self) -> list[tuple[str, str]]:
        return []  # every refusal is the decoder's (counted by play_round)

    def commit(self, record: FullRecord) -> None:
        self.sim.apply_mean(record.mean)
        self.sim.participants = record.participants
        self._attempt = 0


class _InProcess(PlainTransport):
    """Each sampled client, in sampled order: decodes its downlink, trains (:meth:`FullModelSimulation._local`,
    timed into ``cost``) and encodes its update. Lazy: an answer is decoded (and summed) before
    the next client trains, and none is asked after a refused one (strict rounds)."""

    def __init__(self, sim: FullModelSimulation):
        self.sim = sim

    def exchange(self, plan, downlink, tally):
        sim, r, dt = self.sim, plan.round, self.sim.dtype
        for cid in plan.participants:
            if sim.rounds.errors:
                return
            down = downlink(cid)
            with Timer() as t:
                msg = decode_downlink(down, expect_round=r, expect_d=sim.d, expect_dtype=dt)
                delta, loss = sim._local(cid, r, msg.model)
                up = encode_uplink(FullUplink(cid, r, flatten(delta), loss), dt)
            sim.cost.add(sim.work, t.s)
            tally.up(cid, len(up))
            yield cid, up
