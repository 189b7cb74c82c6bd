"""Task names -> tasks: every task registers itself, in its own file, with what the rest needs.

A built-in task is one file in ``hiso/tasks/`` that calls :func:`register_task` (its name, how to
build it from a :class:`~hiso.config.RunConfig`, its metrics with their direction, its default
lrs and partition). Configuration (``--task`` choices, default lr), ``hiso compare`` (metric and
its direction) and the runners read this registry; nothing else names tasks.

A user's task needs no registration: ``--task module:Class`` (an importable module) or
``--task path/to/file.py:Class`` names a :class:`~hiso.tasks.base.Task` subclass, whose class
attributes ``metrics`` and ``default_lr`` play the same roles and whose ``from_config(cfg)``
builds it (default: ``Class(cfg.clients, seed=cfg.seed)``).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .options import option_fields as task_option_fields

if TYPE_CHECKING:
    from .base import Task

# a run's configuration, a hiso.config.RunConfig: named, not imported (hiso.config imports this module)
_RunConfig = Any

DIRECTIONS = ("max", "min")


@dataclass(frozen=True)
class TaskInfo:
    """What hiso knows about a task before building it."""

    name: str
    build: Callable[[_RunConfig], "Task"]
    # evaluation metrics the task reports, each "max" (higher is better) or "min"; the first is
    # the default metric of ``hiso compare``
    metrics: dict[str, str]
    # the client lr a run gets without --lr: key an algorithm ("decomfl"), a family ("zo":
    # hiso, decomfl, fedzo; "first-order": the FedAvg family), or either + "+lora" for LoRA runs
    default_lr: dict[str, float] = field(default_factory=dict)
    default_partition: str | None = None
    doc: str = ""
    # whether the task honours ``val_fraction`` (then evaluate() also reports val_* metrics on a
    # held-out validation split, what ``hiso compare`` selects lr and round on)
    validation: bool = False
    # which of the task-specific options (TASK_OPTIONS) the task reads; None: any (a user's task).
    # A run that sets one the task does not read is refused rather than recorded as if it applied.
    options: frozenset[str] | None = None

    @property
    def metric(self) -> str:
        """The default metric of a comparison."""
        return next(iter(self.metrics))


_REGISTRY: dict[str, TaskInfo] = {}
_BUILTINS_LOADED = False
_SPEC_CACHE: dict[str, TaskInfo] = {}


def _check_metrics(where: str, metrics: Any) -> dict[str, str]:
    if not isinstance(metrics, dict) or not metrics:
        raise ValueError(f"{where}: metrics must be a non-empty dict of metric name -> 'max' or 'min'")
    for k, v in metrics.items():
        if v not in DIRECTIONS:
            raise ValueError(f"{where}: metric {k!r} has direction {v!r}, expected 'max' or 'min'")
    return dict(metrics)


# the options that belong to some task rather than to the federation or the algorithm: the fields
# of hiso.tasks.options' groups (quadratic, data, language model, your own files' columns)
TASK_OPTIONS = frozenset(task_option_fields())


def register_task(name: str, *, metrics: dict[str, str], default_lr: dict[str, float] | None = None,
                  default_partition: str | None = None, validation: bool = False, doc: str = "",
                  options: set[str] | frozenset[str] | type | None = None):
    """Decorator registering ``build(cfg) -> Task`` under ``name`` (see :class:`TaskInfo`);
    ``options``: the names in :data:`TASK_OPTIONS` the task reads, or its options class
    (:mod:`hiso.tasks.options`: its fields; None: all of them)."""
    if isinstance(options, type):
        options = set(options.model_fields)
    if options is not None and not set(options) <= TASK_OPTIONS:
        raise ValueError(f"task {name}: {sorted(set(options) - TASK_OPTIONS)} are not task options")

    def deco(build: Callable[[_RunConfig], "Task"]):
        if name in _REGISTRY and _REGISTRY[name].build is not build:
            raise ValueError(f"task {name!r} is registered twice")
        _REGISTRY[name] = TaskInfo(name, build, _check_metrics(f"task {name}", metrics), dict(default_lr or {}),
                                   default_partition, doc, validation,
                                   None if options is None else frozenset(options))
        return build
    return deco


def tasks_reading(option: str) -> list[str]:
    """The built-in tasks that read ``option`` (for a refusal that says where it belongs)."""
    _load_builtins()
    return [n for n, info in _REGISTRY.items() if info.options is None or option in info.options]


def _module_order() -> list[str]:
    """The built-in task modules in the order --help lists their tasks: these first, others by name."""
    first = ("quadratic", "vision", "language")
    return sorted((m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])),
                  key=lambda n: (first.index(n) if n in first else len(first), n))


def _load_builtins() -> None:
    """Import every module of ``hiso.tasks`` once: each built-in task registers itself there."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    for mod in _module_order():
        importlib.import_module(f"{__package__}.{mod}")


