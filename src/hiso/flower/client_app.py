"""The ClientApp's side: a node's replica, its join (``query``) and its answer to a ``train``
message through the core's :class:`~hiso.core.client.Client` (scalar-only algorithms), or
FedKSeed's (:func:`pool_query_fields`, :func:`pool_train_fields`); the full-model baselines'
client is in :mod:`hiso.flower.fullmodel`.

A FedKSeed node keeps its pool state, which is small whatever the model (the round and the
pool's K coefficients, |g| sums and counts: ``fedkseed-<partition>.npz`` under the node's state
directory, keyed like the scalar replicas), and rebuilds x_r from x_0 with at most K
regenerations per answer. A downlink that starts after the node's round (state lost) is
answered ``behind=<round>`` and resent from there in the same round."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np

from ..config import RunConfig
from ..core.client import Client
from ..core.messages import (Hello, MessageError, Wire, check_welcome, decode_uplink, decode_welcome, encode_hello,
                             tensors_fingerprint)
from ..core.perturb import Perturber
from ..core.state import ModelState
from ..atomic import write_atomic
from ..methods.privacy import reports_loss
from ..runners.drivers import driver_of

from .records import REC, _cfg_json, _records, _state_dir, _task_for, log


def _process_start() -> float:
    """When this process started, on the perf_counter clock (Linux; else: module import)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.perf_counter() - (up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter()

_PROCESS_T0 = _process_start()

def _note_timing(path: Path, row: dict) -> None:
    """Where a ClientApp's time went, appended beside its replica (never sent on the wire)."""
    try:
        with open(path / "timings.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass

def open_replica(cfg: RunConfig, run_id, partition: int, state_dir: str, cfg_json: str | None = None):
    """The node's replica for this run; ``cfg_json`` is the configuration text as the server
    sent it (default: ``cfg``'s own JSON)."""
    from .replica import Replica, run_key
    task = _task_for(cfg.model_dump_json())
    state = ModelState(task.build_model(), cfg.zo(), run_seed=cfg.seed)
    rep = Replica.open(state_dir, run_key(cfg_json or cfg.model_dump_json(), run_id), partition, state)
    if rep.reset_reason:
        log.warning("partition %d: replica reset to x_0 (%s)", partition, rep.reset_reason)
    return task, rep

def query_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, cfg_json: str | None = None,
                 welcome: bytes | None = None) -> dict:
    """A node's answer to ``query`` (its join): its hello (partition and the round its replica
    holds), once it has checked the server's ``welcome`` against its own configuration and x_0
    (a mismatch raises :class:`~hiso.core.messages.JoinError`: the node refuses to mix). The
    welcome is kept beside the replica: it gives the run's seed to every later message.
    Full-model clients keep no replica: they answer their partition and round 0; FedKSeed's
    answer their partition and the round of their pool state (:func:`pool_query_fields`)."""
    if driver_of(cfg.method).pool_rounds:
        return pool_query_fields(cfg, run_id, pid, state_dir, cfg_json)
    if not driver_of(cfg.method).replica_catches_up:
        return {"partition": pid, "round": 0}
    task, rep = open_replica(cfg, run_id, pid, state_dir, cfg_json)
    held = rep.state.round
    try:
        if welcome is not None:
            accept_welcome(cfg, task, rep, welcome, pid)
    finally:
        rep.close()
    return {"partition": pid, "round": held, "hello": encode_hello(Hello(pid, held))}

def accept_welcome(cfg: RunConfig, task, rep, welcome: bytes, pid: int) -> bytes:
    """Check the server's welcome against this node's configuration and x_0 (JoinError on a
    mismatch), keep it beside the replica, and return the node's hello."""
    x0 = ModelState(task.build_model(), cfg.zo())
    check_welcome(decode_welcome(welcome), cfg.zo(), tensors_fingerprint(x0.params))
    # as durable as the replica beside it (fsynced under HISO_REPLICA_SYNC=1 only): two fsyncs
    # were 40 % of a join, and a join is a message of every first-sampled node at 10,000 nodes
    write_atomic(rep.path / "welcome.bin", bytes(welcome), sync=os.environ.get("HISO_REPLICA_SYNC") == "1")
    return encode_hello(Hello(pid, rep.state.round))

def _wire(cfg: RunConfig, rep) -> Wire:
    """The run's wire: from the welcome the node accepted (else its own configuration's)."""
    path = rep.path / "welcome.bin"
    seed = decode_welcome(path.read_bytes()).seed if path.exists() else cfg.seed
    return Wire.of(cfg.zo(), seed)

def attacked(cfg: RunConfig, num_clients: int, pid: int, up: bytes, wire: Wire) -> bytes:
    """What node ``pid`` sends: its honest uplink, or, if it is one of the run's Byzantine
    clients (``--byzantine K``: the K clients the simulator draws from the run seed), the same
    uplink with its scalars replaced by its attack's lie (:class:`hiso.runners.faults.Attackers`),
    as the simulator's attackers send. The lie is of the scalars as the wire carries them (the
    simulator's, for the float32 wire). Fixed attackers with the scale, sign-flip or nan attack
    only: the per-round draw and the random attack are keyed by the simulator's plan count."""
    if not cfg.byzantine:
        return up
    from ..core.messages import Uplink, encode_uplink
    from ..runners.faults import Attackers
    att = Attackers(num_clients, cfg.byzantine, cfg.attack, cfg.attack_scale, seed=cfg.seed)
    if pid not in att.attack:
        return up
    if cfg.byzantine_per_round or att.attack[pid] == "random":
        raise ValueError("Flower nodes attack as fixed Byzantine clients with scale, sign-flip or nan")
    u = decode_uplink(up, wire)
    return encode_uplink(Uplink(u.client, u.round, att.lie(pid, u.scalars, 0), u.loss, u.attempt), wire, check=False)

def answer_open(cfg: RunConfig, task, rep, pid: int, down: bytes) -> bytes | None:
    """The open replica's answer to a downlink: the uplink (the node's attack applied, if it
    has one), or None when the history starts after the round it holds (nothing changed).
    The ClientApp (:func:`train_fields`) and the node's worker (:mod:`hiso.flower.worker`) share it."""
    client = Client(pid, rep.state, task.loss, lambda r, k: task.batch(pid, r, k, cfg.batch_size), cfg.perturb_mode,
                    report_loss=reports_loss(cfg.zo().dp),  # under DP no loss leaves the node
                    wire=_wire(cfg, rep), batch_memory=cfg.batch_memory_bytes)
    rep.begin()
    try:
        up = client.handle(down)
    except MessageError as e:
        rep.commit()  # nothing changed: a refused downlink is checked before any update
        if "history starts at" in str(e):
            return None
        raise
    rep.commit()
    return attacked(cfg, task.num_clients, pid, up, client.wire)


def train_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, down: bytes, cfg_json: str | None = None) -> dict:
    """A node's answer to ``train``: ``up`` (the encoded uplink) or ``behind`` (its round)."""
    if driver_of(cfg.method).pool_rounds:
        return pool_train_fields(cfg, run_id, pid, state_dir, down, cfg_json)
    t0, c0 = time.perf_counter(), time.process_time()
    task, rep = open_replica(cfg, run_id, pid, state_dir, cfg_json)
    t1 = time.perf_counter()
    try:
        up = answer_open(cfg, task, rep, pid, down)
    except MessageError:
        rep.close()
        raise
    if up is None:
        rep.close()
        return {"behind": rep.state.round}
    t2 = time.perf_counter()
    _note_timing(rep.path, {"round": rep.state.round, "since_process_start_s": t0 - _PROCESS_T0,
                            "open_s": t1 - t0, "handle_s": t2 - t1, "up_bytes": len(up), "down_bytes": len(down),
                            # CPU seconds (independent of how busy the machine is): before our code ran
                            # (interpreter, flwr, torch, hiso imports, Flower's setup) and in it
                            "cpu_before_handler_s": c0, "cpu_handler_s": time.process_time() - c0})
    rep.close()
    return {"up": up}

