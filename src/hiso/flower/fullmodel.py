"""The full-model baselines (FedAvg, FedAdam, FedYogi, FedAdagrad, FedZO) over Flower's ArrayRecords.

The server's half is :class:`~hiso.runners.fullmodel.FullModelSimulation`'s (same client
sample for the seed, same weights, same server optimiser, same bytes counted), so a
federation where every sampled node answers ends with the in-process runner's model bit for
bit. What travels is Flower's own format: a ``train`` message carries the global model's
trainable tensors as an ``ArrayRecord`` (``arrays``, one array per parameter, by name) and the
round in the ``ConfigRecord`` ``hiso``; the reply carries the client's update
(x_local - x_received) the same way, with ``round``, ``client`` and ``loss``.

Values travel in the run's ``wire_dtype`` (float32 exactly; float16 as float16 arrays;
bfloat16 as its int16 bit pattern, numpy having no bfloat16) and are widened to float32 as
:mod:`hiso.baselines.messages` does, so the arithmetic is the in-process runner's whatever the
dtype. ``bytes_up``/``bytes_down`` count the protocol's payload (:func:`downlink_size`,
:func:`uplink_size`, as in process); ``flower.json`` adds the ArrayRecord's own size per message.

A round closes with whoever answered in time with a valid update (names, shapes, dtype,
round, client and finiteness checked): their mean, reweighted over those who answered, takes
the server step. A round nobody answered is sampled again; a round whose only answers were
non-finite stops the run as diverged, as in process. Full-model clients keep no state between
rounds (they receive the whole model), so a node needs no replica and a restarted node is
simply sampled again.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..baselines.local import sgd_local, zo_local
from ..baselines.messages import downlink_size, flatten, uplink_size
from ..config import RunConfig
from ..core.perturb import Perturber
from ..core.server import sample_clients
from ..core.state import ModelState, trainable_params
from ..atomic import write_atomic
from ..runners.fullmodel import FullModelSimulation, fedzo_config
from .records import REC, Settings, _task_for
from .server_app import FlowerFederation

log = logging.getLogger("hiso.flower")

ARRAYS = "arrays"  # name of the ArrayRecord that carries a model or an update
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


class UpdateError(ValueError):
    """An ArrayRecord that is not the update (or model) expected: dropped, never applied."""


def to_arrays(named: list[tuple[str, torch.Tensor]], dtype: str):
    """An ArrayRecord of ``named`` tensors in the wire dtype (float32 values are exact)."""
    from flwr.app import Array, ArrayRecord
    out = OrderedDict()
    for name, t in named:
        v = t.detach().to("cpu")
        if dtype == "float32":
            a = v.to(torch.float32).numpy()
        elif dtype == "float16":
            a = v.to(torch.float16).numpy()
        elif dtype == "bfloat16":
            a = v.to(torch.bfloat16).view(torch.int16).numpy()
        else:
            raise ValueError(f"unknown wire dtype {dtype!r}")
        out[name] = Array(np.ascontiguousarray(a))
    return ArrayRecord(out)


def from_arrays(rec, like: list[tuple[str, torch.Tensor]], dtype: str, what: str) -> list[torch.Tensor]:
    """The float32 tensors of an ArrayRecord, checked against ``like`` (names, order, shapes,
    dtype) and for finiteness; raises :class:`UpdateError` before anything is used."""
    names = [n for n, _ in like]
    if list(rec.keys()) != names:
        raise UpdateError(f"{what}: arrays {list(rec.keys())[:4]}... are not the model's {names[:4]}...")
    out = []
    for name, t in like:
        try:
            a = rec[name].numpy()
        except Exception as e:  # noqa: BLE001 - whatever a damaged array raises, it is dropped
            raise UpdateError(f"{what}: array {name!r} does not decode ({type(e).__name__}: {e})") from None
        if a.dtype != _NP[dtype]:
            raise UpdateError(f"{what}: array {name!r} is {a.dtype}, the run's wire dtype is {dtype}")
        if tuple(a.shape) != tuple(t.shape):
            raise UpdateError(f"{what}: array {name!r} has shape {tuple(a.shape)}, expected {tuple(t.shape)}")
        if dtype == "bfloat16":
            x = torch.from_numpy(a.copy()).view(torch.bfloat16).to(torch.float32)
        else:
            x = torch.from_numpy(a.astype(np.float32))
        if not bool(torch.isfinite(x).all()):
            raise UpdateError(f"{what}: non-finite value in {name!r}")
        out.append(x)
    return out


# --------------------------------------------------------------------------------- server


@dataclass
class _NoHistory:
    """What :meth:`FlowerFederation.refresh_nodes` asks of a server: full-model clients hold
    no replica, so the round a node reports is ignored."""

    round: int = 0
    replanned: int = 0

    def client_holds(self, client: int, round: int) -> None:
        pass


@dataclass
class FullModelFederation(FlowerFederation):
    """The full-model runner (``run``, ``comm``, ``state_dict``, ``model``) over a Flower Grid;
    node discovery, timeouts and suspects are :class:`FlowerFederation`'s."""

    def __post_init__(self) -> None:
        self.sim = FullModelSimulation(self.task, self.cfg)
        self.server = _NoHistory()
        self.comm = self.sim.comm
        self.named = trainable_params(self.sim.model)
        self._init_nodes()

    def _train_message(self, arrays, fields: dict, node_id: int, group: str):
        from flwr.app import ConfigRecord, Message, RecordDict
        return Message(RecordDict({ARRAYS: arrays, REC: ConfigRecord(fields)}), dst_node_id=node_id,
                       message_type="train", group_id=group, ttl=self.settings.round_timeout)  # as FlowerFederation's

    def _answer(self, rep, pid: int, rnd: int) -> tuple[torch.Tensor, float]:
        """A reply's flat update and (float32-rounded) loss, or UpdateError."""
        what = f"round {rnd}: the update of partition {pid}"
        if rep.has_error():
            raise UpdateError(f"{what} failed: {rep.error.reason}")
        try:
            fields, arrays = rep.content[REC], rep.content[ARRAYS]
            rnd_, cid, loss = int(fields["round"]), int(fields["client"]), float(fields["loss"])
        except (KeyError, TypeError, ValueError) as e:
            raise UpdateError(f"{what} lacks a field ({e})") from None
        if rnd_ != rnd or cid != pid:
            raise UpdateError(f"{what} is for round {rnd_}, client {cid}")
        loss = float(np.float32(loss))  # the in-process uplink carries the loss as float32
        if not math.isfinite(loss):
            raise UpdateError(f"{what}: non-finite loss")
        return flatten(from_arrays(arrays, self.named, self.sim.dtype, what)), loss

    def step(self) -> float:
        sim, dt = self.sim, self.sim.dtype
        d = sim.d
        for _ in range(self.settings.max_replans + 1):
            t0 = time.perf_counter()
            self.refresh_nodes()
            t1 = time.perf_counter()
            r = sim.round
            participants = sample_clients(sim._sampler, self.task.num_clients, self.cfg.sampled)
            self.join_sampled(participants)
            arrays = to_arrays(self.named, dt)
            msgs, pids = [], {}
            for pid in participants:
                nid = self.node_of.get(pid)
                if nid is None:
                    continue
                self.comm.down[pid] += downlink_size(d, dt)
                msgs.append(self._train_message(arrays, {"round": r}, nid, str(r)))
                pids[nid] = pid
            answers, nonfinite = {}, []
            for rep in self._exchange(msgs):
                pid = pids.get(rep.metadata.src_node_id)
                if pid is None or pid in answers:
                    continue
                self.comm.up[pid] += uplink_size(d, dt)
                try:
                    answers[pid] = self._answer(rep, pid, r)
                except UpdateError as e:
                    log.warning("%s: dropped", e)
                    if "non-finite" in str(e):
                        nonfinite.append(str(e))
            t2 = time.perf_counter()
            if not answers:
                if nonfinite:
                    raise FloatingPointError(f"{nonfinite[0]} (diverged: lower lr)")
                self.server.replanned += 1
                log.warning("round %d: no valid answer from %s; sampling it again", r, list(participants))
                continue
            answered = tuple(c for c in participants if c in answers)
            agg = torch.zeros(d, dtype=torch.float32)
            for c, wi in zip(answered, sim.round_weights(answered)):
                agg.add_(answers[c][0], alpha=float(wi))
            sim.apply_mean(agg)
            sim.participants = answered
            self.server.round = sim.round
            t3 = time.perf_counter()
            self.timings.append({"round": sim.round, "nodes_s": t1 - t0, "send_and_receive_s": t2 - t1,
                                 "aggregate_apply_s": t3 - t2, "participants": list(answered),
                                 "sampled": list(participants), "arrayrecord_bytes": arrays.count_bytes()})
            return float(np.mean([answers[c][1] for c in answered]))
        raise RuntimeError(f"round {sim.round}: no client answered in {self.settings.max_replans + 1} attempts")

    def run(self, rounds: int):
        from ..runners.common import metric_rows
        self.wait_for_nodes()
        return metric_rows(self.task, self.sim.model, self.comm, self.step, rounds, self.cfg.eval_every)

    @property
    def model(self):
        return self.sim.model

    def state_dict(self) -> dict:
        return self.sim.state_dict()


