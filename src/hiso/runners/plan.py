"""``hiso plan``: a deployment's bytes, compute and memory per method, before running it.

Bytes are not estimated: the scalar methods' come from :func:`protocol_traffic` (the real
Server and message encoders over the run's client sampling, with a stand-in replica for the
snapshot rule), the full-model methods' from the baselines' message sizes over the same
sampling, so they equal what a run of the schedule counts. Compute and memory are arithmetic
on the shape: forwards (``tau (P + 1)`` forward differences), directions replayed at
:data:`~hiso.core.server.REPLAY_RATE` values a second, the state a client keeps. The
server's seconds per round are measured: the protocol's own work while planning (plus the
fold of a record into its replica at the same rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..baselines.messages import downlink_size, uplink_size
from ..core.server import REPLAY_RATE, client_sampler, sample_clients
from ..methods.registry import method_info
from .protocol import protocol_traffic


@dataclass(frozen=True)
class Deployment:
    """The shape a user plans for: model size ``params`` (d), population, clients a round."""

    params: int
    clients: int
    sampled: int
    rounds: int
    local_steps: int = 1
    perturbations: int = 5
    scalar_dtype: str = "float32"
    bandwidth: float | None = None  # bytes/s of a client's link (None: bytes only, no seconds)
    forward_s: float = 0.0  # seconds of one client forward (one batch)
    snapshot_after: int | None = None  # None: the servers' automatic rule
    seed: int = 0


def participation(dep: Deployment) -> np.ndarray:
    """Rounds each client takes part in, from the run's own sampler (the same for every method)."""
    rng, times = client_sampler(dep.seed), np.zeros(dep.clients, dtype=np.int64)
    for _ in range(dep.rounds):
        times[list(sample_clients(rng, dep.clients, dep.sampled))] += 1
    return times


def plan_method(name: str, dep: Deployment, times: np.ndarray | None = None) -> dict:
    """One method's figures, per client (means over the population) and for the server."""
    info = method_info(name)
    d, tau, P, M = dep.params, dep.local_steps, dep.perturbations, dep.clients
    if info.family == "full-model":
        times = participation(dep) if times is None else times
        down, up = times * downlink_size(d), times * uplink_size(d)
        per = times.mean()
        zo = info.gradient == "zo"
        row = {"up": float(up.mean()), "down": float(down.mean()), "catch_up": 0.0, "snapshots": 0.0,
               "join": 0.0, "forwards": per * tau * ((P + 1) if zo else 1), "backwards": 0.0 if zo else per * tau,
               "replayed": 0.0, "client_bytes": 4 * d * (2 if zo else 3),  # model + delta (+ gradient)
               "server_bytes": 8 * d, "server_s": dep.sampled * d / REPLAY_RATE}
    elif info.family == "scalar" and info.gradient == "zo" and "one-seed" not in info.can:
        keeps_h = "preconditioner" in info.can
        values = d * (2 if keeps_h else 1)
        st: dict = {}
        comm = protocol_traffic(M, dep.sampled, tau, P, dep.rounds, scalar_dtype=dep.scalar_dtype, seed=dep.seed,
                                state_values=values, snapshot_after=dep.snapshot_after, bandwidth=dep.bandwidth,
                                stats=st)
        per = dep.rounds * dep.sampled / M
        snap = st["snapshot_bytes"] / M
        row = {"up": float(comm.up.mean()), "down": float(comm.down.mean()),
               "join": (st["join_down"] + st["join_up"]) / M, "snapshots": snap,
               "catch_up": float(comm.down.mean()) - snap - st["join_down"] / M,
               "forwards": per * tau * (P + 1), "backwards": 0.0, "replayed": st["records"] * tau * P / M,
               "client_bytes": 4 * values, "snapshot_after": st["snapshot_after"],
               "server_bytes": 8 * M + 4 * values + min(dep.rounds, st["snapshot_after"]) * 4 * tau * P,
               "server_s": st["server_s"] / dep.rounds + tau * P * d / REPLAY_RATE}
    else:
        raise ValueError(f"hiso plan does not cover {name} ({info.family}, {info.gradient}): "
                         "plan the scalar ZO methods and the full-model baselines")
    # a backward costs about two forwards
    row["client_s"] = (row["forwards"] + 2 * row["backwards"]) * dep.forward_s + row["replayed"] * d / REPLAY_RATE
    if dep.bandwidth:
        row["client_s"] += (row["up"] + row["down"]) / dep.bandwidth
    return {"method": name, **row}


def plan(methods: list[str], dep: Deployment) -> list[dict]:
    times = participation(dep)
    return [plan_method(m, dep, times) for m in methods]


def _b(x: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= k:
            return f"{x / k:.1f} {unit}"
    return f"{x:.0f} B"


def format_plan(rows: list[dict], dep: Deployment) -> str:
    """The table ``hiso plan`` prints: one row per method, per client over the whole run."""
    head = (f"d={dep.params:,} params, {dep.clients:,} clients, {dep.sampled} a round, {dep.rounds} rounds "
            f"(each client ~{dep.rounds * dep.sampled / dep.clients:.1f} rounds), tau={dep.local_steps}, "
            f"P={dep.perturbations}, {dep.scalar_dtype} scalars")
    cols = ("method", "up", "down", "catch-up", "snapshots", "forwards", "backwards", "replayed dirs",
            "client mem", "client s", "server mem", "server s/round")
    out = [head, "per client, whole run (means over the population):", "  ".join(f"{c:>13}" for c in cols)]
    for r in rows:
        cells = (r["method"], _b(r["up"]), _b(r["down"]), _b(r["catch_up"]), _b(r["snapshots"]),
                 f"{r['forwards']:.1f}", f"{r['backwards']:.1f}", f"{r['replayed']:.0f}", _b(r["client_bytes"]),
                 f"{r['client_s']:.3g}", _b(r["server_bytes"]), f"{r['server_s']:.3g}")
        out.append("  ".join(f"{c:>13}" for c in cells))
    out.append("bytes: the encoders' own counts over this sampling; down includes the join; client s: (forwards + 2 "
               "backwards) x --forward-s + replay + bytes / --bandwidth; server s: measured protocol work + the fold")
    return "\n".join(out)
