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

    task = MyTask(num_clients=8, seed=0)
    run = hiso.run(task, "runs/mine", algorithm="hiso", rounds=50, lr=1e-3)
    run.metrics[-1], run.summary["best"]       # the rows of metrics.jsonl, summary.json
    model = run.model(task)                     # the final server model (model.pt)
    again = hiso.rebuild("runs/mine", task)     # x_0 + the (seed, scalar) log: bit for bit the same
    hiso.run("mnist", "runs/m1", rounds=20)     # a built-in task by name, built from the options

A task object is built already: its clients, seed and data are its own, so options that would
change them (``seed=``, ``clients=``, ``data_dir=``, ``lora_r=``, ...) are refused rather than
recorded in ``config.json`` without effect. As with ``hiso run``, a directory that holds a run is
refused unless ``resume=True`` (continue it, with the options it was made with) or ``force=True``.

:func:`run` writes the same run directory as ``hiso run`` (:func:`hiso.runners.rundir.run_to_dir`).
:func:`federation` gives the in-process runner itself, to step round by round without files.
:func:`evaluate`, :func:`export` and :func:`compare` are ``hiso eval``, ``hiso export`` and
``hiso compare`` (a comparison takes a task's name: each seed builds its own task).
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


def _config(task: Task | str, config: RunConfig | str | Path | None, options: dict[str, Any]) -> RunConfig:
    """The run's configuration for ``task``: a task object (its clients, its seed, its class's
    metrics and default lr) or a task's name (built from the configuration); ``config`` (a
    RunConfig or a TOML file) < ``options``."""
    from .config import read_toml
    from .config_parse import merge_options
    from .methods.options import method_spec
    from .methods.registry import builtin_name
    from .tasks.options import option_fields as task_option_fields
    from .tasks.registry import TASK_OPTIONS, use_instance

    if "algorithm" in options and not isinstance(options["algorithm"], str):  # a Method class or instance
        spec, opts = method_spec(options["algorithm"])
        method = options["algorithm"]  # a built-in method's class (hiso.methods.HiSo) runs under its name (hiso)
        spec = builtin_name(method if isinstance(method, type) else type(method)) or spec
        options = {**options, "algorithm": spec, "method_opts": {**opts, **(options.get("method_opts") or {})}}

    if isinstance(config, RunConfig):
        given = {k: getattr(config, k) for k in config.model_fields_set}
        base = config.model_dump(exclude={"lr"} if config._lr_defaulted else set())
    else:  # a TOML file, read once: its values are what load_config would read from it
        base = read_toml(config)
        if isinstance(base.get("compare"), dict):  # hiso compare's table, as load_config leaves it
            base.pop("compare")
        given = dict(base)
    given.update(options)
    base = merge_options(base, options)  # options over the base, a method's flag (nu) over its method_opts
    if isinstance(task, str):
        return load_config(None, **{**base, "task": task})
    if isinstance(task, type):
        raise TypeError(f"task: give an instance of {task.__name__}, e.g. {task.__name__}(num_clients=8, seed=0), "
                        "or a built-in task's name")
    if not isinstance(task, Task):
        raise TypeError(f"task: a hiso.Task instance or a task's name, not {type(task).__name__}")
    for name, own in (("seed", task.seed), ("clients", task.num_clients)):
        if name in given and given[name] != own:
            raise ValueError(f"{name}={given[name]!r}: the task object was built with {name} {own} (its data and "
                             f"x_0 come from it): build it with that {name} instead")
    fields = {**RunConfig.model_fields, **task_option_fields()}
    built = sorted(k for k in TASK_OPTIONS & given.keys() if given[k] != fields[k].default)
    if built:
        raise ValueError(f"{built[0]}={given[built[0]]!r}: a task object is built already and does not read "
                         "task options; give it to the task's constructor")
    own = {"task": use_instance(task), "clients": task.num_clients, "seed": task.seed}
    return load_config(None, **{**base, **own})


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

    def __post_init__(self):
        object.__setattr__(self, "dir", Path(self.dir))  # Run("runs/x") as well as Run(Path(...))

    @property
    def config(self) -> dict:
        """config.json's object, its paths (stored relative to the run directory) as on this machine."""
        from .runners.portable import absolute
        return absolute(json.loads((self.dir / "config.json").read_text()), self.dir)

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


def run(task: Task | str, out: str | Path, config: RunConfig | str | Path | None = None,
        progress: Callable[[dict], None] | None = None, resume: bool = False, force: bool = False,
        tensorboard: str | Path | None = None, mlflow: str | None = None, **options: Any) -> Run:
    """Run ``task`` federated into directory ``out`` (the files of ``hiso run``); returns the :class:`Run`.

    ``task``: a task object, or a built-in task's name (``"mnist"``, with its options here).
    ``options`` are :class:`RunConfig` fields (``algorithm``, ``rounds``, ``sampled``, ``lr``, ...);
    a task object's clients and seed are its own. ``progress(row)`` is called after every
    round. A directory holding a run is refused, unless ``resume=True`` (continue that run,
    with the same options or more rounds; an empty directory starts; hiso, decomfl and the
    other seed-based methods) or ``force=True`` (replace it; a user's other files stay).
    ``tensorboard`` (a log directory) and ``mlflow`` (a tracking URI or directory) also log each
    round there, as ``hiso run --tensorboard/--mlflow`` (``pip install -e '.[track]' in hiso's clone``).
    """
    from .runners.rundir import clear_run, not_a_dir, run_to_dir, same_run

    cfg = _config(task, config, options)
    out = Path(out)
    if why := not_a_dir(out):
        raise ValueError(why)
    if resume and force:
        raise ValueError("resume continues a run and force replaces it: choose one")
    if resume:
        verdict, why = same_run(cfg, out)
        if verdict == "other":
            raise ValueError(f"{out} holds another run ({why}): resume=True continues a run with the options it "
                             "was made with (more rounds allowed)")
        resume = verdict == "same"
    elif (out / "config.json").exists():
        if not force:
            raise FileExistsError(f"{out} already holds a run: resume=True continues it, force=True replaces it")
        clear_run(out)
    tracking = None
    if tensorboard is not None or mlflow is not None:
        from .report.tracking import Tracking
        tracking = Tracking(None if tensorboard is None else str(tensorboard), mlflow, name=out.resolve().name)
        tracking.check()  # a tracker that is not installed: one clear error before the run starts
    run_to_dir(cfg, out, progress, task=None if isinstance(task, str) else task, resume=resume, tracking=tracking)
    return Run(out)


def rebuild(out: str | Path, task: Task | None = None):
    """The final model of the (hiso or decomfl) run in ``out``, rebuilt from x_0 and its
    ``history.bin`` alone: bit-identical to the server's. Returns the replica
    (:class:`~hiso.core.state.ModelState`: ``.model``, ``.h``, ``.round``). ``task`` builds x_0
    (default: the task named in the run's ``config.json``, built from it)."""
    from .runners.rundir import rebuild as rebuild_dir

    _known_task(out, task)
    return rebuild_dir(out, task=task)[0]


def _known_task(out: str | Path, task: Task | None) -> None:
    """``out`` must hold a run (one line otherwise); the task it names is ``task`` if given,
    wherever the run was made, for what reads the run next."""
    from .runners.runfiles import saved_config
    from .tasks.registry import use_instance

    name = saved_config(out)[0].task
    if task is not None:
        use_instance(task, name)


def evaluate(out: str | Path, task: Task | None = None, round: int | None = None, split: str | None = None,
             data_dir: str | None = None, eval_max: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """``hiso eval``: round ``round`` (None: the last) of the run in ``out`` evaluated on its task.
    With neither ``data_dir`` nor ``eval_max`` it scores the examples the run scored and gives
    the run's own metrics at that round. ``split``: ``"test"`` (``eval_*``), ``"dev"``
    (``val_*``) or None (both). ``task``: the run's task object (default: built from the run's
    ``config.json``). Returns ``{"metrics": {...}, "round": R, ...}`` (what ``eval.json`` holds);
    nothing is written."""
    from .runners.evaluate import evaluate_run

    _known_task(out, task)
    return evaluate_run(out, round, data_dir, eval_max, split, device, task=task)


def export(out: str | Path, to: str | Path, format: str | None = None, round: int | None = None,
           task: Task | None = None, force: bool = False) -> dict[str, Any]:
    """``hiso export``: round ``round`` (None: the last) of the run in ``out`` written into the
    directory ``to`` (``format``: ``merged``, a Hugging Face model directory, the default for
    language runs; ``peft``, the LoRA adapter; ``state-dict``, safetensors, the default otherwise).
    ``force`` replaces an earlier export there, nothing else. Returns the format, round, files,
    bytes and seconds."""
    from .runners.export import export as export_run

    _known_task(out, task)
    return export_run(out, to, format, round=round, force=force, task=task)


@dataclass(frozen=True)
class Comparison:
    """A comparison's directory (``hiso compare`` / :func:`compare`): its table and selection."""

    dir: Path
    table: str  # what hiso compare prints: table.md, then the frontier (frontier.md)

    @property
    def selection(self) -> dict:
        """``selection.json``: per arm the lr grid, each seed's best, the chosen lr."""
        return json.loads((Path(self.dir) / "selection.json").read_text())

    @property
    def rows(self) -> list[dict]:
        """The rows of ``table.csv``: per arm, mean and spread of the reported metric, rounds and bytes."""
        import csv
        with open(Path(self.dir) / "table.csv", newline="") as f:
            return list(csv.DictReader(f))

    def run(self, arm: str, lr: float, seed: int) -> Run:
        """One run of the comparison."""
        from .experiments.compare_plan import run_dir
        return Run(run_dir(self.dir, arm, lr, seed))


def compare(task: str, out: str | Path, config: str | Path | None = None, algorithms: list[str] | None = None,
            seeds: list[int] | None = None, lr_grid: dict[str, list[float]] | None = None,
            reference: str | None = None, metric: str | None = None, select_on: str | None = None,
            jobs: int = 1, force: bool = False, quiet: bool = True, plots: bool = True,
            target: float | None = None, **options: Any) -> Comparison:
    """``hiso compare``: each algorithm (or variant) over its lr grid and the seeds, the lr chosen
    per arm on validation (or the reported examples), the table, plots and ``selection.json``
    in ``out``. Finished runs there are kept and reused (run it again to resume), unless
    ``force``. ``task``: a built-in task's name or ``module:Class`` / ``path/file.py:Class``
    (each seed builds its own task, so not an object); ``config``: a TOML file with a
    ``[compare]`` table; ``options``: shared :class:`RunConfig` fields (``rounds=40``, ...);
    ``target``: the frontier's second target (``--target``; :mod:`hiso.report.frontier`)."""
    from .experiments.compare import build_plan, compare as compare_runs

    if not isinstance(task, str):
        raise TypeError("task: a task's name (a built-in one, or module:Class / path/file.py:Class): each "
                        "seed of a comparison builds its own task")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if algorithms is not None:  # a Method class is named by its spec (an instance's options need a variant)
        from .methods.options import method_spec
        algorithms = [a if isinstance(a, str) else method_spec(a if isinstance(a, type) else type(a))[0]
                      for a in algorithms]
    flags = {k: v for k, v in dict(algorithms=algorithms, seeds=seeds, lr_grid=lr_grid, reference=reference,
                                    metric=metric, select_on=select_on).items() if v is not None}
    plan = build_plan(config, {**options, "task": task}, flags)
    table = compare_runs(plan, out, force=force, quiet=quiet, plots=plots, jobs=jobs, target=target)
    return Comparison(Path(out), table)
