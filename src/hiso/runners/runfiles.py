"""The files of a run directory, and how they are read back: ``config.json`` (what ran),
``model.pt``'s checkpoint, the resume point of an interrupted run (the rounds both
``metrics.jsonl`` and ``history.bin`` hold; what continuing may change: :mod:`hiso.runners.continuing`),
the DP noise key (``dp_secret.json``), and the
atomic replacement every rewrite uses. What each file holds: :mod:`hiso.runners.rundir`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from pydantic import ValidationError

from ..compat import SCHEMA, migrate
from ..config import ConfigError, RunConfig
from ..core.history import parse_history
from .portable import base_name, resolve, store
from ..atomic import torch_tmp, write_atomic  # noqa: F401 (write_atomic re-exported: the run files' writer)


# the files a run writes into its directory (see hiso.runners.rundir; flower*: a run over Flower)
RUN_FILES = ("config.json", "metrics.jsonl", "history.bin", "summary.json", "model.pt", "rejections.log",
             "dp_secret.json", "flower.json", "flower-lineage", "checkpoint.pt")
# what other commands write into it by default (hiso eval, hiso diagnose): about that run too
ABOUT_RUN_FILES = ("eval.json", "diagnose.json", "diagnose.txt", "diagnose.png")


def clear_run(out: str | Path) -> None:
    """Remove the files of the run in ``out`` before ``--force`` starts another there: what the run
    wrote and what was written about it (:data:`RUN_FILES`, :data:`ABOUT_RUN_FILES`, and a rewrite's
    leftover ``.tmp``), so none of another configuration's files outlives it. A user's files stay."""
    for name in (*RUN_FILES, *ABOUT_RUN_FILES):
        p = Path(out) / name
        for path in (p, p.with_name(f"{name}.tmp"), *([torch_tmp(p)] if p.suffix == ".pt" else [])):
            if path.is_file() or path.is_symlink():
                path.unlink()


def overwrites_run(out: str | Path, run_dir: str | Path) -> str | None:
    """Why writing ``out`` would destroy (part of) the run in ``run_dir`` (None: it would not):
    ``out`` is the run directory, a directory holding it, or a file of it (one there, or one a run writes)."""
    out_r, run = Path(out).resolve(), Path(run_dir).resolve()
    if out_r == run or out_r in run.parents:
        return f"would replace the run directory {run_dir} itself"
    if out_r.parent == run and (out_r.exists() or out_r.name in RUN_FILES):
        return f"would overwrite {out_r.name} of the run directory {run_dir}"
    return None


def not_a_dir(out: str | Path) -> str | None:
    """Why ``out`` cannot become a run directory (None: it can): it, or a folder above it, is a file."""
    out = Path(out)
    for p in (out, *out.parents):
        if p.exists():
            return None if p.is_dir() else f"{out} is a file, not a directory" if p == out else \
                f"{out}: {p} is a file, not a directory"
    return None


def saved_config(run_dir: str | Path) -> tuple[RunConfig, dict]:
    """A run directory's configuration and task description (``config.json``)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a hiso run directory?")
    try:
        raw, older = migrate(_raw_config(path))
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    raw = resolve(raw, run_dir)  # its inputs where they are here (or where the user says)
    if raw.get("momentum") is not None and "momentum" not in _method_can(raw.get("algorithm")):
        raw["momentum"] = None  # what the full-model baselines took and ran without, before they refused it
    info = raw.pop("task_info", None) or {}
    source = raw.pop("method_source", None)
    try:
        cfg = RunConfig(**{**raw, **older, **_as_it_ran(raw, info)})
    except ValidationError as e:  # one line: the first field refused
        err = e.errors()[0]
        where = ".".join(map(str, err.get("loc", ()))) or "a field"
        raise ConfigError(f"{path} is damaged ({where}: {err.get('msg')}; {e.error_count()} error(s))") from None
    from ..methods.identity import MethodChanged, check_source
    try:
        check_source(source, cfg.algorithm, run_dir)
    except MethodChanged as e:
        raise ConfigError(str(e)) from None
    return cfg, info


