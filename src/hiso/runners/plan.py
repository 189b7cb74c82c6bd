"""``hiso plan``: a deployment's bytes, compute and memory per method, before running it.

Bytes are not estimated: the scalar-family methods' (HiSo, DeComFL, FeedSign, Ferret, sketch)
come from :func:`protocol_traffic` (the real Server with the run's own method hooks, so FeedSign's
sign bits and the sketch's codes, and the message encoders over the run's client sampling, with
a stand-in replica for the snapshot rule), FedKSeed's from :func:`~hiso.runners.protocol.pool_traffic` (its pool
encoders over the same sampling), the full-model methods' from the baselines' message sizes,
so they equal what a run of the schedule counts. Each method's settings are resolved by
:class:`~hiso.config.RunConfig` as a run's are (FeedSign's and FedKSeed's P = 1 and central
differences, Ferret's (B, K) record). Compute and memory are arithmetic on the shape: forwards
and backwards as the runners count them, directions of d values a client draws (replay at
:data:`~hiso.core.server.REPLAY_RATE` values a second), the values a client keeps (no
activations). The server's seconds per round are measured: the protocol's own work while
planning, plus the fold of a record into its replica at the same rate. Given a language model's
structure (``--params-model``), :mod:`.plan_memory` adds a client's memory by base dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..baselines.messages import downlink_size, uplink_size
from ..core.server import REPLAY_RATE, client_sampler, sample_clients
from ..core.wire import Wire
from ..methods.options import fields_of
from ..methods.registry import method_info
from .drivers import driver_of
from .protocol import pool_traffic, protocol_traffic


@dataclass(frozen=True)
class Deployment:
    """The shape a user plans for: model size ``params`` (d), population, clients a round."""

    params: int
    clients: int
    sampled: int
    rounds: int
    local_steps: int = 1
    perturbations: int = 5  # P of the multi-seed ZO methods (FeedSign and FedKSeed take 1)
    scalar_dtype: str = "float32"
    bandwidth: float | None = None  # bytes/s of a client's link (None: bytes only, no seconds)
    forward_s: float = 0.0  # seconds of one client forward (one batch)
    snapshot_after: int | None = None  # None: the servers' automatic rule
    seed: int = 0
    difference: str | None = None  # None: each method's own (forward; central for FeedSign, FedKSeed)
    ferret_k: int | None = None  # None: the method's defaults, as a run's
    ferret_blocks: int | None = None
    sketch_bits: int | None = None
    seed_pool: int | None = None
    seed_sampling: str | None = None


def participation(dep: Deployment) -> np.ndarray:
    """Rounds each client takes part in, from the run's own sampler (the same for every method)."""
    rng, times = client_sampler(dep.seed), np.zeros(dep.clients, dtype=np.int64)
    for _ in range(dep.rounds):
        times[list(sample_clients(rng, dep.clients, dep.sampled))] += 1
    return times


def run_config(name: str, dep: Deployment):
    """The :class:`~hiso.config.RunConfig` a run of ``name`` on this deployment would have."""
    from pydantic import ValidationError

    from ..config import RunConfig, one_line
    info = method_info(name)
    opts = {"algorithm": name, "clients": dep.clients, "sampled": dep.sampled, "rounds": dep.rounds,
            "local_steps": dep.local_steps, "scalar_dtype": dep.scalar_dtype, "seed": dep.seed,
            "snapshot_after": dep.snapshot_after, "bandwidth": dep.bandwidth}
    if "one-seed" not in info.can:
        opts["perturbations"] = dep.perturbations
    own = fields_of(info.cls)  # a method's own fields that are flags (fedkseed's seed_pool, ...)
    for key in ("difference", "ferret_k", "ferret_blocks", "sketch_bits", "seed_pool", "seed_sampling"):
        if getattr(dep, key) is not None and (info.reads(key) or key in own):
            opts[key] = getattr(dep, key)
    try:
        return RunConfig(**opts)
    except ValidationError as e:
        raise ValueError(f"{name}: {one_line(e)}") from None


def zo_forwards(tau: int, P: int, difference: str) -> int:
    """Forwards of one ZO local update (:func:`hiso.core.estimator.local_update`)."""
    return tau * (P + 1) if difference == "forward" else 2 * tau * P


