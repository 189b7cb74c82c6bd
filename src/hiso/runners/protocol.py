"""The core Server a runner drives for a run, and a schedule's bytes per client without a model."""

from __future__ import annotations

import numpy as np

from ..core.config import ZOConfig
from ..core.messages import (Hello, Uplink, decode_uplink, encode_downlink, encode_hello, encode_uplink, encode_welcome,
                             welcome_for)
from ..core.server import Server
from ..core.state import ModelState
from ..methods.privacy import noise_key
from ..methods.secagg import SecAggConfig
from ..tasks.base import Task
from .common import Comm


def protocol_server(task: Task, zo: ZOConfig, clients_per_round: int, seed: int, weighted: bool,
                    replica: ModelState, snapshot_after: int | None = None, bandwidth: float | None = None,
                    rule: str = "mean", trim: float = 0.25, noise_seed: int | None = None,
                    secagg: SecAggConfig | None = None) -> Server:
    """The core Server a runner (the simulator, the Flower ServerApp) drives for ``zo``: the
    task's clients, the run seed, the scalar dtype, and snapshots of ``replica`` (the runner's
    x_r) for clients more than ``snapshot_after`` rounds behind (None: when cheaper). Under
    DP, ``noise_seed`` keys the server's noise (None: a fresh secret); ``secagg``: the mean from
    the sum of the answers on secure aggregation's grid."""
    weights = task.client_sizes() if weighted else None
    return Server(task.num_clients, clients_per_round, zo.local_steps, zo.perturbations, seed=seed, weights=weights,
                  scalar_dtype=zo.scalar_dtype, replica=replica, snapshot_after=snapshot_after, bandwidth=bandwidth,
                  rule=rule, trim=trim, dp=zo.dp, noise_seed=noise_key(noise_seed), method=zo.method, secagg=secagg)


class _Blob:
    """A stand-in replica of ``n`` float32 values (sizes snapshots without a model)."""

    def __init__(self, n: int):
        import torch
        self.params, self.h, self.round = [torch.zeros(n)], None, 0


def protocol_traffic(num_clients: int, clients_per_round: int, local_steps: int, perturbations: int, rounds: int,
                     *, scalar_dtype: str = "float32", seed: int = 0, state_values: int | None = None,
                     snapshot_after: int | None = None, bandwidth: float | None = None,
                     stats: dict | None = None, method=None) -> Comm:
    """Bytes per client of a schedule, from the encoded messages, without a model: joins, each
    round's downlinks (history or snapshot) and uplinks with their loss. The bytes of a run do
    not depend on what it learns, so this is what a run of the schedule counts (with the same
    ``seed``: the same sampling). ``state_values``: the trainable values plus H's (HiSo) of the
    model, for the snapshot choice (None: no snapshots, e.g. a model too large to ever send).
    ``stats``, if given, receives the split of the downlinks: snapshots and their bytes,
    missed records replayed, the join bytes, the snapshot threshold and the server's seconds.
    ``method``: the run's :class:`~hiso.core.method.Method` (FeedSign's signs, a sketch's codes
    change the uplink's encoding; None: DeComFL's and HiSo's)."""
    import time
    t0 = time.perf_counter()
    blob = None if state_values is None else _Blob(state_values)
    server = Server(num_clients, clients_per_round, local_steps, perturbations, seed=seed, scalar_dtype=scalar_dtype,
                    replica=blob, snapshot_after=snapshot_after, bandwidth=bandwidth, method=method)
    wire, comm = server.wire, Comm.zeros(num_clients)
    welcome = encode_welcome(welcome_for(ZOConfig(lr=1.0, perturbations=perturbations, local_steps=local_steps,
                                                  scalar_dtype=scalar_dtype), seed, []))
    for c in range(num_clients):
        comm.join(c, encode_hello(Hello(c, 0)), welcome)
    zeros = (np.ones if wire.signs else np.zeros)(wire.shape, np.float32)  # (FeedSign's answers are +-1)
    split = {"snapshots": 0, "snapshot_bytes": 0, "records": 0, "join_down": int(comm.down.sum()),
             "join_up": int(comm.up.sum())}
    for _ in range(rounds):
        plan = server.plan()
        ups = []
        for c in plan.participants:
            msg = server.downlink(c)
            data = encode_downlink(msg, wire)
            comm.down[c] += len(data)
            split["records"] += len(msg.missed)
            if msg.snapshot is not None:
                split["snapshots"] += 1
                split["snapshot_bytes"] += len(data)
            up = encode_uplink(Uplink(c, plan.round, zeros, 0.0, plan.attempt), wire)
            comm.up[c] += len(up)
            ups.append(decode_uplink(up, wire))
        server.aggregate(ups)
        if blob is not None:
            blob.round += 1
    if stats is not None:
        stats.update(split, snapshot_after=server.snapshot_after, server_s=time.perf_counter() - t0)
    return comm
