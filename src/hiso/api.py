"""The Python API: your model and data, federated with HiSo / DeComFL (or a baseline) in-process.

A federation is a :class:`~hiso.tasks.base.Task` (the model factory, each client's minibatches,
the loss and the evaluation) plus a :class:`~hiso.config.RunConfig` (algorithm, rounds, lr, ...)::

    import hiso

    class MyTask(hiso.Task):
        metrics = {"eval_acc": "max", "eval_loss": "min"}   # what evaluate() returns
        def build_model(self): ...                         # the same x_0 every call
        def batch(self, client, round, step, batch_size): ...
        def loss(self, model, batch): ...
        def evaluate(self, model): ...

    run = hiso.run(MyTask(num_clients=8, seed=0), "runs/mine", algorithm="hiso", rounds=50, lr=1e-3)
    run.metrics[-1], run.summary["best"]       # the rows of metrics.jsonl, summary.json
    model = run.model()                         # the final server model (model.pt)
    again = hiso.rebuild("runs/mine", task)     # x_0 + the (seed, scalar) log: bit for bit the same

:func:`run` writes the same run directory as ``hiso run`` (:func:`hiso.runners.rundir.run_to_dir`).
:func:`federation` gives the in-process runner itself, to step round by round without files.
The same task class works on the command line: ``hiso run --task mymodule:MyTask`` (or
``--task path/to/file.py:MyTask``) and ``hiso compare``, building it with ``MyTask.from_config``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .config import RunConfig, load_config
from .tasks.base import Task


def _config(task: Task, config: RunConfig | str | Path | None, options: dict[str, Any]) -> RunConfig:
    """The run's configuration for ``task`` (an instance): its clients, its seed, its class's
    metrics and default lr; ``config`` (a RunConfig or a TOML file) < ``options``."""
    from .tasks.registry import use_instance

    base: dict[str, Any] = {}
    if isinstance(config, RunConfig):
        base = config.model_dump(exclude={"lr"} if config.lr is None else set())
        config = None
    base.update({"task": use_instance(task), "clients": task.num_clients, "seed": task.seed})
    return load_config(config, **{**base, **options})


def run_config(task: Task, config: RunConfig | str | Path | None = None, **options: Any) -> RunConfig:
    """The validated :class:`RunConfig` a run of ``task`` with these options gets (``options``
    are RunConfig fields: ``algorithm="decomfl"``, ``rounds=50``, ``lr=1e-3``, ...)."""
    return _config(task, config, options)


def federation(task: Task, config: RunConfig | str | Path | None = None, **options: Any):
    """The in-process runner of ``task`` (no files): ``runner.run(rounds)`` yields one metrics row
    per round (row 0: the initial evaluation); ``runner.model`` is the server's model,
    ``runner.comm`` the bytes per client, ``runner.state_dict()`` the final state."""
    from .runners.rundir import build_simulation

    cfg = _config(task, config, options)
    return build_simulation(cfg, task)


@dataclass(frozen=True)
class Run:
    """A run directory (``hiso run`` / :func:`run`): its configuration, metrics and model."""

    dir: Path

    @property
    def config(self) -> dict:
        return json.loads((self.dir / "config.json").read_text())

    @property
    def summary(self) -> dict:
        """``summary.json``: final and best metrics, rounds done, divergence, bytes, time, memory."""
        return json.loads((self.dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        """The rows of ``metrics.jsonl`` (row 0: before training; ``eval_*`` on evaluated rounds)."""
        from .report.runs import read_rows
        return read_rows(self.dir)

    def checkpoint(self) -> dict:
        """``model.pt``: ``round``, ``model`` (state dict) and, for HiSo, ``h``."""
        import torch
        return torch.load(self.dir / "model.pt", weights_only=True)

    def model(self, task: Task):
        """``task``'s model with the run's final weights loaded."""
        model = task.build_model()
        state = self.checkpoint()["model"]
        model.load_state_dict(state, strict=len(state) == len(model.state_dict()))
        return model


def run(task: Task, out: str | Path, config: RunConfig | str | Path | None = None,
        progress: Callable[[dict], None] | None = None, resume: bool = False, **options: Any) -> Run:
    """Run ``task`` federated into directory ``out`` (the files of ``hiso run``); returns the :class:`Run`.

    ``options`` are :class:`RunConfig` fields (``algorithm``, ``rounds``, ``sampled``, ``lr``, ...);
    the number of clients and the seed are the task's. ``progress(row)`` is called after every
    round. ``resume=True`` continues an interrupted run in ``out`` (hiso, decomfl).
    """
    from .runners.rundir import run_to_dir

    cfg = _config(task, config, options)
    run_to_dir(cfg, out, progress, task=task, resume=resume)
    return Run(Path(out))


def rebuild(out: str | Path, task: Task | None = None):
    """The final model of the (hiso or decomfl) run in ``out``, rebuilt from x_0 and its
    ``history.bin`` alone: bit-identical to the server's. Returns the replica
    (:class:`~hiso.core.state.ModelState`: ``.model``, ``.h``, ``.round``). ``task`` builds x_0
    (default: the task named in the run's ``config.json``, built from it)."""
    from .runners.rundir import rebuild as rebuild_dir
    from .tasks.registry import use_instance

    if task is not None:  # the task the run names is this object, wherever the run was made
        use_instance(task, json.loads((Path(out) / "config.json").read_text())["task"])
    return rebuild_dir(out, task=task)[0]