def zo_directions(tau: int, P: int, difference: str, folds: int) -> int:
    """Directions one ZO local update draws: one per perturbed forward (the Perturber's fused
    shift), and P for each of ``folds`` local steps folded into the iterate."""
    return (tau * P if difference == "forward" else 2 * tau * P) + folds * P


def _full_model(info, cfg, dep: Deployment, times: np.ndarray) -> dict:
    d, tau = dep.params, cfg.local_steps
    down, up = times * downlink_size(d), times * uplink_size(d)
    per = times.mean()
    zo = info.gradient == "zo"
    shifts = per * zo_directions(tau, cfg.perturbations, cfg.difference, tau) if zo else 0.0  # (+ its delta's)
    return {"up": float(up.mean()), "down": float(down.mean()), "catch_up": 0.0, "snapshots": 0.0, "join": 0.0,
            "forwards": per * (zo_forwards(tau, cfg.perturbations, cfg.difference) if zo else tau),
            "backwards": 0.0 if zo else per * tau, "drawn": shifts, "perturbed": shifts,
            "client_bytes": 4 * d * (2 if zo else 3),  # model + delta (+ gradient)
            "server_bytes": 8 * d, "server_s": dep.sampled * d / REPLAY_RATE}


def _per_tensor_stages(zo) -> int:
    """The fold's stages that keep a tensor per trainable tensor (HiSo's H, a momentum buffer,
    conmezo's m): each is d more values in a replica and a snapshot."""
    import torch

    from ..core.chain import stages_for
    chain = stages_for(zo)
    return sum(1 for st in chain if st.name is not None and isinstance(st.init([torch.zeros(1)]), list))


# what the plan's note says of an uplink codec (hiso.core.uplink) by its name; another: its name
_UP_NOTES = {"scalars": "", "signs": ", one sign bit a step up", "choice": ", one (index, scalar) a step up"}


def _scalar(info, cfg, dep: Deployment) -> dict:
    d, M = dep.params, dep.clients
    zo = cfg.zo()
    up = zo.uplink  # the answers' codec (hiso.core.uplink)
    tau, P = zo.shape  # Ferret and sketch: (B, K), their SGD steps are cfg.local_steps
    values = d * (1 + _per_tensor_stages(zo))  # x and each stage's tensors (HiSo's H, a momentum buffer)
    st: dict = {}
    comm = protocol_traffic(M, dep.sampled, tau, P, dep.rounds, scalar_dtype=zo.scalar_dtype, seed=dep.seed,
                            state_values=values, snapshot_after=cfg.snapshot_after, bandwidth=cfg.bandwidth,
                            stats=st, method=zo.method)
    per = dep.rounds * dep.sampled / M
    snap = st["snapshot_bytes"] / M
    if info.gradient == "first-order":  # a record costs K directions (each tensor its block's K), as a projection
        steps = cfg.local_steps
        fwd, bwd, dirs = per * steps, per * steps, P
        drawn, shifts = st["records"] * P / M + per * P, 0.0
        client = 4 * d * 4  # model, x_r's copy, gradient, the update
        note = (f"B={tau} blocks x K={P} projections, {f'{up.bits}-bit codes' if up.name == 'codes' else 'float32'}"
                f" up; drawn dirs include the K a client projects its update on each answer")
    else:
        fwd, bwd, dirs = per * zo_forwards(tau, P, zo.difference), 0.0, tau * P
        shifts = per * zo_directions(tau, P, zo.difference, tau - 1)
        drawn = st["records"] * tau * P / M + shifts
        client = 4 * values + (4 * d if tau > 1 else 0)  # (+ the local iterate's delta)
        note = f"P={P}, {zo.difference} differences" + _UP_NOTES.get(up.name, f", {up.name} up")
    return {"up": float(comm.up.mean()), "down": float(comm.down.mean()),
            "join": (st["join_down"] + st["join_up"]) / M, "snapshots": snap,
            "catch_up": float(comm.down.mean()) - snap - st["join_down"] / M,
            "forwards": fwd, "backwards": bwd, "drawn": drawn, "perturbed": shifts, "client_bytes": client,
            "snapshot_after": st["snapshot_after"],
            "server_bytes": 8 * M + 4 * values + min(dep.rounds, st["snapshot_after"]) * Wire.of(zo, 0).record_bytes,
            "server_s": st["server_s"] / dep.rounds + dirs * d / REPLAY_RATE, "note": note}


