"""In-process FedKSeed (:mod:`hiso.methods.fedkseed`): the server's log, clients that catch up with
at most K regenerations, bytes counted from the encoded messages.

``fast`` mode: one shared replica (materialised once a round) answers for every client;
``faithful`` mode: every client that was ever sampled keeps its own replica, folds the records
its downlink bytes carry and materialises x_r itself (then it must equal the server's, bit for
bit: tests check it). Clients are sampled as for every other algorithm (same seed, same clients).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ..config import RunConfig
from ..core.config import ZOConfig
from ..core.estimator import local_update
from ..core.messages import Hello, encode_hello, encode_welcome, quantize, varint_size, welcome_for
from ..core.perturb import Perturber
from ..core.server import client_sampler, sample_clients
from ..methods.fedkseed import (PoolRecord, PoolReplica, decode_pool_downlink, decode_pool_uplink, draw_indices,
                                encode_pool_downlink, encode_pool_uplink, read_pool_log)
from ..tasks.base import Task
from .client_cost import ClientCost, Timer, model_bytes
from .common import Comm, metric_rows, start_round


def pool_config(cfg: RunConfig) -> ZOConfig:
    """The ZO step a FedKSeed client takes (one pool direction per step)."""
    return ZOConfig(lr=cfg.lr, mu=cfg.mu, perturbations=1, local_steps=cfg.local_steps, difference=cfg.difference,
                    directions=cfg.directions, scalar_dtype=cfg.scalar_dtype, lr_decay=cfg.lr_decay)


class FedKSeedSimulation:
    """Runner with :class:`~hiso.runners.simulate.Simulation`'s interface (``run``, ``comm``,
    ``state``, ``model``, ``state_dict``)."""

    def __init__(self, task: Task, cfg: RunConfig, on_record: Callable | None = None):
        self.task, self.cfg, self.on_record = task, cfg, on_record
        self.zo = pool_config(cfg)
        self.K, self.dtype, self.tau = cfg.seed_pool, cfg.scalar_dtype, cfg.local_steps
        self.replica = self._replica()
        self.state = self.replica.state
        self.perturber = Perturber(self.state.model, self.state.params, cfg.perturb_mode, cfg.batch_memory_bytes)
        self._sampler = client_sampler(cfg.seed)
        self.records: list[PoolRecord] = []
        self.synced = np.zeros(task.num_clients, dtype=np.int64)
        self.clients: dict[int, tuple[PoolReplica, Perturber]] = {}
        self.comm = Comm.zeros(task.num_clients)
        self.cost = ClientCost()
        welcome = encode_welcome(welcome_for(self.zo, cfg.seed, self.state.params))
        for c in range(task.num_clients):
            self.comm.join(c, encode_hello(Hello(c, 0)), welcome)

    def _replica(self) -> PoolReplica:
        return PoolReplica(self.task.build_model(), self.zo, self.K, self.cfg.seed, self.cfg.seed_sampling)

    @property
    def model(self):
        return self.state.model

    def _answer(self, cid: int, rep: PoolReplica, perturber: Perturber, count: bool = True) -> bytes:
        up, work = pool_answer(self.task, self.cfg, cid, rep, perturber)
        if count:
            self.cost.add(work, 0.0)  # its seconds are added by the caller, who times the whole answer
        return up

    def measure_client(self) -> None:
        """A client's resident bytes (its model and x_0's trainable tensors) and the transient
        peak of one answer, on the shared replica (left as it was)."""
        st = self.replica.state
        self.cost.measure(lambda: self._answer(0, self.replica, self.perturber, count=False),
                          model_bytes(st.model, self.replica.x0), st.params[0].device)

    def step(self) -> float:
        r = len(self.records)
        parts = sample_clients(self._sampler, self.task.num_clients, self.cfg.sampled)
        ups = []
        for cid in parts:
            down = encode_pool_downlink(r, self.records[self.synced[cid]:], self.dtype)
            self.comm.down[cid] += len(down)
            if self.cfg.mode == "faithful":
                if cid not in self.clients:
                    rep = self._replica()
                    self.clients[cid] = (rep, Perturber(rep.state.model, rep.state.params, self.cfg.perturb_mode,
                                                        self.cfg.batch_memory_bytes))
                rep, pert = self.clients[cid]
                with Timer() as t:
                    rnd, missed = decode_pool_downlink(down, self.tau, self.K, self.dtype)
                    rep.catch_up(missed[rep.round - (rnd - len(missed)):])
                    up = self._answer(cid, rep, pert)
            else:
                with Timer() as t:
                    up = self._answer(cid, self.replica, self.perturber)
            self.cost.seconds += t.s
            self.comm.up[cid] += len(up)
            ups.append(decode_pool_uplink(up, self.tau, self.K, self.dtype))
        return self.close_round(r, parts, ups)

    def close_round(self, r: int, parts, ups: list) -> float:
        """Round ``r``'s record from the decoded uplinks ``ups`` of ``parts`` (those who answered,
        in sampled order): logged, the server's replica moved on; returns their mean loss."""
        idx = np.stack([u[2] for u in ups])
        g = np.stack([u[3] for u in ups])
        rec = PoolRecord(r, tuple(parts), idx, quantize(g, self.dtype))
        self.records.append(rec)
        self.synced[list(parts)] = r  # a client that answered holds x_r (its local steps are not kept)
        self.replica.catch_up([rec])
        if self.on_record is not None:
            self.on_record(rec)
        return float(np.mean([u[4] for u in ups]))

    def run(self, rounds: int, start: int | None = None, wall: float = 0.0) -> Iterator[dict]:
        """As :meth:`hiso.runners.simulate.Simulation.run`: up to round ``rounds``, from where it is."""
        return metric_rows(self.task, self.model, self.comm, self.step, rounds, self.cfg.eval_every,
                           start=start_round(len(self.records), rounds, start), wall=wall, cost=self.cost)

    def resume(self, records: list[PoolRecord]) -> None:
        """Bring a new simulation to the end of an interrupted run's log as if it had run it: the
        clients sampled again (checked against the log), the bytes of every message counted
        again, the server's replica folded and materialised once; in faithful mode each client
        that took part is rebuilt at the round it last answered."""
        if self.records:
            raise RuntimeError("resume() needs a simulation that has not run yet")
        last = {}
        for rec in records:
            r = len(self.records)
            parts = sample_clients(self._sampler, self.task.num_clients, self.cfg.sampled)
            if rec.round != r or tuple(parts) != rec.participants:
                raise ValueError(f"history.bin's round {rec.round} was answered by {list(rec.participants)}, "
                                 f"but the run seed samples {list(parts)}: not this run's log")
            for j, cid in enumerate(parts):
                self.comm.down[cid] += len(encode_pool_downlink(r, self.records[self.synced[cid]:], self.dtype))
                self.comm.up[cid] += len(encode_pool_uplink(cid, r, rec.idx[j], rec.g[j], 0.0, self.dtype))
                last[cid] = r
            self.records.append(rec)
            self.synced[list(parts)] = r
        self.replica.catch_up(records)
        if self.cfg.mode == "faithful":
            for cid, r in last.items():
                rep = self._replica()
                rep.catch_up(records[:r])
                self.clients[cid] = (rep, Perturber(rep.state.model, rep.state.params, self.cfg.perturb_mode,
                                                    self.cfg.batch_memory_bytes))

    def state_dict(self) -> dict:
        return self.replica.state_dict()

    def sync_all(self) -> None:
        """Bring every faithful client to the server's round (tests)."""
        for rep, _ in self.clients.values():
            rep.catch_up(self.records[rep.round:])