def serve_full(grid, cfg: RunConfig, settings: Settings) -> dict:
    """The ServerApp's body for a full-model algorithm: run ``cfg`` over the grid into
    ``settings.out_dir`` (the in-process runner's run directory: no ``history.bin``)."""
    from ..runners.rundir import run_to_dir
    if cfg.scalar_only:
        raise ValueError(f"{cfg.algorithm} is scalar-only: use hiso.flower.app.serve")
    task = _task_for(cfg.model_dump_json())
    holder = {}

    def factory(cfg_, task_, on_record=None):
        holder["fed"] = FullModelFederation(grid, task_, cfg_, settings)
        return holder["fed"]

    summary = run_to_dir(cfg, settings.out_dir, task=task, runner=factory, resume=settings.resume)  # (refused)
    fed = holder["fed"]
    extra = {"flower": {"rounds_replanned": fed.server.replanned, "timings": fed.timings,
                        "partitions_seen": sorted(fed.node_of)}}
    write_atomic(Path(settings.out_dir, "flower.json"), json.dumps(extra, indent=1))
    if summary.get("diverged"):
        raise RuntimeError(f"run diverged: {summary['diverged']}")
    return summary


# --------------------------------------------------------------------------------- client


def train_full(cfg: RunConfig, pid: int, arrays, rnd: int, cfg_json: str | None = None):
    """A full-model client's answer: (ArrayRecord of its update, ConfigRecord fields).

    Builds the model, loads the received tensors (checked as the server checks updates), runs
    the algorithm's local steps on partition ``pid`` (first-order SGD, or FedZO's private ZO
    steps) and returns x_local - x_received in the wire dtype."""
    task = _task_for(cfg_json or cfg.model_dump_json())
    model = task.build_model()
    named = trainable_params(model)
    params = [p for _, p in named]
    received = from_arrays(arrays, named, cfg.wire_dtype, f"round {rnd}: the model sent to partition {pid}")
    with torch.no_grad():
        for p, v in zip(params, received):
            p.copy_(v)
    if cfg.method.gradient == "zo":
        state = ModelState(model, fedzo_config(cfg))
        delta, loss = zo_local(state, Perturber(model, state.params, cfg.perturb_mode, cfg.batch_memory_bytes), task, pid, rnd,
                               cfg.seed, cfg.batch_size)
    else:
        delta, loss = sgd_local(model, params, task, pid, rnd, cfg.lr, cfg.local_steps, cfg.batch_size)
    out = to_arrays([(n, t) for (n, _), t in zip(named, delta)], cfg.wire_dtype)
    return out, {"round": rnd, "client": pid, "loss": float(loss)}


def handle_train_full(msg, context, cfg: RunConfig):
    from flwr.app import ConfigRecord, Message, RecordDict

    from .records import _cfg_json, _partition
    arrays, fields = train_full(cfg, _partition(context), msg.content[ARRAYS], int(msg.content[REC]["round"]),
                                _cfg_json(context))
    return Message(RecordDict({ARRAYS: arrays, REC: ConfigRecord(fields)}), reply_to=msg)