def _seed_pool(cfg, dep: Deployment) -> dict:
    from ..methods.fedkseed_method import FedKSeed
    method = FedKSeed.of(cfg)
    d, M, K, tau = dep.params, dep.clients, method.seed_pool, cfg.local_steps
    st: dict = {}
    comm = pool_traffic(M, dep.sampled, tau, K, dep.rounds, dtype=cfg.scalar_dtype, seed=dep.seed,
                        sampling=method.seed_sampling, stats=st)
    per = dep.rounds * dep.sampled / M
    how = ("distinct seeds drawn so far (the run's draws)" if st["exact"] else
           "at most min(K, pairs so far): weighted draws follow the scalars, not exact")
    return {"up": float(comm.up.mean()), "down": float(comm.down.mean()), "join": (st["join_down"] + st["join_up"]) / M,
            "snapshots": 0.0, "catch_up": float(comm.down.mean()) - st["join_down"] / M,
            "forwards": per * zo_forwards(tau, 1, cfg.difference), "backwards": 0.0,
            "drawn": st["materialised"] / M + per * zo_directions(tau, 1, cfg.difference, tau - 1),
            "perturbed": per * zo_directions(tau, 1, cfg.difference, tau - 1),
            "client_bytes": 4 * d * (2 + (tau > 1)) + 24 * K,  # model, x_0 (+ delta), C, |g| sums, counts
            "server_bytes": 8 * M + 8 * d + 24 * K + st["log_bytes"],
            "server_s": st["server_s"] / dep.rounds + st["server_materialised"] / dep.rounds * d / REPLAY_RATE,
            "note": f"K={K} seeds ({method.seed_sampling}), {cfg.difference} differences; drawn dirs: the pool "
                    f"directions each answer materialises, {how}"}


def plan_method(name: str, dep: Deployment, times: np.ndarray | None = None) -> dict:
    """One method's figures, per client (means over the population) and for the server."""
    info = method_info(name)
    cfg = run_config(name, dep)
    driver = driver_of(info)  # what a round moves: the model, a pool's pairs, or seeds and scalars
    if not driver.keeps_log:
        row = _full_model(info, cfg, dep, participation(dep) if times is None else times)
    elif driver.pool_rounds:
        row = _seed_pool(cfg, dep)
    else:
        row = _scalar(info, cfg, dep)
    # a backward costs about two forwards
    row["client_s"] = (row["forwards"] + 2 * row["backwards"]) * dep.forward_s + row["drawn"] * dep.params / REPLAY_RATE
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
            f"{dep.scalar_dtype} scalars")
    cols = ("method", "up", "down", "catch-up", "snapshots", "forwards", "backwards", "drawn dirs",
            "client mem", "client s", "server mem", "server s/round")
    out = [head, "per client, whole run (means over the population):", "  ".join(f"{c:>13}" for c in cols)]
    for r in rows:
        cells = (r["method"], _b(r["up"]), _b(r["down"]), _b(r["catch_up"]), _b(r["snapshots"]),
                 f"{r['forwards']:.1f}", f"{r['backwards']:.1f}", f"{r['drawn']:.0f}", _b(r["client_bytes"]),
                 f"{r['client_s']:.3g}", _b(r["server_bytes"]), f"{r['server_s']:.3g}")
        out.append("  ".join(f"{c:>13}" for c in cells))
    out += [f"  {r['method']}: {r['note']}" for r in rows if r.get("note")]
    out.append("bytes: the encoders' own counts over this sampling; down includes the join; drawn dirs: directions "
               "of d values a client draws (its perturbed forwards' and local steps', catch-up replay, projections, "
               "pool materialisation); "
               "client mem: the values it keeps, no activations; client s: (forwards + 2 x backwards: a backward "
               "counted as two forwards) x --forward-s + drawn dirs + bytes / --bandwidth; server s: measured "
               "protocol work + the fold")
    return "\n".join(out)