def builtin_names() -> tuple[str, ...]:
    """The registered tasks' names, by module (:func:`_module_order`), then in registration order:
    the same whichever task module a process happened to import first."""
    _load_builtins()
    order = {m: i for i, m in enumerate(_module_order())}
    where = {n: order.get(info.build.__module__.rpartition(".")[2], len(order)) for n, info in _REGISTRY.items()}
    return tuple(sorted(_REGISTRY, key=where.__getitem__))


def is_user_task(name: str) -> bool:
    """Whether ``name`` names a user's task (``module:Class`` or ``file.py:Class``)."""
    return ":" in name


def absolute_task_name(name: str) -> str:
    """``path/to/file.py:Class`` with the file's absolute path (other names as they are): what a
    run records, so its directory is read the same from anywhere (``hiso rebuild``, Flower's apps)."""
    where, sep, attr = name.rpartition(":")
    if not sep or not where.endswith(".py") or Path(where).is_absolute():
        return name
    return f"{Path(where).expanduser().resolve()}:{attr}"


def _import_user_object(spec: str) -> Any:
    from ..plugins import import_object
    return import_object(spec, "task")


def _user_task_info(spec: str) -> TaskInfo:
    from .base import Task

    obj = _import_user_object(spec)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise ValueError(f"task {spec!r}: {obj!r} is not a subclass of hiso.Task")
    lr = getattr(obj, "default_lr", None) or {}
    if not isinstance(lr, dict):
        raise ValueError(f"task {spec!r}: default_lr must be a dict (algorithm or family -> lr)")
    options = frozenset(getattr(obj, "options", frozenset()) or ())
    if bad := sorted(options - TASK_OPTIONS):
        raise ValueError(f"task {spec!r}: options {bad} are not task options (choose from {', '.join(sorted(TASK_OPTIONS))})")
    return TaskInfo(spec, obj.from_config, _check_metrics(f"task {spec}", obj.metrics), dict(lr),
                    getattr(obj, "default_partition", None), (obj.__doc__ or "").strip().split("\n")[0],
                    bool(getattr(obj, "validation", False)), options)


def task_info(name: str) -> TaskInfo:
    """The registered task ``name``, or the user's task it names (``module:Class``, ``file.py:Class``)."""
    if name in _SPEC_CACHE:
        return _SPEC_CACHE[name]
    if is_user_task(name):
        if name not in _SPEC_CACHE:
            _SPEC_CACHE[name] = _user_task_info(name)
        return _SPEC_CACHE[name]
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(_REGISTRY)}, or module:Class / "
                         "path/to/file.py:Class for your own)")
    return _REGISTRY[name]


def use_instance(task: "Task", name: str | None = None) -> str:
    """Make a task object known under a name (default: ``path/to/script.py:Class`` for a class
    of the running script, else ``module:Class``) with its metrics and default lr; returns the
    name, which a run records as its ``task``. Building that name in this process gives this
    object; elsewhere the name is imported as a user's task (``from_config``)."""
    cls = type(task)
    if name is None:
        where = cls.__module__
        main = sys.modules.get("__main__")
        if where == "__main__" and getattr(main, "__file__", None):
            where = str(Path(main.__file__).resolve())
        name = f"{where}:{cls.__qualname__}"
    lr = dict(getattr(task, "default_lr", None) or {})
    _load_builtins()
    builtin = _REGISTRY.get(getattr(task, "name", None))  # a built-in task's object: its registered defaults
    if builtin is not None and cls.__module__.startswith(__package__):
        lr = lr or builtin.default_lr
    _SPEC_CACHE[name] = TaskInfo(name, lambda cfg: task, _check_metrics(f"task {name}", task.metrics), lr,
                                 getattr(task, "default_partition", None), (cls.__doc__ or "").strip().split("\n")[0],
                                 bool(getattr(task, "validation", False)))
    return name


