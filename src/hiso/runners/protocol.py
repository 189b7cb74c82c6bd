"""The core Server a runner drives for a run, and a schedule's bytes per client without a model
(the scalar protocol's, :func:`protocol_traffic`, played by :class:`~hiso.core.server_rounds.ScalarRounds`;
FedKSeed's, :func:`pool_traffic`)."""

from __future__ import annotations

import numpy as np

from ..core.config import ZOConfig

from ..core.messages import (Hello, Uplink, encode_downlink, encode_hello, encode_uplink, encode_welcome, varint_size,
                             welcome_for)
from ..core.round import PlainTransport, play_round
from ..core.server import Server, client_sampler, sample_clients
from ..core.server_rounds import ScalarRounds
from ..core.state import ModelState
from ..methods.privacy import noise_key
from ..methods.secagg import SecAggConfig
from ..tasks.base import Task
from .common import Comm, CommTally


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


class BlobReplica:
    """A stand-in replica of ``n`` float32 values (sizes snapshots without a model). One zero
    seen ``n`` times: a plan of a billion-parameter model holds no copy of it (a snapshot the
    schedule does send is still encoded whole)."""

    def __init__(self, n: int):
        import torch
        self.params, self.h, self.round = [torch.zeros(1).expand(n)], None, 0


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
    blob = None if state_values is None else BlobReplica(state_values)
    server = Server(num_clients, clients_per_round, local_steps, perturbations, seed=seed, scalar_dtype=scalar_dtype,
                    replica=blob, snapshot_after=snapshot_after, bandwidth=bandwidth, method=method)
    wire, comm = server.wire, Comm.zeros(num_clients)
    welcome = encode_welcome(welcome_for(ZOConfig(lr=1.0, perturbations=perturbations, local_steps=local_steps,
                                                  scalar_dtype=scalar_dtype), seed, []))
    for c in range(num_clients):
        comm.join(c, encode_hello(Hello(c, 0)), welcome)
    zeros = np.zeros(wire.shape, np.float32)  # encoded unchecked: its size only (a codec may refuse zeros)
    split = {"snapshots": 0, "snapshot_bytes": 0, "records": 0, "join_down": int(comm.down.sum()),
             "join_up": int(comm.up.sum())}

    class Counted(ScalarRounds):  # the downlinks' split: records replayed, snapshots
        def downlink(self, client: int) -> bytes:
            msg = server.downlink(client)
            data = encode_downlink(msg, wire)
            split["records"] += len(msg.missed)
            if msg.snapshot is not None:
                split["snapshots"] += 1
                split["snapshot_bytes"] += len(data)
            return data

    class Zeros(PlainTransport):  # every client answers, with zeros: the bytes do not depend on values
        def exchange(self, plan, downlink, tally):
            out = []
            for c in plan.participants:
                downlink(c)
                up = encode_uplink(Uplink(c, plan.round, zeros, 0.0, plan.attempt), wire, check=False)
                tally.up(c, len(up))
                out.append((c, up))
            return out

    def advance(rec) -> None:  # the stand-in replica moves on with the server
        if blob is not None:
            blob.round += 1

    driver, transport, tally = Counted(server, on_commit=advance), Zeros(), CommTally(comm)
    for _ in range(rounds):
        play_round(driver, transport, tally)
    if stats is not None:
        stats.update(split, snapshot_after=server.snapshot_after, server_s=time.perf_counter() - t0)
    return comm


def pool_traffic(num_clients: int, sampled: int, tau: int, K: int, rounds: int, *, dtype: str = "float32",
                 seed: int = 0, sampling: str = "weighted", stats: dict | None = None) -> Comm:
    """Bytes per client of a FedKSeed schedule without a model, as :class:`~hiso.runners.inprocess.FedKSeedSimulation`
    counts them: the joins, each answer's downlink (every record since the client's last round)
    and uplink, sized by the pool encoders (a record's bytes depend on who answered, not on
    its values). ``stats``, if given, receives the join bytes, the log's bytes, the server's
    seconds and the pool directions materialised by the clients' answers and by the server's
    rounds: with uniform sampling the distinct indices drawn so far (the run's own draws, so
    exact unless a seed's scalars sum to exactly 0); with weighted sampling the draws follow
    the scalars, so the bound min(K, pairs so far) (``exact`` False)."""
    import time

    from ..methods.fedkseed import PoolRecord, draw_indices, encode_pool_downlink, encode_pool_uplink
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