def _trajectory(msg, context):
    """What keys this node's replica: the run directory's lineage the server sent, else the
    Flower run id."""
    rec = msg.content[REC] if REC in msg.content else {}
    return str(rec["lineage"]) if "lineage" in rec else context.run_id

def handle_query(msg, context, cfg: RunConfig):
    """The node's join: one answer per partition it serves (:mod:`hiso.flower.parts`)."""
    from flwr.app import Message
    from .parts import joint_answer, node_partitions
    rec = msg.content[REC]
    fields = joint_answer([query_fields(cfg, _trajectory(msg, context), pid, _state_dir(context), _cfg_json(context),
                                        rec["welcome"] if "welcome" in rec else None)
                           for pid in node_partitions(context.node_config)])
    return Message(_records(fields), reply_to=msg)

def handle_train(msg, context, cfg: RunConfig):
    from flwr.app import Message
    from .parts import message_partition
    rec = msg.content[REC]
    fields = train_fields(cfg, _trajectory(msg, context), message_partition(context.node_config, rec),
                          _state_dir(context), rec["down"], _cfg_json(context))
    return Message(_records(fields), reply_to=msg)


# --------------------------------------------------------------------------------- FedKSeed's node


def _pool_path(cfg_json: str, run_id, pid: int, state_dir: str) -> Path:
    from .replica import run_key
    return Path(state_dir) / run_key(cfg_json, run_id) / f"fedkseed-{pid}.npz"