def pool_answer(task: Task, cfg: RunConfig, cid: int, rep: PoolReplica, perturber: Perturber):
    """Client ``cid``'s encoded uplink for the round ``rep`` holds (its tau pool indices drawn
    from p, its ZO steps on its batches) and the :class:`~hiso.core.work.Work` it took; ``rep``
    is left as it was. The one computation behind the simulator and the Flower ClientApp."""
    r, tau = rep.round, cfg.local_steps
    idx = draw_indices(rep.p(), cfg.seed, r, cid, tau)
    batches = [task.batch(cid, r, k, cfg.batch_size) for k in range(tau)]
    res = local_update(rep.state, perturber, task.loss, batches, rep.seeds[idx].reshape(tau, 1))
    return encode_pool_uplink(cid, r, idx, res.scalars.reshape(-1), res.loss, cfg.scalar_dtype), res.work


def pool_resume_point(out, cfg: RunConfig, lines: list[str]) -> tuple[list[str], list[PoolRecord]]:
    """The rounds an interrupted FedKSeed run finished: its kept metrics ``lines`` (rows 0..) and
    log records, cut to the last round both hold."""
    if not lines:
        return [], []
    head, records = read_pool_log(f"{out}/history.bin")
    if (head["tau"], head["K"], head["seed"], head["scalar_dtype"]) != (cfg.local_steps, cfg.seed_pool, cfg.seed,
                                                                      cfg.scalar_dtype):
        raise ValueError(f"{out}/history.bin is not the log of the run config.json describes")
    R = min(len(lines) - 1, len(records))
    return lines[:R + 1], records[:R]


