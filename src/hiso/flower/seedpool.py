"""FedKSeed (:mod:`hiso.methods.fedkseed`) over Flower: the seed-pool messages in the ``hiso``
ConfigRecord, as the scalar protocol's are.

Server: :class:`~hiso.runners.fedkseed.FedKSeedSimulation`'s state (its client sample for the
seed, its log, the rounds each partition holds) driven over the grid; a round closes with the
partitions that answered in time with a valid uplink (:meth:`FedKSeedSimulation.close_round`),
so a federation where every sampled node answers writes the in-process run directory, model and
bytes, bit for bit. A round nobody answered is sampled again. Joins are counted as the simulator
counts them (every client once, before round 1); there is no welcome: a node names its
partition and the round its replica holds.

Client: the node keeps FedKSeed's replica state, which is small whatever the model (the round
and the pool's K coefficients, |g| sums and counts: ``fedkseed-<partition>.npz`` under the
node's state directory, keyed like the scalar replicas), and rebuilds x_r from x_0 with at most
K regenerations per answer. A downlink that starts after the node's round (state lost) is
answered ``behind=<round>`` and resent from there in the same round.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import RunConfig
from ..methods.fedkseed import PoolReplica, decode_pool_downlink, decode_pool_uplink, encode_pool_downlink
from ..core.messages import MessageError
from ..core.perturb import Perturber
from ..core.server import sample_clients
from ..atomic import write_atomic
from ..runners.fedkseed import FedKSeedSimulation, pool_answer, pool_config
from .records import Settings, _task_for
from .server_app import FlowerFederation

log = logging.getLogger("hiso.flower")


# --------------------------------------------------------------------------------- server


class _PoolServer:
    """What :meth:`FlowerFederation.refresh_nodes` asks of a server, over the simulator's state."""

    def __init__(self, sim: FedKSeedSimulation):
        self.sim, self.replanned = sim, 0

    @property
    def round(self) -> int:
        return len(self.sim.records)

    def client_holds(self, client: int, round: int) -> None:
        self.sim.synced[client] = min(int(round), self.round)


@dataclass
class PoolFederation(FlowerFederation):
    """FedKSeed's runner (``run``, ``comm``, ``state_dict``, ``model``) over a Flower Grid."""

    def __post_init__(self) -> None:
        self.sim = FedKSeedSimulation(self.task, self.cfg, self.on_record)
        self.server = _PoolServer(self.sim)
        self.welcome = None  # no join handshake: the node names its partition and round
        self.comm = self.sim.comm
        self._init_nodes()

    def _downlink(self, pid: int, rnd: int) -> bytes:
        """The pool records partition ``pid`` has not folded yet (FlowerFederation._send sends it)."""
        sim = self.sim
        return encode_pool_downlink(rnd, sim.records[sim.synced[pid]:], sim.dtype)

    def step(self) -> float:
        sim = self.sim
        for _ in range(self.settings.max_replans + 1):
            t0 = time.perf_counter()
            self.refresh_nodes()
            t1 = time.perf_counter()
            r = len(sim.records)
            parts = sample_clients(sim._sampler, self.task.num_clients, self.cfg.sampled)
            self.join_sampled(parts)
            replies = self._send(r, parts)
            behind = [pid for pid, f in replies.items() if "behind" in f]
            for pid in behind:  # its state is older than we thought: resend from its round
                self.server.client_holds(pid, int(replies[pid]["behind"]))
            if behind:
                replies.update(self._send(r, behind))
            t2 = time.perf_counter()
            ups = {}
            for pid, f in replies.items():
                if "up" not in f:
                    continue
                self.comm.up[pid] += len(f["up"])
                try:
                    u = decode_pool_uplink(f["up"], sim.tau, sim.K, sim.dtype)
                except MessageError as e:
                    log.warning("round %d: dropped the answer of partition %d: %s", r, pid, e)
                    continue
                if u[0] != pid or u[1] != r:
                    log.warning("round %d: partition %d answered for client %d, round %d: dropped", r, pid, u[0], u[1])
                    continue
                ups[pid] = u
            if not ups:
                self.server.replanned += 1
                log.warning("round %d: no valid answer from %s; sampling it again", r, list(parts))
                continue
            answered = tuple(c for c in parts if c in ups)
            loss = sim.close_round(r, answered, [ups[c] for c in answered])
            self.timings.append({"round": r + 1, "nodes_s": t1 - t0, "send_and_receive_s": t2 - t1,
                                 "aggregate_apply_s": time.perf_counter() - t2, "participants": list(answered),
                                 "sampled": list(parts)})
            return loss
        raise RuntimeError(f"round {len(sim.records)}: no client answered in {self.settings.max_replans + 1} attempts")

    def run(self, rounds: int, start: int = 0, wall: float = 0.0):
        from ..runners.common import metric_rows
        self.wait_for_nodes()
        return metric_rows(self.task, self.sim.model, self.comm, self.step, rounds, self.cfg.eval_every,
                           start=start, wall=wall)

    def resume(self, records) -> None:
        """Continue an interrupted run's log (bytes counted as if every sampled partition had a
        node; a log whose rounds were sampled again after a round nobody answered is refused)."""
        self.sim.resume(records)

    @property
    def state(self):
        return self.sim.state

    @property
    def model(self):
        return self.sim.model

    def state_dict(self) -> dict:
        return self.sim.state_dict()


