"""A run on disk: run a configuration into a directory, and rebuild its model from the log.

DIR/config.json     the resolved configuration
DIR/metrics.jsonl   one row per round (row 0: the initial evaluation), flushed as it goes
DIR/history.bin     the server's log (aggregated scalars, attempt and participants per round)
DIR/summary.json    final and best metrics, communication per client, time and memory (DP: privacy)
DIR/model.pt        the final server model (state dict) and, for HiSo, H
DIR/rejections.log  every message a run with faults or attackers rejected, and why
DIR/dp_secret.json  the DP noise key a run with --dp-clip drew (not in config.json: it undoes the noise)
DIR/checkpoint.pt   while it runs: the server's state at a recent round (hiso.runners.checkpoint)

``hiso run --force`` over a run removes all of these (and ``hiso eval``'s and ``diagnose``'s output
there) first: :func:`hiso.runners.runfiles.clear_run`; a user's other files in DIR stay.

A run whose model (or H) turns non-finite, or whose mean training loss is non-finite or exceeds
``diverge_factor`` x round 1's, stops as diverged (``summary.json`` ``diverged``, exit 1 from
``hiso run``). Its ``model.pt`` is the last finite model, and for the scalar-only algorithms
``history.bin`` ends at that same round (``hiso rebuild`` reproduces it).

Crash safety (scalar-only algorithms): a round counts as done once its record is in
``history.bin`` (checksummed, flushed and fsync'd) *and* its row in ``metrics.jsonl``.
``run_to_dir(..., resume=True)`` (``hiso run --resume DIR``) continues a run killed at any
point: it keeps the rounds done (a torn history record or metrics line is dropped; each
file is cut back to the rounds both hold), rebuilds the server's model and H by replaying
the log, the server's client sampling by drawing it again for the logged rounds (each
record's attempt says how often; seeds derive from the run seed; all checked against the
log), the bytes counted per client by re-encoding the messages, and
goes on. The result is the uninterrupted run's ``model.pt``, ``history.bin`` and metrics,
bit for bit (``wall_s`` apart: it adds the time of both attempts' kept rounds). With a
checkpoint of this run (:mod:`hiso.runners.checkpoint`) the model and H start from its round
and replay only the records after it; the server's bookkeeping still goes over every record.

Reading a directory back: :mod:`hiso.runners.runfiles` (config, checkpoint, resume point);
its model from the log: :mod:`hiso.runners.rebuild`. Their names are importable from here too.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from ..config import RunConfig
from ..tasks.base import Task
from ..tasks.device import on_device
from ..tasks.registry import build_task, higher_is_better
from .rebuild import logged_rounds, rebuild, start_replica  # noqa: F401 (one import path for a run directory)
from ..methods.identity import source_of
from .runfiles import config_text, method_source
from .portable import portable_name
from .continuing import extend_refusal, same_run  # noqa: F401 (one import path for a run directory)
from .runfiles import (check_run_task, checkpoint, clear_run, cut_rejections, dp_secret,  # noqa: F401
                       made_before, not_a_dir, overwrites_run, read_run_history, resume_point,
                       saved_config, write_atomic)
from ..atomic import save_atomic
from .checkpoint import FILE as CHECKPOINT
from .checkpoint import Checkpoints, CheckpointUnusable, final_marker, keep_final, load_start
from .common import finite
from .drivers import driver_of
from .accounting import ledger_of_run
from .simulate import PrivacyBudgetSpent


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def build_simulation(cfg: RunConfig, task: Task, on_record: Callable | None = None):
    """The in-process runner for ``cfg.algorithm``.

    Every runner offers ``run(rounds)`` (metrics rows), ``comm`` (bytes per client) and
    ``state_dict()`` (the final model).
    """
    return driver_of(cfg.method).simulation(cfg, task, on_record)


def loss_diverged(loss: float | None, first: float | None, factor: float | None) -> str | None:
    """Why a round's mean training loss means divergence (None: it does not): non-finite, or
    above ``factor`` x ``first`` (round 1's loss, the clients' loss at x_0; skipped if <= 0)."""
    if loss is None:
        return None
    if not math.isfinite(loss):
        return f"non-finite training loss {loss}"
    if factor is not None and first is not None and first > 0 and loss > factor * first:
        return f"training loss {loss:.4g} exceeds diverge_factor {factor:g} x round 1's {first:.4g}"
    return None


def _extend(out: Path, done: int, cfg: RunConfig, info: dict) -> None:
    """Resume ``out`` (a run of ``done`` rounds, finished or not) towards ``cfg.rounds`` > ``done``:
    config.json names the new horizon first, then the old summary goes (a kill in between leaves
    a summary of fewer rounds than config.json asks for, which counts as unfinished)."""
    if cfg.rounds < done:
        raise ValueError(f"{out} holds a run of {done} rounds: it cannot be cut to {cfg.rounds} "
                         f"(`hiso rebuild --round {cfg.rounds}` gives the model at that round)")
    why = extend_refusal(cfg, done)
    if why is not None:
        raise ValueError(f"{out} cannot be continued to {cfg.rounds} rounds: {why}")
    if driver_of(cfg.method).checkpointed:  # its model.pt: where the continuation starts
        keep_final(out, cfg)
    write_atomic(out / "config.json", config_text(cfg, info, out))
    (out / "summary.json").unlink(missing_ok=True)


def _check_declared_metrics(task: str, row: dict) -> None:
    """The metrics a task declares (what compare selects and best-of reads) must be what its
    evaluate() returns: a misnamed one would be silently absent from every table."""
    from ..tasks.registry import task_info
    missing = [m for m in task_info(task).metrics if m not in row]
    if missing:
        got = ", ".join(k for k in row if k not in ("round", "train_loss", "bytes_up", "bytes_down", "wall_s"))
        raise ValueError(f"task {task} declares the metric {missing[0]!r} but its evaluate() returned "
                         f"{got or 'nothing'}: make its metrics name what evaluate() returns")


def run_to_dir(cfg: RunConfig, out: str | Path, progress: Callable | None = None,
               task: Task | None = None, resume: bool = False, runner: Callable | None = None,
               tracking=None) -> dict:
    """Run ``cfg`` and write DIR. ``progress(row)`` is called after every round.

    ``runner(cfg, task, on_record)`` builds the runner (default :func:`build_simulation`); a
    transport such as the Flower ServerApp passes its own and gets the same run directory.

    ``resume``: DIR holds an interrupted run of ``cfg`` (same ``config.json``): continue it
    (see the module's docstring). Scalar-only algorithms only: the full-model baselines keep
    no log to rebuild their server (and optimiser) state from.

    ``tracking`` (:class:`hiso.report.tracking.Tracking`): each row also goes to TensorBoard / MLflow.
    """
    out = Path(out)
    older = made_before(out) if resume else {}
    if older:  # options added after the run began keep the values it began with
        cfg, task = cfg.model_copy(update=older), None  # (a task built for the new values is not this run's)
    if resume and not driver_of(cfg.method).keeps_log:
        raise ValueError(f"{cfg.algorithm} runs cannot be resumed: full-model algorithms keep no log to rebuild "
                         f"their state from (start again with --force)")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    given = task is not None
    task = on_device(task, cfg.device) if given else build_task(cfg)
    if "backprop" in cfg.method.can and not getattr(task, "differentiable", True):
        raise ValueError(f"{cfg.algorithm} takes first-order local steps: task {cfg.task} has no gradients (a black box): "
                         f"use a zeroth-order algorithm (hiso, decomfl, feedsign, fedkseed)")
    info = task.describe()
    out.mkdir(parents=True, exist_ok=True)
    kept, records = driver_of(cfg.method).resume_point(out, cfg) if resume else ([], [])
    saved = saved_config(out) if resume and (out / "config.json").exists() else None
    if saved is not None and (method_source(out) or {}).get("sha256") != (source_of(cfg.algorithm) or {}).get("sha256"):
        write_atomic(out / "config.json", config_text(cfg, saved[1], out, len(kept) - 1 if kept else 0))  # accepted
    if saved is not None:  # continuing it on another task would mix two runs
        check_run_task(task, saved[1], out, given=given, resume=True)
    saved_rounds = saved[0].rounds if saved is not None else None
    if saved_rounds is not None and saved_rounds != cfg.rounds:
        _extend(out, saved_rounds, cfg, info)
    elif not resume or saved_rounds is None:
        write_atomic(out / "config.json", config_text(cfg, info, out))
    best: dict[str, float] = {}
    last_eval: dict = {}
    t0 = time.perf_counter()
    with ExitStack() as stack:
        if resume:  # cut metrics back to the rounds kept, then append
            write_atomic(out / "metrics.jsonl", "".join(line + "\n" for line in kept))
        mf = stack.enter_context(open(out / "metrics.jsonl", "a" if resume else "w"))
        writer = driver_of(cfg.method).log_writer(out, cfg, records, resume)  # (full-model baselines: none)
        hist = None if writer is None else stack.enter_context(writer)

        def log(rec):  # a round that left x or H non-finite is not logged (and not counted)
            st = sim.state
            if not finite(st.params) or (st.h is not None and not finite(st.h)):
                raise FloatingPointError(f"the model or H became non-finite in round {rec.round + 1} (lower lr)")
            hist.write(rec)

        sim = (runner or build_simulation)(dp_secret(out, cfg, resume), task, log if hist else None)
        # the server's state every so often, so that a resume replays only the rounds after it
        ckpt = (Checkpoints(out, cfg, start=len(records))
                if driver_of(cfg.method).checkpointed and sim.state is not None else None)
        sim.measure_client()  # a client's memory, on one extra answer (hiso.runners.client_cost)
        if sim.unreliable:  # every rejected message, with its reason
            if kept:  # resume: keep the log of the kept rounds ("row N ..." lines, N <= the last kept)
                cut_rejections(out / "rejections.log", len(kept) - 1)
            handler = logging.FileHandler(out / "rejections.log", mode="a" if kept else "w")
            handler.setFormatter(logging.Formatter("%(message)s"))
            flog = logging.getLogger("hiso.faults")
            flog.setLevel(logging.INFO)
            flog.addHandler(handler)
            stack.callback(flog.removeHandler, handler)
            stack.callback(handler.close)
        tracker = tracking.open(cfg) if tracking is not None and tracking.active else None
        if tracker is not None:
            stack.callback(tracker.close, False)  # closed as failed on an exception (a no-op once closed)
        row = {}
        diverged = stopped = None
        first_loss = None

        def account(row) -> dict | None:  # best/final metrics and the divergence test, per row
            nonlocal last_eval, first_loss
            if "eval_loss" in row:
                last_eval = {k: v for k, v in row.items() if k.startswith(("eval_", "val_", "gap"))}
                for k, v in last_eval.items():
                    better = max if higher_is_better(k, cfg.task) else min
                    best[k] = v if k not in best else better(best[k], v)
            if first_loss is None:
                first_loss = row.get("train_loss")
            why = loss_diverged(row.get("train_loss"), first_loss, cfg.diverge_factor)
            return None if why is None else {"round": row["round"], "error": why}

        rows = sim.run(cfg.rounds) if not kept else ()
        resumed_from = None  # the round whose checkpointed state a resume started from
        if kept:  # resume: the kept rows' bookkeeping, then the server state at their last round
            for line in kept:
                row = json.loads(line)
                diverged = diverged or account(row)
            args = ((records, [json.loads(line) for line in kept]) if sim.unreliable
                    else (records,))  # faults and attackers: counts the log lacks are in the rows
            start, why = load_start(out, cfg, len(records)) if ckpt is not None else (None, "")
            if start is not None:
                try:
                    sim.resume(*args, start=start)
                    resumed_from = start["round"]
                except CheckpointUnusable as e:  # raised before the runner changed anything
                    start, why = None, f"{out / CHECKPOINT} not used: {e}"
            elif why:
                why = f"{why}: not used"
            if why:
                print(f"hiso: {why}; replaying the log from round 0", file=sys.stderr)
            if start is None:
                sim.resume(*args)
            if not sim.unreliable and sim.privacy is not None:
                for line in kept:  # local DP over Flower: answers released that the log does not list
                    sim.privacy.add_unlogged(json.loads(line))
            if diverged is None:
                rows = sim.run(cfg.rounds, start=row["round"], wall=row["wall_s"])
        cost = sim.cost
        if cost is not None and kept:
            cost.resume_from(row)
        try:
            for row in rows:  # (a runner with a ClientCost puts its totals in each row)
                if row["round"] == 0:
                    _check_declared_metrics(cfg.task, row)
                mf.write(json.dumps(row) + "\n")
                mf.flush()
                if tracker is not None:
                    tracker.log(row, None if sim.state is None else sim.state.h)
                diverged = account(row)
                if ckpt is not None and diverged is None:
                    ckpt.maybe_write(sim.state, row["round"])
                if progress is not None:
                    progress(row)
                if diverged is not None:  # this round's model is finite (checked above): it is kept
                    break
        except PrivacyBudgetSpent as e:
            stopped = str(e)
            print(f"hiso: {stopped}", file=sys.stderr)
        except FloatingPointError as e:
            # a diverged run is a result (too large an lr), not a crash: keep what it logged. A
            # non-finite scalar stops the round before it is aggregated; a round that made x or H
            # non-finite is rolled back below (the full-model runner never writes such a step)
            diverged = {"round": row.get("round", 0) + 1, "error": str(e)}
        if tracker is not None:
            tracker.close(diverged is None)
    state = sim.state_dict()
    if diverged is not None:  # a state left non-finite: the last finite one, from the log where there is one
        state = driver_of(cfg.method).finite_state(sim, task, cfg, out, row.get("round", 0)) or state
    saved = checkpoint(state, info)
    save_atomic(out / "model.pt", saved)
    if ckpt is not None:  # model.pt holds the final state now
        ckpt.remove()
    summary = {
        "algorithm": portable_name(cfg.algorithm, out), "task": portable_name(cfg.task, out), "rounds": cfg.rounds,
        "rounds_done": row.get("round", 0), "diverged": diverged,
        "final": last_eval, "best": best, "final_train_loss": row.get("train_loss"),
        "communication_per_client": sim.comm.summary(),
        "wall_s_train": row.get("wall_s"), "wall_s_total": time.perf_counter() - t0,
        "s_per_round": (row.get("wall_s") or 0.0) / max(row.get("round", 0), 1), "peak_rss_mb": peak_rss_mb(),
        "parameters": sum(p.numel() for p in sim.model.parameters() if p.requires_grad),
    }
    if sim.cost is not None:
        summary["client"] = sim.cost.summary()
    if ckpt is not None:  # (model.pt: the checkpoint of a continuation to more rounds)
        summary["checkpoints"] = {**ckpt.summary(), "resumed_from": resumed_from,
                                  "model_pt": final_marker(out, cfg, state["round"], saved)}
    if sim.unreliable:
        summary["reliability"] = sim.reliability()
    if cfg.dp_clip is not None:  # the epsilon of the worst client, against a reader who knows the sample
        ledger = sim.privacy or ledger_of_run(out, cfg, row.get("round", 0))
        summary["privacy"] = ledger.summary(stopped)
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    return summary
