"""Run hiso on a loopback Flower federation (``hiso flower``): start it, run, stop everything.

The federation itself (the Flower commands it runs, TLS and node keys) is
:mod:`hiso.flower.federation` and :mod:`hiso.flower.certs`; their names are re-exported here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import RunConfig
from ..runners.drivers import driver_of
from .certs import HOST, make_node_key, make_tls  # noqa: F401
from .federation import (PROJECT, PROJECT_WORKER, QUIET_ENV, FlowerRunError, LocalFederation,  # noqa: F401
                         free_port, rounds_logged)


def default_worker(cfg: RunConfig) -> bool:
    """Whether nodes get a long-lived worker by default: for a language model, whose load (once
    per ClientApp process, i.e. per message, without one) dwarfs a round's work; the
    scalar-only algorithms without SecAgg+ (what a worker serves)."""
    from ..tasks.registry import task_info
    try:
        lm = task_info(cfg.task).build.__module__ == "hiso.tasks.language"
    except (KeyError, ValueError):
        return False
    return lm and driver_of(cfg.method).replica_catches_up and not cfg.secagg


def run_local(cfg: RunConfig, out: str | Path, nodes: int, *, tls: bool = False, auth: bool = False,
              round_timeout: float | None = None, join_timeout: float | None = None, timeout: float = 3600.0,
              workdir: str | Path | None = None, verbose: bool = False, progress=None, resume: bool = False,
              worker: bool | None = None) -> dict:
    """Start a loopback federation of ``nodes`` SuperNodes (partitions 0..clients-1 dealt to them
    in turn: node i serves i, i+nodes, ...), run ``cfg`` into ``out`` (``resume``: continue the
    interrupted run there), stop every process; returns the run's final status (raises unless
    completed, or after ``timeout`` seconds without a round logged, counted at the speed the
    machine offers: :mod:`hiso.patience`). ``round_timeout``, ``join_timeout``: None, from what
    the ServerApp measures (:mod:`hiso.flower.timeouts`); ``worker``: None, :func:`default_worker`."""
    if not 1 <= nodes <= cfg.clients:
        raise ValueError(f"need 1 to {cfg.clients} nodes (the --clients partitions are dealt to them), got {nodes}")
    from .records import noise_seed_refusal
    if why := noise_seed_refusal(cfg):
        raise ValueError(why)
    if nodes < cfg.clients and (cfg.secagg or not driver_of(cfg.method).keeps_log):
        raise ValueError(f"{'--secagg' if cfg.secagg else cfg.algorithm}: each node serves one partition "
                         f"(--nodes {cfg.clients}, as --clients); several partitions per node are for hiso, "
                         "decomfl and fedkseed")
    worker = default_worker(cfg) if worker is None else worker
    if worker and not driver_of(cfg.method).replica_catches_up:
        raise ValueError(f"{cfg.algorithm}: per-node workers serve the scalar-only algorithms (hiso, decomfl)")
    with LocalFederation(nodes=nodes, workdir=Path(workdir) if workdir else None, tls=tls, auth=auth,
                         verbose=verbose, worker=worker, clients=cfg.clients) as fed:
        try:
            run_id = fed.submit(cfg, out, round_timeout=round_timeout, wait_nodes_s=join_timeout, resume=resume)
            if verbose:
                print(f"run {run_id}; logs in {fed.logs}", file=sys.stderr)
            return fed.wait(run_id, timeout, on_poll=progress)
        except BaseException:  # the work directory stays (logs, replicas): say where, and how to go on
            resumable = driver_of(cfg.method).replica_catches_up and (Path(out) / "config.json").exists() \
                and not (Path(out) / "summary.json").exists()
            print(f"hiso flower: Flower's logs and the nodes' replicas are kept in {fed.workdir}"
                  + (f"; to continue: hiso flower --resume {out}"
                     f"{f' --nodes {nodes}' if nodes != cfg.clients else ''} --workdir {fed.workdir}" if resumable else ""),
                  file=sys.stderr)
            raise


def missed_answers_note(out: str | Path) -> str | None:
    """One line naming the partitions whose sampled rounds closed without their answer (a node
    down, late or refused), from the run's ``flower.json``; None when every sampled client answered.
    ``flwr`` reports such a run as completed: without this nothing on the terminal would say so."""
    try:
        timings = json.loads(Path(out, "flower.json").read_text())["flower"]["timings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    sampled: dict[int, int] = {}
    missed: dict[int, int] = {}
    rounds = 0
    for t in timings:
        lost = set(t.get("sampled", [])) - set(t.get("participants", []))
        rounds += bool(lost)
        for pid in t.get("sampled", []):
            sampled[pid] = sampled.get(pid, 0) + 1
        for pid in lost:
            missed[pid] = missed.get(pid, 0) + 1
    if not missed:
        return None
    worst = sorted(missed, key=lambda p: (-missed[p], p))
    parts = ", ".join(f"partition {p} missed {missed[p]} of its {sampled[p]}" for p in worst[:3])
    more = f" and {len(worst) - 3} more partitions" if len(worst) > 3 else ""
    return (f"note: {rounds} of {len(timings)} rounds closed without every sampled client's answer ({parts}{more}): "
            f"a node down, late or refused; the run went on with those that answered (flower.json, the ServerApp log)")
