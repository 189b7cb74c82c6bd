"""A run's model at any round, as a usable ``nn.Module``: what ``hiso export`` and ``hiso eval`` read.

Scalar-only runs (hiso, decomfl): round R is x_0 plus the first R logged records replayed, the
path ``hiso rebuild --round R`` takes (:func:`hiso.runners.rebuild.start_replica`); the final round
is read from ``model.pt`` instead, which that replay equals bit for bit, because replaying a long
full-parameter run costs minutes. Full-model baselines keep no log: only their final model
(``model.pt``) exists. A language run's base model must be the one it started from (fingerprint
in ``config.json``), or nothing is loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pydantic import ValidationError

from ..compat import FLAT_DEFAULTS, HASH_LATER_FIELDS, HASH_ONLY_WHERE, TASK_FLAT_OPTIONS, flat_options
from ..config import ConfigError, RunConfig, one_line
from ..tasks.base import Task
from ..tasks.device import on_device
from ..tasks.registry import build_task
from .rebuild import logged_rounds, rebuild_pool, start_replica
from .portable import base_name, identity_values, require_inputs
from .runfiles import check_run_task, saved_config
from .drivers import driver_of


@dataclass
class RunModel:
    """x_R of a run, in its task's model (a ``PeftModel`` for LoRA runs)."""

    model: nn.Module
    task: Task
    cfg: RunConfig
    info: dict  # config.json's task_info
    round: int
    run_dir: Path

    def identity(self) -> dict[str, Any]:
        """What names this model: the run (directory, configuration hash, round) and its base."""
        run = self.run_dir.absolute()  # the run by its directory's name: no path of this machine
        out = {"run": run.name, "algorithm": identity_values({"algorithm": self.cfg.algorithm})["algorithm"],
               "task": identity_values({"task": self.cfg.task})["task"],
               "seed": self.cfg.seed, "round": self.round, "config_sha256": config_sha256(self.cfg)}
        if "base_fingerprint" in self.info:
            out["base_model"] = base_name(self.info["model"])
            if self.info.get("hub_id"):
                out["base_model_hub_id"] = self.info["hub_id"]
            out["base_fingerprint"] = self.info["base_fingerprint"]
        return out




def config_sha256(cfg: RunConfig) -> str:
    """sha256 of the resolved run configuration (keys sorted): two runs with equal hashes ran the
    same experiment. A field added later (:data:`hiso.compat.HASH_LATER_FIELDS`) counts only when set,
    one in :data:`hiso.compat.HASH_ONLY_WHERE` only where it changes what the run computes; a
    method's options that were flat fields before (:data:`hiso.compat.FLAT_OPTIONS`) count flat,
    and where its inputs are is left out."""
    values = identity_values(flat_options(cfg.model_dump()))
    for name in HASH_LATER_FIELDS:
        default = FLAT_DEFAULTS[name] if name in FLAT_DEFAULTS else TASK_FLAT_OPTIONS[name] \
            if name in TASK_FLAT_OPTIONS else type(cfg).model_fields[name].get_default(call_default_factory=True)
        if values.get(name) == default:
            values.pop(name)
    for name, counts in HASH_ONLY_WHERE.items():
        if not counts(values):
            values.pop(name, None)
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def run_task(run_dir: str | Path, device: str = "cpu", **overrides: Any) -> tuple[Task, RunConfig, dict]:
    """The run's task (optionally with RunConfig ``overrides``, e.g. another ``data_dir``), its
    configuration and task_info; refused if the base model here is not the run's."""
    run_dir = Path(run_dir)
    cfg, info = saved_config(run_dir)
    given = {k: v for k, v in overrides.items() if v is not None}
    try:  # an option the run's task does not read (--data-dir on the quadratic): one line
        run_cfg = RunConfig(**{**cfg.model_dump(), **given, "device": device})
    except ValidationError as e:
        raise ConfigError(one_line(e)) from None
    require_inputs(run_cfg, run_dir, given)
    task = build_task(run_cfg)
    if given:  # another split or size asks for another description: only the base model must be the run's
        check_run_task(task, {k: v for k, v in info.items() if k in ("model", "base_fingerprint")}, run_dir)
    else:
        check_run_task(task, info, run_dir)
    return task, cfg, info