def build_task(cfg: _RunConfig) -> "Task":
    """The task ``cfg.task`` built from the run's configuration, its models on ``cfg.device``.
    A user's class that cannot be built from a configuration (its constructor wants more than
    ``from_config`` gives, e.g. a built-in task class used from Python) is one ValueError."""
    from .device import on_device
    try:
        task = task_info(cfg.task).build(cfg)
    except TypeError as e:
        if not is_user_task(cfg.task):
            raise
        raise ValueError(f"task {cfg.task} cannot be built from a run configuration ({e}): give the class a "
                         "from_config(cfg), or work with its object from Python (hiso.rebuild(DIR, task), "
                         "hiso.Run(DIR).model(task))") from None
    return on_device(task, cfg.device)


def algorithm_family(algorithm: str) -> str:
    """ "zo" or "first-order": the family a task's ``default_lr`` keys the method by (its registry entry)."""
    from ..methods.registry import method_info
    return method_info(algorithm).gradient


def default_lr(task: str, algorithm: str, lora: bool = False, model: str | None = None) -> float:
    """The lr a run of ``algorithm`` on ``task`` gets when none is given: the task's
    ``default_lr`` for the algorithm, else for its family (with ``+lora`` for LoRA runs); a key
    ending ``@model`` (``"zo+lora@gemma3-270m"``) is that model's and comes first."""
    table = task_info(task).default_lr
    suffix = "+lora" if lora else ""
    keys = (algorithm + suffix, algorithm_family(algorithm) + suffix)
    for key in (*(f"{k}@{model}" for k in keys if model), *keys):
        if key in table:
            return table[key]
    what = f"{task} with LoRA" if lora else task
    raise ValueError(f"no default lr for {algorithm} on task {what}: give one (--lr, or lr = ... in the config file)")


def run_default_lr(cfg: _RunConfig) -> float | None:
    """The lr ``cfg``'s task and algorithm give a run without --lr (None: none), for messages."""
    try:
        info = task_info(cfg.task)
        opts = cfg.task_options
        model = opts.model if info.options is None or "model" in info.options else None
        return default_lr(cfg.task, cfg.algorithm, opts.lora_r is not None, model)
    except (ValueError, ImportError):
        return None


def default_lr_line(task: str) -> str:
    """The default lr of every built-in method on ``task`` in one line, methods of the same
    defaults together (``hiso, fedzo 0.002; decomfl 0.0015; ...``); a table with LoRA or
    per-model keys adds those in brackets (``5e-06 (LoRA 0.01, LoRA on gemma3-270m 0.001)``)."""
    from ..methods.registry import method_names
    table = task_info(task).default_lr
    variants: list[tuple[str, bool, str | None]] = [("", False, None)]
    if any("+lora" in k for k in table):
        variants.append(("LoRA ", True, None))
    variants += [(f"LoRA on {m} ", True, m) for m in sorted({k.split("@", 1)[1] for k in table if "@" in k})]

    def lr(name: str, lora: bool, model: str | None) -> float | None:
        try:
            return default_lr(task, name, lora, model)
        except ValueError:
            return None
    groups: dict[tuple, list[str]] = {}
    for name in method_names():
        groups.setdefault(tuple(lr(name, lora, model) for _, lora, model in variants), []).append(name)
    parts = []
    for lrs, names in groups.items():
        who = "every method" if len(groups) == 1 else ", ".join(names)
        shown = [f"{label}{x:g}" for (label, _, _), x in zip(variants, lrs) if x is not None]
        parts.append(f"{who} {shown[0]}" + (f" ({', '.join(shown[1:])})" if shown[1:] else "") if shown
                     else f"{who}: give --lr")
    return "; ".join(parts)


def higher_is_better(metric: str, task: str | None = None) -> bool:
    """Whether ``metric`` is maximised: as ``task`` declares it if it does, else by name (names
    ending in ``acc``, ``_em``, ``_f1`` are maximised; losses, gaps and the rest minimised). The
    one rule for best values, selection and tables."""
    if task is not None:
        try:
            metrics = task_info(task).metrics
        except (ValueError, ImportError):
            metrics = {}
        for name in (metric, "eval_" + metric.removeprefix("val_"), metric.removeprefix("val_")):
            if name in metrics:  # val_acc is maximised if eval_acc is
                return metrics[name] == "max"
    return metric.endswith(("acc", "_em", "_f1"))
