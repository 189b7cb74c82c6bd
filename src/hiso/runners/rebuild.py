"""A run's model from its log (``hiso rebuild``, ``hiso export --round R``, ``hiso eval``): x_0
from the run's configuration, then the logged rounds replayed by the one fold every replica
uses (:meth:`hiso.core.state.ModelState.replay`), bit for bit on any device."""

from __future__ import annotations

from pathlib import Path

from ..core.state import ModelState
from ..tasks.base import Task
from ..tasks.device import on_device
from ..tasks.registry import build_task
from .drivers import driver_of
from .portable import require_inputs
from .runfiles import check_run_task, checkpoint, read_pool_run_log, read_run_history, saved_config


def start_replica(run_dir: str | Path, task: Task | None = None, device: str = "cpu", checked: bool = False):
    """A replica of the run in ``run_dir`` at x_0 on ``device``, and what replaying it needs:
    ``(state, task, cfg, info, records)``. x_0 comes from the run's configuration (or from
    ``task``, the run's task object); a history that is not the run's, or a base model whose
    weights differ from the run's (fingerprint in ``config.json``), is refused here, and a task that
    describes itself otherwise than the run's is warned of (``checked``: the caller did both)."""
    run_dir = Path(run_dir)
    cfg, info = saved_config(run_dir)
    model_from = driver_of(cfg.method).model_from
    if model_from == "pool-log":
        raise ValueError(f"{run_dir} is a {cfg.algorithm} run: its log is read by `hiso rebuild`, `eval` and `export` (its model.pt holds "
                         f"the final model)")
    if model_from != "log":
        raise ValueError(f"{run_dir} is a {cfg.algorithm} run: full-model algorithms keep no seed/scalar log to rebuild from")
    records = read_run_history(run_dir, cfg).records
    task = _run_task_on(run_dir, cfg, info, task, device, checked)
    return ModelState(task.build_model(), cfg.zo(), run_seed=cfg.seed), task, cfg, info, records


def _run_task_on(run_dir, cfg, info: dict, task: Task | None, device: str, checked: bool = False) -> Task:
    """The run's task on ``device``: the object given, else built from its configuration; checked
    against the run (:func:`~hiso.runners.runfiles.check_run_task`) unless the caller did."""
    given = task is not None
    if not given:
        require_inputs(cfg, run_dir)  # data and base model where config.json (or the user) says
    task = on_device(task, device) if given else build_task(cfg.model_copy(update={"device": device}))
    if not checked:
        check_run_task(task, info, run_dir, given)
    return task


def logged_rounds(records: list, round: int | None, run_dir: str | Path) -> list:
    """The first ``round`` records of a run's log (all of them for None): what x_round replays;
    a round the log does not reach is refused."""
    if round is None:
        return records
    if isinstance(round, bool) or not isinstance(round, int) or not 0 <= round <= len(records):
        raise ValueError(f"round {round} is not in {run_dir}: its log holds rounds 0..{len(records)}")
    return records[:round]


def rebuild(run_dir: str | Path, task: Task | None = None, device: str = "cpu",
            round: int | None = None) -> tuple[ModelState, dict]:
    """x_0 (see :func:`start_replica`), then the logged rounds replayed on ``device`` (whatever
    device the run used): every one (the final model) or the first ``round`` (x_round, the model a
    run stopped at that round saves). Returns the replica and its ``model.pt`` checkpoint."""
    cfg, info = saved_config(run_dir)
    if driver_of(cfg.method).model_from == "pool-log":  # fold the log, then one materialisation (at most K draws)
        rep = rebuild_pool(run_dir, cfg, _run_task_on(run_dir, cfg, info, task, device), round)
        return rep.state, checkpoint(rep.state_dict(), info)  # the pool state too, as the run's model.pt
    state, _, _, info, records = start_replica(run_dir, task, device)
    state.replay(logged_rounds(records, round, run_dir))
    return state, checkpoint(state.state_dict(), info)


def rebuild_pool(run_dir, cfg, task: Task, round: int | None = None):
    """A FedKSeed run's replica: x_0, then its logged rounds (the first ``round``) folded and
    materialised once (at most K draws)."""
    from ..methods.fedkseed_rounds import pool_replica
    records = logged_rounds(read_pool_run_log(run_dir, cfg), round, run_dir)
    rep = pool_replica(cfg, task.build_model)
    rep.catch_up(records)
    return rep
