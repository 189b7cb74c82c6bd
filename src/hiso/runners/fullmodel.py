"""In-process federation for the full-model baselines: FedZO, FedAvg, FedAdam, FedYogi, FedAdagrad.

Each round: the same clients as HiSo would get for this seed (the shared sampling stream of
:func:`hiso.core.server.client_sampler`) receive the global model as an encoded d-vector,
train locally from the decoded vector, and send back their encoded update; the server
decodes, averages (weighted by data size if ``weighted``) and applies its optimiser
(:mod:`hiso.baselines.server_opt`). Bytes are counted per client from the encoded messages,
exactly as :class:`~hiso.runners.simulate.Simulation` counts HiSo's, so ``bytes_up`` and
``bytes_down`` compare like with like.

Memory: one global model, plus one client copy for the first-order algorithms (reloaded for
each client) or for FedZO with a lossy wire dtype. FedZO over float32 reads the global
model directly: the decoded downlink is bit-identical to it and the ZO steps never write it.

Only trainable parameters travel; buffers stay as :meth:`Task.build_model` made them.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from ..baselines.local import local_work, sgd_local, zo_local
from ..baselines.messages import (FullDownlink, FullUplink, decode_downlink, decode_uplink,
                                  encode_downlink, encode_uplink, flatten, unflatten)
from ..baselines.server_opt import make_server_opt
from ..config import RunConfig
from ..core.config import ZOConfig
from ..core.messages import MessageError
from ..core.perturb import Perturber
from ..core.server import client_sampler, sample_clients
from ..core.state import ModelState, trainable_params
from ..tasks.base import Task
from .client_cost import ClientCost, Timer, model_bytes
from .common import Comm, metric_rows, start_round


def fedzo_config(cfg: RunConfig) -> ZOConfig:
    """The ZO configuration of a FedZO client (no preconditioner; its seeds are private)."""
    return ZOConfig(lr=cfg.lr, mu=cfg.mu, perturbations=cfg.perturbations, local_steps=cfg.local_steps,
                    difference=cfg.difference, precond=None)


class FullModelSimulation:
    """Runner with the interface of :class:`~hiso.runners.simulate.Simulation`: ``run``, ``comm``, ``state_dict``."""

    def __init__(self, task: Task, cfg: RunConfig):
        if cfg.scalar_only:
            raise ValueError(f"{cfg.algorithm} is a scalar-only algorithm: use hiso.runners.simulate.Simulation")
        M = task.num_clients
        if not 1 <= cfg.sampled <= M:
            raise ValueError(f"sampled must be in [1, {M}], got {cfg.sampled}")
        self.task, self.cfg = task, cfg
        self.dtype = cfg.wire_dtype
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
        """One round; returns the participants' mean local training loss."""
        r, dt = self.round, self.dtype
        participants = sample_clients(self._sampler, self.task.num_clients, self.cfg.sampled)
        self.participants = participants
        w = self.round_weights(participants)
        down = encode_downlink(FullDownlink(r, flatten(self.params)), dt)
        agg = torch.zeros(self.d, dtype=torch.float32)
        losses = []
        for cid, wi in zip(participants, w):
            self.comm.down[cid] += len(down)
            with Timer() as t:
                msg = decode_downlink(down, expect_round=r, expect_d=self.d, expect_dtype=dt)
                delta, loss = self._local(cid, r, msg.model)
                up = encode_uplink(FullUplink(cid, r, flatten(delta), loss), dt)
            self.cost.add(self.work, t.s)
            self.comm.up[cid] += len(up)
            ans = decode_uplink(up, expect_round=r, expect_d=self.d, expect_dtype=dt)
            if ans.client != cid:
                raise MessageError(f"round {r}: answer from client {ans.client}, expected {cid}")
            agg.add_(ans.delta, alpha=float(wi))
            losses.append(ans.loss)
        self.apply_mean(agg)
        return float(np.mean(losses))

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
                if not bool(torch.isfinite(p + s.to(p.dtype)).all()):
                    raise FloatingPointError(f"the server step of round {r + 1} makes the model non-finite (lower lr or server_lr)")
            for p, s in zip(self.params, step):
                p.add_(s.to(p.dtype))
        self.round += 1

    def run(self, rounds: int) -> Iterator[dict]:
        """Yield one metrics row per round up to round ``rounds`` (plus row 0: the initial
        evaluation), continuing from the round it is at, as Simulation does."""
        return metric_rows(self.task, self.model, self.comm, self.step, rounds, self.cfg.eval_every,
                           start=start_round(self.round, rounds), cost=self.cost)

    def state_dict(self) -> dict:
        """The server's final model and round, as saved in ``model.pt``."""
        return {"round": self.round, "model": self.model.state_dict()}
