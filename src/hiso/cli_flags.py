"""The command line's flags made from the run options: one per field, its choices, help line and
default as ``--help`` shows them, and the flag groups several commands share."""

from __future__ import annotations

import argparse

from .config import ALGORITHMS, ConfigError, option_fields, read_toml, task_names

# RunConfig fields whose values are checked by name (not a Literal): their choices for --help
CHOICES = {"task": lambda: (*task_names(), "module:Class", "file.py:Class"),
           "algorithm": lambda: (*ALGORITHMS, "module:Class", "file.py:Class")}


def field_choices(name: str) -> tuple[str, ...] | None:
    """The values a RunConfig field takes, for --help: its Literal's, or the tasks / ALGORITHMS."""
    from typing import Literal, get_args, get_origin

    if name in CHOICES:
        return CHOICES[name]()
    ann = option_fields()[name].annotation
    for a in (ann, *get_args(ann)):  # Literal[...] or Literal[...] | None
        if get_origin(a) is Literal:
            return tuple(str(v) for v in get_args(a))
    return None


def field_help(name: str) -> str:
    """A field's one line of --help: its meaning (``Field(description=...)``) and its default.

    A description that says its own default (``default: ...``, e.g. lr's per-task default) is
    shown as is; otherwise the field's default value is appended.
    """
    field = option_fields()[name]
    text = (field.description or "").replace("%", "%%")  # argparse formats help with %
    if "default:" not in text:
        text += f" (default: {shown_default(field.get_default(call_default_factory=True))})"
    return text


def shown_default(value) -> str:
    """A default as --help says it: off for False, none for None."""
    return "off" if value is False else "none" if value is None else str(value)


def lr_defaults(task: str | None = None) -> list[tuple[str, str]]:
    """(tasks, every built-in method's default lr on them) for ``task`` (None: each built-in
    task, tasks of the same defaults together): what --lr's help and docs/cli.md list."""
    from .tasks.registry import default_lr_line
    lines: dict[str, list[str]] = {}
    for name in [task] if task else task_names():
        lines.setdefault(default_lr_line(name), []).append(name)
    return [(", ".join(names), line) for line, names in lines.items()]


def lr_help(task: str | None = None) -> str:
    """--lr's help: its meaning, then the defaults of :func:`lr_defaults` (a task that cannot be
    read, e.g. a user's that does not import, shows every built-in task's)."""
    try:
        lines = lr_defaults(task)
    except (ValueError, ImportError):
        lines = lr_defaults()
    return (field_help("lr") + "\ndefaults, from the project's lr grids (docs/results):\n"
            + "\n".join(f"{tasks}: {line}" for tasks, line in lines))


def _help_task(argv: list[str]) -> str | None:
    """The task of ``hiso run --task X --help`` (or of its --config file), whose defaults --lr's
    help then lists alone; None without --help or a task."""
    if not {"-h", "--help"} & set(argv):
        return None
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--task")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.task is None and known.config:
        try:
            known.task = read_toml(known.config).get("task")
        except ConfigError:
            return None
    return known.task if isinstance(known.task, str) else None


def _add_run_flags(p: argparse.ArgumentParser, exclude: tuple[str, ...] = (), lr_task: str | None = None) -> None:
    """One flag per option (:func:`hiso.config.option_fields`: RunConfig's fields and HiSo's); every
    default is None so the config file can show through.

    Choices are shown, not enforced here: RunConfig validates them (also for the TOML file)."""
    group = p.add_argument_group("run options (each is also a TOML key: --local-steps 2 is local_steps = 2)")
    for name, field in option_fields().items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        if name == "method_opts":  # KEY=VALUE, repeatable: RunConfig types them by the method's fields
            group.add_argument("--method-opt", dest=name, action="append", default=None, metavar="KEY=VALUE",
                               help=field_help(name).replace(" (default: {})", " (default: none)"))
            continue
        if ann is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=field_help(name))
            continue
        typ = {int: int, float: float}.get(ann, None)
        if typ is None and ann in (float | None, int | None):
            typ = float if ann == (float | None) else int
        choices = field_choices(name)
        group.add_argument(flag, dest=name, type=typ or str, default=None,
                           help=lr_help(lr_task) if name == "lr" else field_help(name),
                           metavar="{" + ",".join(choices) + "}" if choices else None)


def _add_tracking_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensorboard", metavar="DIR", help="also log each round to TensorBoard event files under "
                   "DIR/<run name> (pip install -e '.[track]' in hiso's clone)")
    p.add_argument("--mlflow", metavar="URI", help="also log each round to MLflow: a tracking URI, or a directory "
                   "for a local file store (pip install -e '.[track]' in hiso's clone)")


def _add_where_flags(p: argparse.ArgumentParser, data: bool = True) -> None:
    """Where a moved run's inputs are now (config.json names them relative to the run directory)."""
    g = p.add_argument_group("a run moved away from its inputs (each is checked against what config.json records)")
    if data:
        g.add_argument("--data-dir", help="the run's data directory is here now")
    g.add_argument("--model", help="the run's base model directory is here now (its weights' fingerprint is checked)")
    g.add_argument("--method-file", metavar="FILE", help="the run's method file (your own Method subclass) is here "
                   "now (its sha256 is checked)")


def _add_accept_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-method-change", action="store_true", help="read a run whose method file (your own "
                   "Method subclass) changed since it was made; a resumed run records the change in config.json")
