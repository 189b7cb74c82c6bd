"""The full-model baselines (FedAvg, FedAdam, FedYogi, FedAdagrad, FedZO) over Flower's ArrayRecords.

The server's half is :class:`~hiso.runners.fullmodel.FullModelSimulation`'s (same client
sample for the seed, same weights, same server optimiser, same bytes counted) and its round
is every runner's (:func:`hiso.core.round.play_round`, through :meth:`FlowerFederation.step`):
:class:`ArrayRounds` is the in-process :class:`~hiso.runners.fullmodel.FullRounds` with
Flower's records on the wire, :class:`ArrayTransport` the grid carrying them. So a
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
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..atomic import write_atomic
from ..baselines.local import sgd_local, zo_local
from ..baselines.messages import FullUplink, downlink_size, flatten, uplink_size
from ..config import RunConfig
from ..core.messages import MessageError
from ..core.perturb import Perturber
from ..core.state import ModelState, trainable_params
from ..methods.fullmodel import method_of
from ..runners.drivers import driver_of
from ..runners.fullmodel import FullModelSimulation, FullRounds, fedzo_config
from .records import REC, Settings, _task_for
from .server_app import FlowerFederation
from .transport import GridTransport

ARRAYS = "arrays"  # name of the ArrayRecord that carries a model or an update
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


class UpdateError(MessageError):
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


@dataclass(frozen=True)
class ArrayDownlink:
    """A round's downlink over Flower: the model's ArrayRecord; ``nbytes``, the protocol's
    payload (:func:`downlink_size`), is what each node is counted."""

    round: int
    arrays: object
    nbytes: int


class ArrayRounds(FullRounds):
    """The full-model server with Flower's records on the wire: the global model goes out as
    an ArrayRecord (made once per plan); a reply (the whole Flower message) is read back into
    the update it carries, every field checked (:class:`UpdateError` otherwise)."""

    def __init__(self, sim: FullModelSimulation):
        super().__init__(sim)
        self.named = trainable_params(sim.model)
        self.arrays = None  # the last plan's ArrayRecord

    def encode(self, plan) -> ArrayDownlink:
        self.arrays = to_arrays(self.named, self.sim.dtype)
        return ArrayDownlink(plan.round, self.arrays, downlink_size(self.sim.d, self.sim.dtype))

    def read(self, pid: int | None, rep, plan) -> FullUplink:
        """A reply's flat update and (float32-rounded) loss, or UpdateError."""
        rnd = plan.round
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
        return FullUplink(cid, rnd, flatten(from_arrays(arrays, self.named, self.sim.dtype, what)), loss)


class ArrayTransport(GridTransport):
    """The grid carrying ArrayRecords: a train message is the model's ArrayRecord with the round
    in the hiso ConfigRecord; every reply from a sampled node (a failed one included) goes to
    :meth:`ArrayRounds.read`, counted as the protocol's uplink (:func:`uplink_size`)."""

    def content(self, down: ArrayDownlink):
        from flwr.app import ConfigRecord, RecordDict
        return RecordDict({ARRAYS: down.arrays, REC: ConfigRecord({"round": down.round})})

    def kept(self, pid: int, rep):
        return rep

    def ask_behind(self, plan, replies: dict, downlink) -> None:
        pass  # full-model nodes hold no replica

    def answers(self, plan, replies: dict, tally) -> list:
        sim = self.fed.sim
        for pid in replies:
            tally.up(pid, uplink_size(sim.d, sim.dtype))
        return list(replies.items())


class _NoHistory:
    """What :meth:`FlowerFederation.refresh_nodes` asks of a server: full-model clients hold
    no replica, so the round a node reports is ignored."""

    def __init__(self, rounds: ArrayRounds):
        self.rounds = rounds

    @property
    def round(self) -> int:
        return self.rounds.sim.round

    @property
    def replanned(self) -> int:
        return self.rounds.replanned

    def client_holds(self, client: int, round: int) -> None:
        pass


@dataclass
class FullModelFederation(FlowerFederation):
    """The full-model runner (``run``, ``comm``, ``state_dict``, ``model``) over a Flower Grid;
    node discovery, timeouts, suspects and the round (:meth:`FlowerFederation.step`: partial,
    a round nobody answered planned again) are :class:`FlowerFederation`'s."""

    def __post_init__(self) -> None:
        self.sim = FullModelSimulation(self.task, self.cfg)
        self.rounds = ArrayRounds(self.sim)
        self.server = _NoHistory(self.rounds)
        self.comm = self.sim.comm
        self.privacy = None
        self.named = self.rounds.named
        self._init_nodes()
        self.transport = ArrayTransport(self)

    def _timed(self, rec, plan, times: tuple[float, float, float], **extra) -> None:
        t0, t1, t2 = times
        self.timings.append({"round": rec.round + 1, "nodes_s": t1 - t0, "send_and_receive_s": t2 - t1,
                             "aggregate_apply_s": time.perf_counter() - t2, "participants": list(rec.participants),
                             "sampled": list(plan.participants), "arrayrecord_bytes": self.rounds.arrays.count_bytes()})

    def _mean_loss(self, played) -> float:
        return played.record.loss  # in sampled order

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
    if driver_of(cfg.method).keeps_log:
        raise ValueError(f"{cfg.algorithm} is scalar-only: use hiso.flower.app.serve")
    t0 = time.perf_counter()
    task = _task_for(cfg.model_dump_json())
    settings.load_s = time.perf_counter() - t0  # the waits' scale (hiso.flower.timeouts)
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
    wire = method_of(cfg).wire_dtype
    received = from_arrays(arrays, named, wire, f"round {rnd}: the model sent to partition {pid}")
    with torch.no_grad():
        for p, v in zip(params, received):
            p.copy_(v)
    if cfg.method.gradient == "zo":
        state = ModelState(model, fedzo_config(cfg))
        delta, loss = zo_local(state, Perturber(model, state.params, cfg.perturb_mode, cfg.batch_memory_bytes), task, pid, rnd,
                               cfg.seed, cfg.batch_size)
    else:
        delta, loss = sgd_local(model, params, task, pid, rnd, cfg.lr, cfg.local_steps, cfg.batch_size)
    out = to_arrays([(n, t) for (n, _), t in zip(named, delta)], wire)
    return out, {"round": rnd, "client": pid, "loss": float(loss)}


def handle_train_full(msg, context, cfg: RunConfig):
    from flwr.app import ConfigRecord, Message, RecordDict

    from .records import _cfg_json, _partition
    arrays, fields = train_full(cfg, _partition(context), msg.content[ARRAYS], int(msg.content[REC]["round"]),
                                _cfg_json(context))
    return Message(RecordDict({ARRAYS: arrays, REC: ConfigRecord(fields)}), reply_to=msg)
