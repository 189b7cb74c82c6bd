"""A run directory that travels: its files name their inputs without the paths of the machine
that made it.

config.json stores the run's data directory, a local base model directory and a user's method or
task file (``file.py:Class``) as paths relative to the run directory (listed under
:data:`MARK`), so a run moved together with its inputs reads them from its new place, from any
working directory. Reading a run back resolves them against the run directory, unless the user
says where they are now (:data:`RELOCATED`: ``--data-dir``, ``--method-file``, ``--model``);
what is not found is refused in one line naming the flag that points at it. A base model is
identified by its weights' fingerprint and a method file by its sha256, so pointing at another
copy is checked, not trusted.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from ..tasks.options import defaults as task_defaults

# config.json's list of the configuration fields it stores relative to the run directory
MARK = "relative_to_run"
# what the user says a moved run's inputs are now: {"data_dir", "method_file", "model"} -> path
RELOCATED: ContextVar[dict] = ContextVar("relocated", default={})  # noqa: B039 (never mutated)
# configuration fields naming where an input is, not what was computed: a run continued or read
# with them pointing elsewhere is the same run (its task and base model are checked instead)
WHERE_FIELDS = ("data_dir", "model")


def _file_spec(value) -> tuple[str, str] | None:
    """(file, Class) of ``path/to/file.py:Class``; None for anything else."""
    if not isinstance(value, str):
        return None
    where, sep, attr = value.rpartition(":")
    return (where, attr) if sep and where.endswith(".py") else None


def relative(path: str, run_dir: str | Path) -> str:
    """``path`` (absolute, or relative to the working directory) relative to ``run_dir``, with ``/``."""
    rel = os.path.relpath(Path(path).expanduser().absolute(), Path(run_dir).absolute())
    return Path(rel).as_posix()


def _local_model(value) -> bool:
    """Whether a ``model`` value is a directory here (not a hub id or a short name)."""
    from ..tasks.lm import SHORT_NAMES
    return isinstance(value, str) and value not in SHORT_NAMES and Path(value).expanduser().is_dir()


def _lifted(values: dict) -> tuple[dict, list[str]]:
    """``values`` with the :data:`WHERE_FIELDS` its ``task_opts`` holds (schema 5) at the top, as
    before, and their names (for :func:`_lowered`)."""
    opts = values.get("task_opts")
    if not isinstance(opts, dict):
        return dict(values), []
    moved = [k for k in WHERE_FIELDS if k in opts]
    return {**values, **{k: opts[k] for k in moved}, "task_opts": opts}, moved


def _lowered(values: dict, moved: list[str]) -> dict:
    """What :func:`_lifted` lifted back in ``task_opts``, in its place."""
    if not moved:
        return values
    out = {k: v for k, v in values.items() if k not in moved}
    out["task_opts"] = {k: values[k] if k in moved else v for k, v in values["task_opts"].items()}
    return out


def store(values: dict, run_dir: str | Path) -> dict:
    """config.json's object with its paths relative to ``run_dir`` (the fields in :data:`MARK`),
    and its task description and method record likewise."""
    run_dir = Path(run_dir)
    out, moved = _lifted(values)
    marked = [k for k in ("data_dir", "model", "algorithm", "task") if out.get(k) and
              (k == "data_dir" or (_local_model(out[k]) if k == "model" else _file_spec(out[k])))]
    for key in marked:
        spec = _file_spec(out[key])
        out[key] = f"{relative(spec[0], run_dir)}:{spec[1]}" if spec else relative(out[key], run_dir)
    info = dict(out.get("task_info") or {})
    for key in ("data_dir", "model", "model_source"):
        if isinstance(info.get(key), str) and (key == "data_dir" or _local_model(info[key])):
            info[key] = relative(info[key], run_dir)
    if isinstance(info.get("source"), str) and info["source"].startswith("idx:"):  # MNIST's idx files
        info["source"] = "idx:" + relative(info["source"][4:], run_dir)
    if "task_info" in out:
        out["task_info"] = info
    if isinstance(out.get("method_source"), dict) and out["method_source"].get("file"):
        out["method_source"] = {**out["method_source"], "file": relative(out["method_source"]["file"], run_dir)}
    if marked:
        out[MARK] = marked
    return _lowered(out, moved)


def portable_name(value, run_dir: str | Path):
    """What a run's file other than config.json writes for a configuration value: a user's
    ``file.py:Class`` relative to ``run_dir``, a local model directory by its name."""
    if spec := _file_spec(value):
        return f"{relative(spec[0], run_dir)}:{spec[1]}"
    return Path(value).name if _local_model(value) else value


def resolve(raw: dict, run_dir: str | Path) -> dict:
    """config.json's object (:data:`MARK` popped) with the inputs where they are on this machine:
    the paths it stores resolved against ``run_dir``, or those :data:`RELOCATED` gives. A user's
    method or task file not found is refused (ValueError, one line naming ``--method-file``);
    data and a base model are checked when a task is built (:func:`require_inputs`)."""
    run_dir = Path(run_dir)
    raw, moved = _lifted(raw)
    raw = _absolute(raw, run_dir)
    given = RELOCATED.get()
    for key in WHERE_FIELDS:
        if given.get(key):  # (a model given as a hub id or short name stays a name)
            there = Path(given[key]).expanduser()
            raw[key] = str(there.absolute()) if key == "data_dir" or there.exists() else given[key]
    if given.get("method_file") and (spec := _file_spec(raw.get("algorithm"))):
        raw["algorithm"] = f"{Path(given['method_file']).expanduser().absolute()}:{spec[1]}"
    for key in ("algorithm", "task"):
        spec = _file_spec(raw.get(key))
        if spec and not Path(spec[0]).is_file():
            flag = "--method-file" if key == "algorithm" else None
            what = "method" if key == "algorithm" else "task"
            if key == "algorithm" and given.get("method_file"):
                raise ValueError(f"--method-file {given['method_file']}: file not found")
            how = f"give {flag} FILE" if flag else "put it there, or keep it where it was beside the run"
            raise ValueError(f"{run_dir}: the run's {what} file {Path(spec[0]).name} is not at {spec[0]}: {how}")
    return _lowered(raw, moved)


def absolute(raw: dict, run_dir: str | Path) -> dict:
    """config.json's object with the paths it stores relative to ``run_dir`` made absolute
    (:data:`MARK` popped); nothing is checked."""
    raw, moved = _lifted(raw)
    return _lowered(_absolute(raw, run_dir), moved)


def _absolute(raw: dict, run_dir: str | Path) -> dict:
    raw, here = dict(raw), lambda p: os.path.normpath(Path(run_dir).absolute() / Path(p).expanduser())  # noqa: E731
    for key in raw.pop(MARK, None) or []:
        if key in ("data_dir", "model") and isinstance(raw.get(key), str):
            raw[key] = here(raw[key])
        elif spec := _file_spec(raw.get(key)):
            raw[key] = f"{here(spec[0])}:{spec[1]}"
    return raw


def paths_from_here(cfg):
    """``cfg`` with its data and local model directories absolute, for processes that run in other
    working directories (Flower's ServerApp and ClientApps), where a relative path means another place."""
    update = {}
    opts = cfg.task_options
    if opts.data_dir:
        update["data_dir"] = str(Path(opts.data_dir).expanduser().absolute())
    if _local_model(opts.model):
        update["model"] = str(Path(opts.model).expanduser().absolute())
    return cfg.model_copy(update=update) if update else cfg


def require_inputs(cfg, run_dir: str | Path, given: dict | None = None) -> None:
    """Refuse, in one line naming the flag, a run whose data directory or local base model is not
    on this machine where config.json says, or where the user (``given``, else :data:`RELOCATED`) says."""
    given = {**RELOCATED.get(), **(given or {})}
    data = getattr(cfg, "data_dir", None)
    if data and not Path(data).expanduser().exists():  # (a task of yours may read a file)
        if given.get("data_dir"):
            raise ValueError(f"--data-dir {given['data_dir']}: directory not found")
        raise ValueError(f"{run_dir}: the run's data directory {Path(data).name} is not at {data}: give --data-dir DIR")
    model = getattr(cfg, "model", None)
    if model and Path(model).is_absolute() and not Path(model).is_dir():  # a local directory (stored as a path)
        if given.get("model"):
            raise ValueError(f"--model {given['model']}: directory not found")
        raise ValueError(f"{run_dir}: the run's base model directory {Path(model).name} is not at {model}: "
                         "give --model DIR (its weights are checked against the run's)")


def comparable(values: dict, run_dir: str | Path | None = None) -> dict:
    """``values`` (config.json's object with ``run_dir``, or a configuration's dump) with its
    paths absolute and its task options flat (``task_opts``' and the others' defaults), so two
    records of one run compare equal wherever and by whichever hiso each was written."""
    out = resolve(dict(values), run_dir) if run_dir is not None else dict(values)
    out.pop(MARK, None)
    opts = out.pop("task_opts", None)  # the task's options flat, as the flags name them, defaults filled
    out = {**task_defaults(), **(opts if isinstance(opts, dict) else {}), **out}
    for key in ("data_dir",):
        if isinstance(out.get(key), str):
            out[key] = os.path.normpath(Path(out[key]).expanduser().absolute())
    if _local_model(out.get("model")):
        out["model"] = os.path.normpath(Path(out["model"]).expanduser().absolute())
    for key in ("algorithm", "task"):
        if spec := _file_spec(out.get(key)):
            out[key] = f"{os.path.normpath(Path(spec[0]).expanduser().absolute())}:{spec[1]}"
    return out


def identity_values(values: dict) -> dict:
    """A configuration's values as its hash counts them: where its inputs are left out (a data
    directory, a local model directory or a method file by its name only)."""
    out = dict(values)
    if isinstance(out.get("data_dir"), str):
        out["data_dir"] = Path(out["data_dir"]).name
    if isinstance(out.get("model"), str) and (Path(out["model"]).is_absolute() or _local_model(out["model"])):
        out["model"] = Path(out["model"]).name
    for key in ("algorithm", "task"):
        if spec := _file_spec(out.get(key)):
            out[key] = f"{Path(spec[0]).name}:{spec[1]}"
    return out


def base_name(model: str) -> str:
    """The name a run's files give its base model: a short name or hub id as it is, a local
    directory (a path, or a name that is a directory here) by its last component."""
    from ..tasks.lm import SHORT_NAMES
    if model in SHORT_NAMES:
        return model
    path_like = model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model).expanduser().is_dir()
    return Path(model).name if path_like else model


@contextmanager
def relocated(data_dir: str | Path | None = None, model: str | Path | None = None,
              method_file: str | Path | None = None):
    """Read runs moved away from their inputs, inside the ``with`` block, from these places (what
    ``--data-dir``, ``--model`` and ``--method-file`` say on the command line)."""
    given = {k: str(v) for k, v in (("data_dir", data_dir), ("model", model), ("method_file", method_file)) if v}
    token = RELOCATED.set({**RELOCATED.get(), **given})
    try:
        yield
    finally:
        RELOCATED.reset(token)