def rebuild_pool(run_dir, cfg: RunConfig, task: Task, round: int | None = None) -> PoolReplica:
    """x_0 of the run, then its logged rounds folded and materialised once (at most K draws)."""
    head, records = read_pool_log(f"{run_dir}/history.bin")
    if (head["tau"], head["K"], head["seed"], head["scalar_dtype"]) != (cfg.local_steps, cfg.seed_pool, cfg.seed,
                                                                      cfg.scalar_dtype):
        raise ValueError(f"{run_dir}/history.bin is not the log of the run config.json describes")
    if round is not None:
        if not 0 <= round <= len(records):
            raise ValueError(f"round {round} is not in {run_dir}: its log holds rounds 0..{len(records)}")
        records = records[:round]
    rep = PoolReplica(task.build_model(), pool_config(cfg), cfg.seed_pool, cfg.seed, cfg.seed_sampling)
    rep.catch_up(records)
    return rep


def pool_traffic(num_clients: int, sampled: int, tau: int, K: int, rounds: int, *, dtype: str = "float32",
                 seed: int = 0, sampling: str = "weighted", stats: dict | None = None) -> Comm:
    """Bytes per client of a FedKSeed schedule without a model, as :class:`FedKSeedSimulation`
    counts them: the joins, each answer's downlink (every record since the client's last round)
    and uplink, sized by the pool encoders (a record's bytes depend on who answered, not on
    its values). ``stats``, if given, receives the join bytes, the log's bytes, the server's
    seconds and the pool directions materialised by the clients' answers and by the server's
    rounds: with uniform sampling the distinct indices drawn so far (the run's own draws, so
    exact unless a seed's scalars sum to exactly 0); with weighted sampling the draws follow
    the scalars, so the bound min(K, pairs so far) (``exact`` False)."""
    import time
    t0 = time.perf_counter()
    comm = Comm.zeros(num_clients)
    zo = ZOConfig(lr=1.0, perturbations=1, local_steps=tau, scalar_dtype=dtype)
    welcome = encode_welcome(welcome_for(zo, seed, []))
    for c in range(num_clients):
        comm.join(c, encode_hello(Hello(c, 0)), welcome)
    joins = (int(comm.down.sum()), int(comm.up.sum()))
    rng, synced = client_sampler(seed), np.zeros(num_clients, dtype=np.int64)
    cum = [0]  # bytes of records 0 .. r-1 in a downlink
    empty = len(encode_pool_downlink(0, [], dtype))  # its round and count are one byte each
    zi, zg = np.zeros(tau, dtype=np.int64), np.zeros(tau, dtype=np.float32)
    exact = sampling == "uniform"
    uniform, seen = np.full(K, 1.0 / K), np.zeros(K, dtype=bool)
    clients_mat = server_mat = 0
    for r in range(rounds):
        parts = sample_clients(rng, num_clients, sampled)
        drawn = int(seen.sum()) if exact else min(K, r * sampled * tau)
        for c in parts:
            n = r - int(synced[c])
            comm.down[c] += empty - 2 + varint_size(r) + varint_size(n) + cum[r] - cum[synced[c]]
            comm.up[c] += len(encode_pool_uplink(c, r, zi, zg, 0.0, dtype))
            clients_mat += drawn  # materialised before it answers: x_r from x_0 and the nonzero C_j
            if exact:
                seen[draw_indices(uniform, seed, r, c, tau)] = True
        rec = PoolRecord(r, tuple(parts), np.zeros((sampled, tau)), np.zeros((sampled, tau)))
        cum.append(cum[-1] + len(encode_pool_downlink(0, [rec], dtype)) - empty)
        synced[list(parts)] = r
        server_mat += int(seen.sum()) if exact else min(K, (r + 1) * sampled * tau)
    if stats is not None:
        stats.update(join_down=joins[0], join_up=joins[1], log_bytes=cum[-1], materialised=clients_mat,
                     server_materialised=server_mat, exact=exact, server_s=time.perf_counter() - t0)
    return comm