def serve_pool(grid, cfg: RunConfig, settings: Settings) -> dict:
    """The ServerApp's body for FedKSeed: run ``cfg`` over the grid into ``settings.out_dir``
    (the in-process runner's run directory, ``history.bin`` included)."""
    import json

    from ..runners.rundir import run_to_dir
    from .server_app import _lineage
    task = _task_for(cfg.model_dump_json())
    lineage = _lineage(settings)
    holder = {}

    def factory(cfg_, task_, on_record=None):
        holder["fed"] = PoolFederation(grid, task_, cfg_, settings, on_record, lineage=lineage)
        return holder["fed"]

    summary = run_to_dir(cfg, settings.out_dir, task=task, runner=factory, resume=settings.resume)  # (refused)
    fed = holder["fed"]
    write_atomic(Path(settings.out_dir, "flower.json"), json.dumps(
        {"flower": {"rounds_replanned": fed.server.replanned, "timings": fed.timings,
                    "partitions_seen": sorted(fed.node_of)}}, indent=1))
    if summary.get("diverged"):
        raise RuntimeError(f"run diverged: {summary['diverged']}")
    return summary


# --------------------------------------------------------------------------------- client


def _state_path(cfg_json: str, run_id, pid: int, state_dir: str) -> Path:
    from .replica import run_key
    return Path(state_dir) / run_key(cfg_json, run_id) / f"fedkseed-{pid}.npz"


def _saved(path: Path, K: int) -> dict | None:
    """The node's saved pool state (None if there is none, or it is not of a pool of K)."""
    try:
        with np.load(path) as z:
            out = {k: z[k] for k in ("coef", "amp", "count", "round")}
    except (OSError, KeyError, ValueError):
        return None
    return out if out["coef"].shape == out["amp"].shape == out["count"].shape == (K,) else None


def _load(path: Path, rep: PoolReplica) -> None:
    """The node's saved pool state into ``rep`` (left at x_0, round 0, if there is none)."""
    z = _saved(path, rep.K)
    if z is not None:
        rep.coef, rep.amp = z["coef"].astype(np.float64), z["amp"].astype(np.float64)
        rep.count, rep.round = z["count"].astype(np.int64), int(z["round"])


def _save(path: Path, rep: PoolReplica) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, coef=rep.coef, amp=rep.amp, count=rep.count, round=np.int64(rep.round))
    write_atomic(path, buf.getvalue(), sync=False)  # (renamed whole, as before; a lost state is replayed)


def pool_query_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, cfg_json: str | None = None) -> dict:
    """A node's answer to ``query``: its partition and the round its pool state holds."""
    z = _saved(_state_path(cfg_json or cfg.model_dump_json(), run_id, pid, state_dir), cfg.seed_pool)
    return {"partition": pid, "round": 0 if z is None else int(z["round"])}


def pool_train_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, down: bytes,
                      cfg_json: str | None = None) -> dict:
    """A node's answer to ``train``: ``up`` (its encoded pool uplink) or ``behind`` (its round)."""
    task = _task_for(cfg_json or cfg.model_dump_json())
    path = _state_path(cfg_json or cfg.model_dump_json(), run_id, pid, state_dir)
    rep = PoolReplica(task.build_model(), pool_config(cfg), cfg.seed_pool, cfg.seed, cfg.seed_sampling)
    _load(path, rep)
    rnd, missed = decode_pool_downlink(down, cfg.local_steps, cfg.seed_pool, cfg.scalar_dtype)
    start = rnd - len(missed)
    if rep.round > rnd:  # ahead of the server: not this trajectory's state; start again from x_0
        rep = PoolReplica(task.build_model(), pool_config(cfg), cfg.seed_pool, cfg.seed, cfg.seed_sampling)
    if start > rep.round:
        return {"behind": rep.round}
    rep.catch_up(missed[rep.round - start:])  # fold what it missed, materialise x_rnd (at most K draws)
    up, _ = pool_answer(task, cfg, pid, rep, Perturber(rep.state.model, rep.state.params, cfg.perturb_mode,
                                                        cfg.batch_memory_bytes))
    _save(path, rep)
    return {"up": up}