def load_run_model(run_dir: str | Path, round: int | None = None, task: Task | None = None,
                   device: str = "cpu", checked: bool = False) -> RunModel:
    """x_``round`` of the run in ``run_dir`` (None: its last round) on ``device``.

    ``task``: the run's task object (default: built from ``config.json``; ``checked``: the caller
    built it with :func:`run_task`, which checked it against the run). Refused (ValueError,
    nothing loaded): a round the log does not hold, another round than the last of a full-model
    run, a base model that is not the run's.
    """
    run_dir = Path(run_dir)
    cfg, info = saved_config(run_dir)
    if task is None:
        task, _, _ = run_task(run_dir, device)
    else:
        task = on_device(task, device)
        if not checked:
            check_run_task(task, info, run_dir, given=True)
    return _MODEL_FROM[driver_of(cfg.method).model_from](run_dir, cfg, info, task, device, round)


def pool_run_model(run_dir: Path, cfg: RunConfig, info: dict, task: Task, device: str, round: int | None) -> RunModel:
    """A FedKSeed run's x_round: its log folded, then materialised once (at most K draws)."""
    rep = rebuild_pool(run_dir, cfg, task, round)
    return RunModel(rep.state.model, task, cfg, info, rep.state.round, run_dir)


def saved_run_model(run_dir: Path, cfg: RunConfig, info: dict, task: Task, device: str,
                    round: int | None) -> RunModel:
    """A full-model run's model: its model.pt (no log: only its last round exists)."""
    ckpt_path = run_dir / "model.pt"
    if not ckpt_path.is_file():
        raise ValueError(f"{run_dir} has no model.pt: an unfinished {cfg.algorithm} run (full-model algorithms "
                         f"keep no log to rebuild a model from)")
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    if round is not None and round != ckpt["round"]:
        raise ValueError(f"{run_dir} is a {cfg.algorithm} run: full-model algorithms keep no log, so only its "
                         f"last round ({ckpt['round']}) exists")
    model = task.build_model()
    model.load_state_dict(ckpt["model"])
    return RunModel(model, task, cfg, info, int(ckpt["round"]), run_dir)


def replayed_run_model(run_dir: Path, cfg: RunConfig, info: dict, task: Task, device: str,
                       round: int | None) -> RunModel:
    """A scalar run's x_round: model.pt where it is that round, else x_0 (or a checkpoint) and the log replayed."""
    ckpt_path = run_dir / "model.pt"
    state, task, cfg, info, records = start_replica(run_dir, task, device, checked=True)
    upto = logged_rounds(records, round, run_dir)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True) if ckpt_path.is_file() else None
    if ckpt is not None and ckpt["round"] == len(upto):
        state.load_state_dict(ckpt)  # what the run saved at this round: the replay's result, bit for bit
    else:  # ModelState.replay, round by round with a progress bar (on a terminal): minutes for a long full run
        from tqdm import tqdm

        from .checkpoint import load_start
        start, _ = load_start(run_dir, cfg, len(upto))  # an unfinished run's checkpoint at or before the round
        if start is not None:
            state.load_state_dict(start)
            upto = upto[state.round:]
        state.replay(tqdm(upto, desc=f"replaying {len(upto)} rounds", unit="round", leave=False, disable=None))
    return RunModel(state.model, task, cfg, info, state.round, run_dir)


# where a run's model comes from, by what its driver keeps (hiso.runners.drivers.Driver.model_from)
_MODEL_FROM = {"log": replayed_run_model, "pool-log": pool_run_model, "model.pt": saved_run_model}