def _method_can(algorithm) -> frozenset:
    """The capabilities of the method named ``algorithm`` (none for a name that is not one: the
    configuration's own check says why)."""
    from ..methods.registry import method_info
    try:
        return method_info(algorithm).can
    except (ValueError, TypeError, ImportError):
        return frozenset()


def config_text(cfg: RunConfig, info: dict, out: str | Path, round: int | None = None) -> str:
    """``config.json``'s text: the configuration, the task's description and, for a user's
    method, its file's digest (:mod:`hiso.methods.identity`; a change accepted on resume kept)."""
    from ..methods.identity import record
    values = {**cfg.model_dump(), "task_info": info, **record(cfg, method_source(out), round)}
    return json.dumps({"schema": SCHEMA, **store(values, out)}, indent=2)


def method_source(run_dir: str | Path) -> dict | None:
    """``config.json``'s record of a user's method file (None: a built-in method, or an older run)."""
    try:
        return _raw_config(Path(run_dir) / "config.json").get("method_source")
    except (OSError, ValueError):
        return None


def _raw_config(path: Path) -> dict:
    """``config.json``'s object, or ValueError in one line (not JSON, nested too deep, not a configuration)."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("task_info") or {}, dict) \
            or not isinstance(raw.get("task", ""), str):
        raise ValueError(f"{path} is damaged (not a hiso run configuration: a JSON object with a task name and "
                         f"a task_info object)")
    return raw


class TaskMismatchWarning(UserWarning):
    """The task rebuilt for a run describes itself otherwise than the run's did (config.json)."""


# task_info keys that name where a task's files are or how it computes on this machine, not
# which task it is: a run moved to another machine or device may differ in them
_WHERE_KEYS = frozenset({"source", "model_source", "data_dir", "autocast", "autocast_why", "packed_forwards",
                         "device"})