def _pool_saved(path: Path, K: int) -> dict | None:
    """The node's saved pool state (None if there is none, or it is not of a pool of K)."""
    try:
        with np.load(path) as z:
            out = {k: z[k] for k in ("coef", "amp", "count", "round")}
    except (OSError, KeyError, ValueError):
        return None
    return out if out["coef"].shape == out["amp"].shape == out["count"].shape == (K,) else None


def _pool_load(path: Path, rep) -> None:
    """The node's saved pool state into ``rep`` (left at x_0, round 0, if there is none)."""
    z = _pool_saved(path, rep.K)
    if z is not None:
        rep.coef, rep.amp = z["coef"].astype(np.float64), z["amp"].astype(np.float64)
        rep.count, rep.round = z["count"].astype(np.int64), int(z["round"])


def _pool_save(path: Path, rep) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, coef=rep.coef, amp=rep.amp, count=rep.count, round=np.int64(rep.round))
    write_atomic(path, buf.getvalue(), sync=False)  # (renamed whole, as before; a lost state is replayed)


def pool_query_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, cfg_json: str | None = None) -> dict:
    """A node's answer to ``query``: its partition and the round its pool state holds."""
    from ..methods.fedkseed_method import FedKSeed
    z = _pool_saved(_pool_path(cfg_json or cfg.model_dump_json(), run_id, pid, state_dir), FedKSeed.of(cfg).seed_pool)
    return {"partition": pid, "round": 0 if z is None else int(z["round"])}


def pool_train_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, down: bytes,
                      cfg_json: str | None = None) -> dict:
    """A node's answer to ``train``: ``up`` (its encoded pool uplink) or ``behind`` (its round)."""
    from ..methods.fedkseed import decode_pool_downlink
    from ..methods.fedkseed_method import FedKSeed
    from ..methods.fedkseed_rounds import pool_answer, pool_replica
    task = _task_for(cfg_json or cfg.model_dump_json())
    path = _pool_path(cfg_json or cfg.model_dump_json(), run_id, pid, state_dir)
    rep = pool_replica(cfg, task.build_model)
    _pool_load(path, rep)
    rnd, missed = decode_pool_downlink(down, cfg.local_steps, FedKSeed.of(cfg).seed_pool, cfg.scalar_dtype)
    start = rnd - len(missed)
    if rep.round > rnd:  # ahead of the server: not this trajectory's state; start again from x_0
        rep = pool_replica(cfg, task.build_model)
    if start > rep.round:
        return {"behind": rep.round}
    rep.catch_up(missed[rep.round - start:])  # fold what it missed, materialise x_rnd (at most K draws)
    up, _ = pool_answer(pid, rep, Perturber(rep.state.model, rep.state.params, cfg.perturb_mode, cfg.batch_memory_bytes),
                        task.loss, lambda r, k: task.batch(pid, r, k, cfg.batch_size), cfg.seed, cfg.scalar_dtype)
    _pool_save(path, rep)
    return {"up": up}