def check_run_task(task, info: dict, run_dir: str | Path, given: bool = False, resume: bool = False) -> None:
    """``task``, built for the run in ``run_dir`` (from its config.json, or the object ``given``),
    must be the run's. A base model with other weights than the run's (``base_fingerprint``) is
    refused (ValueError). A task that describes itself otherwise (say its ``n_eval``: a
    constructor argument ``from_config`` does not pass, or other data files) is a
    :class:`TaskMismatchWarning` naming the difference, as its metrics and x_0 may not be the run's;
    ``resume``: refused instead, as continuing the run on it would mix two tasks in one run."""
    if "base_fingerprint" in info:
        found = task.base_fingerprint()
        if found != info["base_fingerprint"]:
            raise ValueError(f"base model {info.get('model')!r} here has weights {str(found)[:12]}..., the run "
                             f"{run_dir} started from {info['base_fingerprint'][:12]}...: not the run's base model")
    now = json.loads(json.dumps(task.describe(), default=str))  # as config.json would record it
    where = _WHERE_KEYS | ({"model"} if "base_fingerprint" in info else set())  # (the weights are checked)
    differ = [k for k in info if k in now and k not in where and now[k] != info[k]]
    if differ:
        shown = "; ".join(f"{k} {now[k]!r} here, {info[k]!r} in the run" for k in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        how = ("the task object given" if given else
               "the task rebuilt from its config.json (a constructor argument its from_config does not pass?)")
        if resume:
            raise ValueError(f"{run_dir}: {how} is not the run's: {shown}{more}; continuing the run on it would "
                             "mix two tasks in one run")
        warnings.warn(f"{run_dir}: {how} is not the run's: {shown}{more}; its x_0 and metrics may differ "
                      "from the run's", TaskMismatchWarning, stacklevel=3)


def _as_it_ran(raw: dict, info: dict) -> dict:
    """Options a run recorded that did nothing when it ran, at their defaults: task options its
    task does not read (accepted before such options were refused) and a ``train_max`` that
    vision tasks ignored before they honoured it (its ``n_train`` says so), so the run still
    loads and rebuilds as it ran."""
    from ..tasks.registry import TASK_OPTIONS, task_info
    try:
        read = task_info(raw.get("task", "quadratic")).options
    except (ValueError, ImportError):
        return {}
    from ..tasks.options import option_fields as task_fields
    fields, opts = {**RunConfig.model_fields, **task_fields()}, raw.get("task_opts")
    given = {*raw, *(opts if isinstance(opts, dict) else ())}
    out = {} if read is None else {k: fields[k].default for k in TASK_OPTIONS - read if k in given}
    tm = raw["train_max"] if "train_max" in raw else (opts if isinstance(opts, dict) else {}).get("train_max")
    n = info.get("n_train", 0)  # (a flat key over task_opts, as RunConfig reads them)
    if type(tm) is int and type(n) is int and n > tm:  # (a damaged file's other types: pydantic refuses them)
        out["train_max"] = None
    return out


def made_before(run_dir: str | Path) -> dict:
    """What :func:`hiso.compat.predates` gives for ``run_dir``'s ``config.json`` ({} if it has none):
    a resumed run takes these values, so it continues as it began."""
    try:
        return migrate(_raw_config(Path(run_dir) / "config.json"))[1]
    except (OSError, ValueError):
        return {}


def ended_early(summary: dict) -> bool:
    """Whether a finished run stopped before its horizon for good: diverged, or out of privacy budget."""
    return bool(summary.get("diverged") or (summary.get("privacy") or {}).get("stopped"))


def dp_secret(out: Path, cfg: RunConfig, resume: bool) -> RunConfig:
    """The run's configuration with its DP noise key: as given, or the one an earlier start of
    this run drew (DIR/dp_secret.json), or a fresh secret written there (not to config.json:
    whoever knows the key can subtract the noise)."""
    if cfg.dp_clip is None or cfg.dp_noise_seed is not None:
        return cfg
    path = out / "dp_secret.json"
    if resume and path.exists():
        key = int(json.loads(path.read_text())["noise_seed"])
    else:
        from ..methods.privacy import noise_key
        key = noise_key()
        write_atomic(path, json.dumps({"noise_seed": key}), mode=0o600)
    return cfg.model_copy(update={"dp_noise_seed": key})


def resume_point(out: Path, shape: tuple[int, int] | None, cfg: RunConfig | None = None) -> tuple[list[str], list]:
    """The rounds an interrupted run finished: (metrics lines of rows 0..R, history records
    0..R-1), R the last round both files hold. No round finished (R = 0): ([], []), start over."""
    lines = []
    if (out / "metrics.jsonl").exists():
        text = (out / "metrics.jsonl").read_text()
        for i, line in enumerate(text.split("\n")[:-1]):  # the text after the last newline is torn
            try:
                r = json.loads(line)["round"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{out}/metrics.jsonl: line {i + 1} is damaged") from None
            if r != i:
                raise ValueError(f"{out}/metrics.jsonl: line {i + 1} is round {r}, expected {i}")
            lines.append(line)
    if not lines or shape is None:  # shape None: the metrics lines alone (FedKSeed reads its own log)
        return lines, []
    path = out / "history.bin"
    if not path.exists():
        raise ValueError(f"{path} is missing: the run's rounds cannot be rebuilt")
    log = parse_history(path)
    if (log.tau, log.P) != shape:
        raise ValueError(f"{path} has (tau, P) = {(log.tau, log.P)} but config.json says {shape}")
    if log.version < 3:
        raise ValueError(f"{path} was written by hiso before protocol v2 (history version {log.version}): "
                         f"`hiso rebuild` still reads it, but the run cannot be continued")
    if cfg is not None and (log.seed, log.scalar_dtype, log.directions) != (cfg.seed, cfg.scalar_dtype, cfg.direction_spec):
        raise ValueError(f"{path} is of run seed {log.seed}, {log.scalar_dtype} scalars, directions {log.directions!r}, "
                         f"but config.json says {cfg.seed}, {cfg.scalar_dtype}, {cfg.direction_spec!r}")
    R = min(len(lines) - 1, len(log.records))
    if R == 0:  # no round finished: start over (kept, row 0 would be written twice; found by tests/test_crash.py)
        return [], []
    return lines[:R + 1], log.records[:R]


def read_pool_run_log(run_dir: str | Path, cfg: RunConfig) -> list:
    """A FedKSeed run's logged records (:func:`hiso.methods.fedkseed.read_pool_log`), refused
    unless the log is of the run ``config.json`` describes."""
    from ..methods.fedkseed import read_pool_log
    from ..methods.fedkseed_method import FedKSeed
    head, records = read_pool_log(f"{run_dir}/history.bin")
    K = FedKSeed.of(cfg).seed_pool
    if (head["tau"], head["K"], head["seed"], head["scalar_dtype"]) != (cfg.local_steps, K, cfg.seed, cfg.scalar_dtype):
        raise ValueError(f"{run_dir}/history.bin is not the log of the run config.json describes")
    return records


def pool_resume_point(out, cfg: RunConfig, lines: list[str]) -> tuple[list[str], list]:
    """The rounds an interrupted FedKSeed run finished: its kept metrics ``lines`` (rows 0..) and
    log records, cut to the last round both hold."""
    if not lines:
        return [], []
    records = read_pool_run_log(out, cfg)
    R = min(len(lines) - 1, len(records))
    return lines[:R + 1], records[:R]

def cut_rejections(path: Path, rows: int) -> None:
    """Keep the lines of ``rejections.log`` about rows 1..``rows`` (a resumed run logs the rest)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            n = int(line.split(" ", 2)[1]) if line.startswith("row ") else None
        except ValueError:
            n = None
        if n is not None and n <= rows and line.endswith("\n"):
            keep.append(line)
    write_atomic(path, "".join(keep))


def on_cpu(obj):
    """``obj`` (a tensor, or dicts of them) with its tensors on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    return obj


def checkpoint(state: dict, task_info: dict) -> dict:
    """What ``model.pt`` holds: the replicated state (its tensors on the CPU, whatever device the
    run used), plus the base model's name and fingerprint where the state alone does not define
    the model (LoRA adapters over a frozen base)."""
    state = on_cpu(state)
    if "base_fingerprint" not in task_info:
        return state
    base = base_name(task_info["model"])  # (a directory of the user's: its name only)
    return {**state, "base": {"model": base, "fingerprint": task_info["base_fingerprint"]}}


def read_run_history(run_dir: str | Path, cfg: RunConfig):
    """``run_dir``'s history.bin, refused unless it is the log of the run ``config.json`` describes
    (shape, and for version 3 logs the run seed, scalar format and direction family)."""
    path = Path(run_dir) / "history.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a finished or interrupted hiso/decomfl run?")
    log = parse_history(path)
    zo = cfg.zo()
    if (log.tau, log.P) != zo.shape:
        raise ValueError(f"history has (tau, P) = {(log.tau, log.P)} but config.json says {zo.shape}")
    if log.version >= 3 and (log.seed, log.scalar_dtype, log.directions) != (cfg.seed, cfg.scalar_dtype, cfg.direction_spec):
        raise ValueError(f"history is of run seed {log.seed}, {log.scalar_dtype} scalars, directions "
                         f"{log.directions!r}, but config.json says {cfg.seed}, {cfg.scalar_dtype}, {cfg.direction_spec!r}")
    if (why := short_log(run_dir, len(log.records))) is not None:
        warnings.warn(f"{why}: what is read back is round {len(log.records)}", ShortLogWarning, stacklevel=2)
    return log


class ShortLogWarning(UserWarning):
    """A finished run's log holds fewer rounds than its summary reports (it was cut afterwards)."""


def short_log(run_dir: str | Path, records: int) -> str | None:
    """Why ``run_dir``'s log of ``records`` rounds is shorter than the run it belongs to (its
    ``summary.json``'s rounds), or None."""
    try:
        done = json.loads((Path(run_dir) / "summary.json").read_text())["rounds_done"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(done, int) or records >= done:
        return None
    return (f"{Path(run_dir) / 'history.bin'} holds {records} rounds but summary.json reports {done} (the log was "
            "cut after the run ended)")
