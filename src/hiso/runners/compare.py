"""``hiso compare``: several algorithms x an lr grid x seeds on one task, each algorithm's lr
chosen on the grid, then a table and plots.

Configuration
-------------
One TOML file (``--config``) and command-line flags. The file's top-level keys are
:class:`~hiso.config.RunConfig` keys shared by every run; a ``[compare]`` table says what to
compare::

    task = "mnist"            # shared by every run (any RunConfig key except algorithm, seed)
    rounds = 300
    lr = 1e-3                 # the lr of arms that have no grid below (a one-point grid)

    [compare]
    algorithms = ["hiso", "decomfl", "hiso-nu0.01"]   # the arms, in table order
    seeds = [0, 1, 2]         # every (arm, lr) runs once per seed (default [0])
    reference = "decomfl"     # default: decomfl if it is an arm, else the first arm
    metric = "eval_acc"       # default: eval_acc for vision tasks, gap for the quadratic
    select_on = "val"         # or "test"; default: val where the runs have a validation split

    [compare.lr_grid]         # arm or algorithm name -> lrs to try
    hiso = [3e-4, 1e-3]
    decomfl = [1e-3, 3e-3]

    [compare.overrides.hiso]  # RunConfig keys for every arm running this algorithm
    h_max = 1e4

    [compare.variants]        # named arms: an algorithm plus RunConfig keys
    "hiso-nu0.01" = { algorithm = "hiso", nu = 0.01 }

An **arm** is a row of the table: either a plain algorithm name (one of
:data:`~hiso.config.ALGORITHMS`) or a variant name. A variant is an algorithm with some
settings changed, so an ablation (e.g. HiSo's smoothing weight ``nu``) is a few lines of
``[compare.variants]``. Variant names may use letters, digits and ``.-_+``, and may not be an
algorithm's name (use ``[compare.overrides.NAME]`` to change a plain algorithm).

An arm's configuration, from weakest to strongest: RunConfig defaults < the file's top level
< shared command-line flags (``--rounds 300``) < ``[compare.overrides.<its algorithm>]`` < the
variant's own keys; then its lr and seed. Its lr grid is ``lr_grid[arm name]``, else
``lr_grid[its algorithm]`` (variants inherit their algorithm's grid), else the shared ``lr``.
``lr``, ``seed`` and ``task`` cannot be set per arm (use ``lr_grid``, ``seeds``, and one
compare per task). Flags: ``--algorithms a,b``, ``--seeds 0,1,2``, ``--lr-grid NAME=LR,LR``
(repeatable; replaces that name's grid), ``--reference``, ``--metric``, ``--select-on`` replace
the file's values. Every run's configuration is validated before the first run starts.

Runs and resuming
-----------------
Each (arm, lr, seed) runs with :func:`~hiso.runners.rundir.run_to_dir` into
``DIR/runs/<arm>/lr<lr>/seed<seed>/`` (``lr`` written as Python's shortest repr, e.g.
``lr0.001``, ``lr3e-05``), seeds outermost. A run whose ``summary.json`` exists is finished and
skipped, so an interrupted compare resumes where it stopped (a partly written run is redone);
a finished run whose ``config.json`` differs from what is asked now is an error unless
``--force``, which reruns everything. The task (data, partition) is built once per distinct
task configuration and shared by the runs that use it.

``peak_rss_mb`` of a run inside compare: on Linux the process's resident high-water mark is
reset before each run and read after it (``/proc/self/clear_refs``, ``VmHWM``), and stored as
``peak_rss_mb_run`` in the run's ``summary.json``; it is the whole process's peak during that
run (interpreter, torch, the loaded data and the run itself). Elsewhere the lifetime peak of
the process is all there is.

Selection and outputs
---------------------
* **What the choices are made on** (``select_on``, ``--select-on``). ``"val"``: on a validation
  split, so the reported examples are never looked at while choosing. It needs runs with one: a
  task that supports it (registered with ``validation=True``: mnist, fashion-mnist) and
  ``val_fraction > 0``, which keeps that share of the held-out examples apart (seeded) and
  reports ``val_*`` on them beside ``eval_*`` on the rest (the reported examples are then that
  rest, fewer than without a split). The selection metric is ``metric``'s validation
  counterpart (``eval_acc`` -> ``val_acc``); it picks each arm's lr (below), each run's
  **selected round** (its first evaluated round with its best validation value) and the
  threshold and rounds of "rounds to reach"; the table reports ``metric`` (test) at the
  selected round. ``"test"``: on ``metric`` itself, the examples reported (optimistic; the
  table's header says "selected on test"). Default: ``"val"`` where the runs have a validation
  split, else ``"test"`` with a note in the footer saying why. ``select_on = "val"`` without a
  split is refused in one line before anything runs (and, should a task that declares one write
  no ``val_*`` metric, when the runs are collected). Switching it over finished runs reruns
  nothing. In what follows "metric" is the selection metric.
* A run's **best** value is the best ``metric`` over its evaluated rounds (row 0, every
  ``eval_every`` rounds and the last): the highest for accuracies (names ending in ``acc``), the
  lowest otherwise (losses, the quadratic's gap). NaN evaluations are ignored; a run with no
  finite evaluation has best NaN, which loses against any number.
* Each arm's **lr** is the grid point with the best mean over seeds of the runs' best values
  (ties: the one listed first). ``DIR/selection.json`` records, per arm, every lr's per-seed
  best values and mean (null when not finite), and the choice.
* ``DIR/table.md``, ``DIR/table.csv`` (also printed): see :mod:`hiso.report.table` for the
  precise definitions (rounds to reach the reference's best, speed-up, communication).
* ``DIR/*.png``: see :mod:`hiso.report.plots`.
* ``DIR/compare.json``: the resolved plan (shared configuration, arms, grids, seeds, ``select_on``
  and ``select_metric``; ``selection.json`` records them too, and, selecting on validation,
  each lr's per-seed test metric at the selected round). Written
  only once the plan is known to fit the runs already in ``DIR`` (a refused compare leaves it as
  it was).

Progress
--------
Each finished run prints one line with its best value of the selection metric (``val_acc``
when selecting on validation: the test metric is not shown while runs are chosen) and its own
time (``wall_s_total`` of its ``summary.json``: task building and queueing excluded). With ``--jobs`` > 1 the bar counts
rounds over all runs to do, fed by the workers (each sends its round numbers through a queue),
and shows each running run's round. A worker process starts Python and torch and builds its own
task (seconds, and the task's data once per run instead of once per seed), so for runs of a few
seconds ``--jobs 2`` is slower than serial: compare says so, and prints at the end the elapsed
time next to the runs' own total.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import ALGORITHMS, ConfigError, RunConfig, load_config, one_line, read_toml
from ..report.table import ArmResult, RunResult, best_of, load_run_result, selected_value, val_metric
from ..tasks.registry import higher_is_better, task_info

PER_ARM_FORBIDDEN = {"lr": "use [compare.lr_grid]", "seed": "use [compare] seeds",
                     "task": "compare one task at a time", "algorithm": None}
SHARED_FORBIDDEN = {"algorithm": "set [compare] algorithms (or --algorithms)",
                    "seed": "set [compare] seeds (or --seeds)"}
# RunConfig fields that do not change the task a run is built on (the task cache's key is
# every other field, so a new field is assumed to matter until listed here)
NOT_TASK_FIELDS = {"algorithm", "rounds", "sampled", "local_steps", "perturbations", "lr", "mu",
                   "difference", "batch_size", "eval_every", "weighted", "mode", "perturb_mode", "batch_memory",
                   "nu", "eps", "h_min", "h_max", "h_source", "server_lr", "beta1", "beta2",
                   "server_tau", "wire_dtype", "threads", "diverge_factor", "seed_pool", "seed_sampling", "ferret_k",
                   "ferret_blocks"}
# RunConfig fields that may differ between a finished run and the one asked for now
RESUME_IGNORED = {"threads"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class CompareSpec(BaseModel):
    """The ``[compare]`` table (after command-line flags replaced its keys)."""

    model_config = ConfigDict(extra="forbid")

    algorithms: list[str] = ["hiso", "decomfl"]
    seeds: list[int] = [0]
    reference: str | None = None
    metric: str | None = None
    lr_grid: dict[str, list[float]] = {}
    overrides: dict[str, dict[str, Any]] = {}
    variants: dict[str, dict[str, Any]] = {}
    select_on: Literal["val", "test"] | None = None  # default: val where the runs have a validation split


@dataclass(frozen=True)
class Arm:
    """One row of the table: an algorithm with its settings and its lr grid."""

    name: str
    algorithm: str
    overrides: dict[str, Any]  # RunConfig keys on top of the shared ones (not lr, seed)
    lrs: tuple[float, ...]


@dataclass(frozen=True)
class RunSpec:
    arm: Arm
    lr: float
    seed: int
    cfg: RunConfig
    dir: Path

    @property
    def label(self) -> str:
        return f"{self.arm.name} lr={self.lr:g} seed={self.seed}"


@dataclass
class Plan:
    shared: dict[str, Any]
    arms: list[Arm]
    seeds: list[int]
    reference: str
    metric: str
    select_on: str = "test"  # "val": lr and reported round chosen on the validation split; "test": on metric
    select_note: str = ""  # why "test" (when not asked for): shown in the table's footer

    @property
    def select_metric(self) -> str:
        """The metric lr, each run's reported round and the rounds to reach go by."""
        return val_metric(self.metric) if self.select_on == "val" else self.metric

    @property
    def task(self) -> str:
        return self.shared.get("task", RunConfig.model_fields["task"].default)

    @property
    def higher_is_better(self) -> bool:
        return higher_is_better(self.metric, self.task)

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def config(self, arm: Arm, lr: float, seed: int) -> RunConfig:
        try:
            return load_config(None, **{**self.shared, **arm.overrides, "algorithm": arm.algorithm,
                                        "lr": lr, "seed": seed})
        except ConfigError as e:
            raise ConfigError(f"{arm.name}: {e}") from None

    def runs(self, out: Path) -> list[RunSpec]:
        """Every run, seeds outermost (so an interrupted compare has every arm at seed 0 first)."""
        return [RunSpec(arm, lr, seed, self.config(arm, lr, seed), run_dir(out, arm.name, lr, seed))
                for seed in self.seeds for arm in self.arms for lr in arm.lrs]

    def to_json(self) -> dict:
        return {"shared": self.shared, "seeds": self.seeds, "reference": self.reference,
                "metric": self.metric, "higher_is_better": self.higher_is_better,
                "select_on": self.select_on, "select_metric": self.select_metric,
                **({"select_note": self.select_note} if self.select_note else {}),
                "arms": [{"name": a.name, "algorithm": a.algorithm, "overrides": a.overrides,
                          "lr_grid": list(a.lrs)} for a in self.arms]}


def lr_dirname(lr: float) -> str:
    return f"lr{float(lr)!r}"


def run_dir(out: Path, arm: str, lr: float, seed: int) -> Path:
    return Path(out) / "runs" / arm / lr_dirname(lr) / f"seed{seed}"


# --------------------------------------------------------------------------- configuration

def _split(flag: str, text: str, conv: Callable[[str], Any]) -> list:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ConfigError(f"{flag}: expected a comma-separated list, got {text!r}")
    try:
        return [conv(t) for t in items]
    except ValueError:
        raise ConfigError(f"{flag}: cannot read {text!r} as a list of {conv.__name__}s") from None


def parse_cli(algorithms: str | None = None, seeds: str | None = None,
              lr_grid: list[str] | None = None, reference: str | None = None,
              metric: str | None = None, select_on: str | None = None) -> dict[str, Any]:
    """The ``[compare]`` keys given on the command line (only those given)."""
    out: dict[str, Any] = {}
    if algorithms is not None:
        out["algorithms"] = _split("--algorithms", algorithms, str)
    if seeds is not None:
        out["seeds"] = _split("--seeds", seeds, int)
    if lr_grid:
        grid = {}
        for item in lr_grid:
            name, sep, lrs = item.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"--lr-grid: expected NAME=LR,LR,..., got {item!r}")
            grid[name.strip()] = _split(f"--lr-grid {name.strip()}", lrs, float)
        out["lr_grid"] = grid
    if reference is not None:
        out["reference"] = reference
    if metric is not None:
        out["metric"] = metric
    if select_on is not None:
        out["select_on"] = select_on
    return out


def _check_keys(where: str, keys: dict[str, Any]) -> None:
    for k in keys:
        if k in PER_ARM_FORBIDDEN and k != "algorithm":
            raise ConfigError(f"{where}: {k} cannot be set per arm ({PER_ARM_FORBIDDEN[k]})")
        if k not in RunConfig.model_fields:
            raise ConfigError(f"{where}: unknown option {k!r}")


def build_plan(config: str | Path | None = None, shared_flags: dict[str, Any] | None = None,
               compare_flags: dict[str, Any] | None = None) -> Plan:
    """The validated plan from a TOML file, shared RunConfig flags and ``[compare]`` flags.

    Raises :class:`ConfigError` (one line) for anything wrong, before anything runs.
    """
    file_vals = read_toml(config)
    raw_cmp = file_vals.pop("compare", {})
    if not isinstance(raw_cmp, dict):
        raise ConfigError("compare: must be a table ([compare])")
    shared = {**file_vals, **{k: v for k, v in (shared_flags or {}).items() if v is not None}}
    for k, why in SHARED_FORBIDDEN.items():
        if k in shared:
            raise ConfigError(f"{k}: not a shared option in a comparison; {why}")
    if "lr_grid" in raw_cmp and "lr_grid" in (compare_flags or {}):
        compare_flags = {**compare_flags, "lr_grid": {**raw_cmp["lr_grid"], **compare_flags["lr_grid"]}}
    try:
        spec = CompareSpec(**{**raw_cmp, **(compare_flags or {})})
    except ValidationError as e:
        raise ConfigError(one_line(e, "compare")) from None
    load_config(None, **{"lr": 1.0, **shared})  # the shared part alone must be valid (an arm's lr: below)

    # variants and per-algorithm overrides
    for name, keys in spec.variants.items():
        where = f"compare.variants.{name}"
        if name in ALGORITHMS:
            raise ConfigError(f"{where}: a variant cannot be named after an algorithm "
                              f"(use [compare.overrides.{name}] to change {name} itself)")
        if not _NAME.match(name):
            raise ConfigError(f"{where}: variant names may only use letters, digits and . - _ +")
        if "algorithm" not in keys:
            raise ConfigError(f"{where}: needs an algorithm (one of {', '.join(ALGORITHMS)})")
        if keys["algorithm"] not in ALGORITHMS:
            raise ConfigError(f"{where}: unknown algorithm {keys['algorithm']!r} (choose from {', '.join(ALGORITHMS)})")
        _check_keys(where, keys)
    for alg, keys in spec.overrides.items():
        where = f"compare.overrides.{alg}"
        if alg not in ALGORITHMS:
            raise ConfigError(f"{where}: unknown algorithm {alg!r} (choose from {', '.join(ALGORITHMS)})")
        if "algorithm" in keys:
            raise ConfigError(f"{where}: algorithm cannot be overridden")
        _check_keys(where, keys)

    known = set(ALGORITHMS) | set(spec.variants)
    if not spec.algorithms:
        raise ConfigError("compare.algorithms: empty")
    for name in spec.algorithms:
        if name not in known:
            extra = f" or a variant ({', '.join(spec.variants)})" if spec.variants else ""
            raise ConfigError(f"compare.algorithms: unknown algorithm {name!r} (choose from {', '.join(ALGORITHMS)}{extra})")
    dup = {n for n in spec.algorithms if spec.algorithms.count(n) > 1}
    if dup:
        raise ConfigError(f"compare.algorithms: {sorted(dup)[0]!r} listed twice")
    for name, lrs in spec.lr_grid.items():
        if name not in known:
            raise ConfigError(f"compare.lr_grid: {name!r} is neither an algorithm nor a variant")
        if not lrs:
            raise ConfigError(f"compare.lr_grid.{name}: empty")
        if any(not (lr > 0 and math.isfinite(lr)) for lr in lrs):
            raise ConfigError(f"compare.lr_grid.{name}: learning rates must be positive, got {lrs}")
        if len(set(map(float, lrs))) != len(lrs):
            raise ConfigError(f"compare.lr_grid.{name}: an lr is listed twice ({lrs})")
    if not spec.seeds:
        raise ConfigError("compare.seeds: empty")
    if any(s < 0 for s in spec.seeds) or len(set(spec.seeds)) != len(spec.seeds):
        raise ConfigError(f"compare.seeds: need distinct non-negative integers, got {spec.seeds}")

    arms = []
    for name in spec.algorithms:
        var = spec.variants.get(name, {"algorithm": name})
        alg = var["algorithm"]
        overrides = {**spec.overrides.get(alg, {}), **{k: v for k, v in var.items() if k != "algorithm"}}
        lrs = spec.lr_grid.get(name, spec.lr_grid.get(alg))
        if lrs is None:  # no grid: the shared lr, else this algorithm's default for the task
            try:
                lrs = [load_config(None, **{**shared, **overrides, "algorithm": alg}).lr]
            except ConfigError as e:
                raise ConfigError(f"{name}: {e} (in a comparison: --lr-grid {name}=LR,...)") from None
        arms.append(Arm(name, alg, overrides, tuple(float(x) for x in lrs)))

    reference = spec.reference
    if reference is None:
        reference = "decomfl" if "decomfl" in spec.algorithms else spec.algorithms[0]
    elif reference not in spec.algorithms:
        raise ConfigError(f"compare.reference: {reference!r} is not one of the compared algorithms ({', '.join(spec.algorithms)})")

    task = shared.get("task", RunConfig.model_fields["task"].default)
    metrics = task_info(task).metrics  # the task registers its metrics (validated above)
    metric = spec.metric or next(iter(metrics))
    if metric not in metrics:
        raise ConfigError(f"compare.metric: task {task} reports {', '.join(metrics)}, not {metric!r}")

    select_on, note = _select_on(spec.select_on, task, metric, shared.get("val_fraction") or 0.0)
    plan = Plan(shared, arms, list(spec.seeds), reference, metric, select_on, note)
    for arm in arms:  # validate every run's configuration now, not after hours of runs
        for lr in arm.lrs:
            plan.config(arm, lr, spec.seeds[0])
    return plan


def _select_on(asked: str | None, task: str, metric: str, val_fraction: float) -> tuple[str, str]:
    """``("val" | "test", note)``: what lr and the reported round are selected on. Not asked:
    val where the runs have a validation split (the task has one and val_fraction > 0), else test
    with a note saying why. Asked for val without a split: a one-line error naming the fix."""
    validation = task_info(task).validation
    has_val = metric.startswith("eval_")
    if asked == "val":
        if not validation:
            raise ConfigError(f"compare.select_on: task {task} has no validation split (no val_* metrics) to select "
                              "on; use --select-on test")
        if not has_val:
            raise ConfigError(f"compare.select_on: metric {metric} has no validation counterpart (only eval_* "
                              "metrics do); use --select-on test")
        if val_fraction <= 0:
            raise ConfigError("compare.select_on: val_fraction = 0 leaves no validation split to select on; give "
                              "--val-fraction 0.5 (val_fraction = 0.5 in the file: that share of the held-out "
                              "examples is kept apart) or --select-on test")
        return "val", ""
    if asked == "test":
        return "test", ""
    if validation and has_val and val_fraction > 0:
        return "val", ""
    if validation and has_val:
        return "test", ("val_fraction = 0: no validation split; --val-fraction 0.5 --select-on val selects on "
                        "held-out examples apart from the reported ones")
    return "test", f"task {task} has no validation split"


# --------------------------------------------------------------------------- running

def _task_key(cfg: RunConfig) -> tuple[int, str]:
    return cfg.seed, json.dumps({k: v for k, v in cfg.model_dump().items() if k not in NOT_TASK_FIELDS},
                                sort_keys=True)


def _finished(spec: RunSpec) -> bool:
    """Whether ``spec.dir`` holds a finished run of ``spec.cfg`` (raises if of another config)."""
    if not (spec.dir / "summary.json").is_file():
        return False
    try:
        old = json.loads((spec.dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    new = json.loads(json.dumps(spec.cfg.model_dump()))
    for k in sorted(set(old) | set(new)):
        if k in RESUME_IGNORED or k == "task_info":
            continue
        if k not in old and k in RunConfig.model_fields and new[k] == RunConfig.model_fields[k].default:
            continue  # an option added after that run was made, asked for at its default
        if old.get(k) != new.get(k):
            raise ConfigError(f"{spec.dir} holds a finished run with {k} = {old.get(k)!r}, not {new.get(k)!r} "
                              "as asked now (use --force to rerun, or another --out)")
    return True


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_PROGRESS = None  # in a worker process: the queue its runs report their rounds to


def _init_worker(queue, parent: int | None = None) -> None:
    global _PROGRESS
    _PROGRESS = queue
    if parent is not None:
        _exit_with_parent(parent)


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """A killed ``hiso compare`` (SIGTERM, SIGKILL) must not leave its workers computing runs
    nobody waits for: each worker checks its parent every second and exits when it is gone
    (rerunning the compare reruns the runs that did not finish)."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="hiso-parent-watch", daemon=True).start()


def _round_reporter(label: str, rounds: int, every_s: float = 0.2) -> Callable[[dict], None] | None:
    """A progress callback sending (label, round) to the parent: round 1, then at most every
    ``every_s`` seconds, and the last round."""
    queue = _PROGRESS
    if queue is None:
        return None
    last = [-math.inf]

    def report(row: dict) -> None:
        rnd, now = int(row["round"]), time.monotonic()
        if rnd == 1 or rnd >= rounds or (rnd > 0 and now - last[0] >= every_s):
            last[0] = now
            queue.put((label, rnd))
    return report


def _run_in_worker(spec: RunSpec, tracking=None) -> dict:
    """One run in a worker process (``--jobs`` > 1): its own task, its own peak memory."""
    from ..tasks.registry import build_task
    from .rundir import run_to_dir

    reset = _reset_peak_rss()
    task = build_task(spec.cfg)
    summary = run_to_dir(spec.cfg, spec.dir, _round_reporter(spec.label, spec.cfg.rounds), task=task,
                         tracking=tracking)
    hwm = _vm_hwm_mb() if reset else None
    if hwm is not None:
        summary["peak_rss_mb_run"] = hwm
        (spec.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _tracked(tracking, spec: RunSpec):
    """``tracking`` (:class:`hiso.report.tracking.Tracking`) for one run: named arm/lr/seed, tagged so."""
    if tracking is None:
        return None
    return tracking.for_run(f"{spec.arm.name}/{lr_dirname(spec.lr)}/seed{spec.seed}", arm=spec.arm.name,
                            algorithm=spec.arm.algorithm, lr=spec.lr, seed=spec.seed)


def _run_seconds(summary: dict) -> str:
    """A finished run's own time for its progress line: ``wall_s_total`` of its summary.json."""
    s = summary.get("wall_s_total")
    return "? s" if s is None else f"{s:.1f} s"


def _summary_seconds(d: Path) -> float:
    try:
        return float(json.loads((d / "summary.json").read_text()).get("wall_s_total") or 0.0)
    except (OSError, ValueError):
        return 0.0


def _stop_workers(pool) -> None:
    """Stop a process pool's workers now (their runs are lost; finished runs are on disk)."""
    from ..procs import stop_processes
    procs = list((getattr(pool, "_processes", None) or {}).values())
    stop_processes([p.pid for p in procs if p.pid], grace=5.0)
    pool.shutdown(wait=False, cancel_futures=True)


def _execute_parallel(plan: Plan, specs: list[RunSpec], todo: list[RunSpec], jobs: int, bar, tracking=None) -> int:
    """Runs spread over ``jobs`` worker processes (spawned: forking after torch starts its
    thread pools can hang). Each finished run is reported as it lands; returns how many ran."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    import queue as queue_mod

    done, skipped = 0, len(specs) - len(todo)
    ctx = mp.get_context("spawn")
    rounds_q = ctx.Queue()
    at: dict[str, int] = {}  # label -> the last round a running run reported
    counted: dict[str, int] = {}  # label -> rounds of it already added to the bar

    def advance(label: str, rnd: int) -> None:
        if rnd > counted.get(label, 0):
            bar.update(rnd - counted.get(label, 0))
            counted[label] = rnd

    def drain() -> None:
        while True:
            try:
                label, rnd = rounds_q.get_nowait()
            except (queue_mod.Empty, OSError, ValueError):
                return
            if label in by_label and label not in finished_labels:
                at[label] = max(at.get(label, 0), rnd)
                advance(label, at[label])

    by_label = {s.label: s for s in todo}
    finished_labels: set[str] = set()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker,
                             initargs=(rounds_q, os.getpid())) as pool:
        pending = {pool.submit(_run_in_worker, spec, _tracked(tracking, spec)): spec for spec in todo}
        try:
            while pending:
                finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                drain()
                for fut in finished:
                    spec = pending.pop(fut)
                    summary = fut.result()  # a failed run raises here; finished runs stay on disk
                    done += 1
                    finished_labels.add(spec.label)
                    at.pop(spec.label, None)
                    advance(spec.label, spec.cfg.rounds)  # a diverged run's rounds left count as done
                    best = summary.get("best", {}).get(plan.select_metric, float("nan"))
                    bar.write(f"[{done + skipped}/{len(specs)}] {spec.label}: best {plan.select_metric} {best:.4g}, "
                              f"{_run_seconds(summary)}")
                running = ", ".join(f"{lab}: {r}/{by_label[lab].cfg.rounds}" for lab, r in sorted(at.items()))
                bar.set_postfix_str(f"runs {done + skipped}/{len(specs)}" + (f"; {running}" if running else ""))
        except BaseException:
            for fut in pending:
                fut.cancel()
            _stop_workers(pool)  # or leaving the with-block would wait for the running runs to finish
            bar.write(f"stopped: {done + skipped} of {len(specs)} runs are finished and kept "
                      "(rerun the same command to resume)")
            raise
    return done


def execute(plan: Plan, out: str | Path, force: bool = False, quiet: bool = False,
            jobs: int = 1, tracking=None) -> dict[str, int]:
    """Run every unfinished run of ``plan`` into ``out``; returns counts run / skipped.

    ``jobs`` > 1 runs that many runs at once in worker processes (set ``threads = 1`` then).
    """
    from tqdm import tqdm

    from ..tasks.registry import build_task
    from .rundir import run_to_dir

    out = Path(out)
    specs = plan.runs(out)
    todo = specs if force else [s for s in specs if not _finished(s)]  # refuses a changed config
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused compare writes nothing
    (out / "compare.json").write_text(json.dumps(plan.to_json(), indent=2))
    skipped = len(specs) - len(todo)
    if jobs > 1 and len(todo) > 1:  # a bar of rounds, moved by the workers' reports
        bar = tqdm(total=sum(s.cfg.rounds for s in todo), desc="compare", unit="round", disable=quiet,
                   dynamic_ncols=True, file=sys.stderr)
        if not quiet:
            if skipped:
                bar.write(f"{skipped} of {len(specs)} runs already finished in {out}/runs: skipped")
            bar.write(f"--jobs {jobs}: {len(todo)} runs, {min(jobs, len(todo))} at a time, each in a worker "
                      "process that starts Python and torch and builds its own task (seconds): for runs of a "
                      "few seconds --jobs 1 is faster")
        t_start = time.perf_counter()
        try:
            done = _execute_parallel(plan, specs, todo, jobs, bar, tracking)
        finally:
            bar.close()
        if not quiet:
            own = sum(_summary_seconds(s.dir) for s in todo)
            print(f"--jobs {jobs}: {time.perf_counter() - t_start:.1f} s elapsed for {done} runs taking "
                  f"{own:.1f} s by themselves", file=sys.stderr)
        return {"run": done, "skipped": skipped, "total": len(specs)}
    bar = tqdm(total=len(specs), initial=skipped, desc="compare", unit="run", disable=quiet,
               dynamic_ncols=True, file=sys.stderr)
    if skipped and not quiet:
        bar.write(f"{skipped} of {len(specs)} runs already finished in {out}/runs: skipped")
    tasks: dict[str, Any] = {}
    done = 0
    try:
        for spec in todo:
            key = _task_key(spec.cfg)
            if key not in tasks:
                if any(k[0] != spec.seed for k in tasks):
                    tasks.clear()  # seeds are outermost: an earlier seed's tasks are not needed again
                tasks[key] = build_task(spec.cfg)
            last_refresh = [0.0]

            def progress(row: dict, spec: RunSpec = spec) -> None:
                now = time.monotonic()
                if not quiet and now - last_refresh[0] > 0.5:
                    last_refresh[0] = now
                    bar.set_postfix_str(f"{spec.label}: round {row['round']}/{spec.cfg.rounds}")

            reset = _reset_peak_rss()
            t0 = time.perf_counter()
            try:
                summary = run_to_dir(spec.cfg, spec.dir, progress, task=tasks[key], tracking=_tracked(tracking, spec))
            except BaseException:
                bar.write(f"{spec.label}: failed after {time.perf_counter() - t0:.0f} s; {done + skipped} "
                          f"of {len(specs)} runs are finished and kept (rerun the same command to resume)")
                raise
            hwm = _vm_hwm_mb() if reset else None
            if hwm is not None:
                summary["peak_rss_mb_run"] = hwm
                (spec.dir / "summary.json").write_text(json.dumps(summary, indent=2))
            done += 1
            bar.update(1)
            if not quiet:
                best = summary.get("best", {}).get(plan.select_metric, float("nan"))
                bar.write(f"[{done + skipped}/{len(specs)}] {spec.label}: best {plan.select_metric} {best:.4g}, "
                          f"{_run_seconds(summary)}")
    finally:
        bar.close()
    return {"run": done, "skipped": skipped, "total": len(specs)}


# --------------------------------------------------------------------------- selection

def select_lr(grid: dict[float, list[float]], higher: bool) -> float:
    """The lr whose per-seed best values have the best mean (NaN means worst; ties: first listed)."""
    if not grid:
        raise ValueError("empty lr grid")
    worst = -math.inf if higher else math.inf

    def score(lr: float) -> float:
        vals = grid[lr]
        m = sum(vals) / len(vals) if vals else math.nan
        return worst if math.isnan(m) else m

    best_lr = None
    for lr in grid:  # strict comparison keeps the first of equals
        if best_lr is None or (score(lr) > score(best_lr) if higher else score(lr) < score(best_lr)):
            best_lr = lr
    return best_lr


def collect(plan: Plan, out: str | Path) -> tuple[list[ArmResult], dict]:
    """Load every run, choose each arm's lr; returns the arms (at their lr) and selection.json's content."""
    out = Path(out)
    higher = plan.higher_is_better
    sel = plan.select_metric
    rule = (f"per arm, the lr with the best mean over seeds of each run's best {sel} over its evaluated "
            "rounds (ties: first listed)")
    rule += (" (selected on test: the reported examples themselves)" if sel == plan.metric else
             f"; each run reports its {plan.metric} at its first round of best {sel}")
    arms, selection = [], {"metric": plan.metric, "higher_is_better": higher, "seeds": plan.seeds,
                           "reference": plan.reference, "select_on": plan.select_on, "select_metric": sel,
                           **({"select_note": plan.select_note} if plan.select_note else {}),
                           "rule": rule, "arms": {}}
    for arm in plan.arms:
        by_lr: dict[float, list[RunResult]] = {}
        for lr in arm.lrs:
            by_lr[lr] = [load_run_result(run_dir(out, arm.name, lr, s), seed=s) for s in plan.seeds]
        for runs in by_lr.values():
            for r in runs:
                for m in dict.fromkeys((plan.metric, sel)):
                    if not any(m in row for row in r.rows):
                        fix = " (select on test: --select-on test)" if m == sel != plan.metric else ""
                        raise ConfigError(f"metric {m!r} not in {r.dir}/metrics.jsonl "
                                          f"(it has: {', '.join(r.eval_keys()) or 'no evaluations'}){fix}")
        grid = {lr: [best_of(r.rows, sel, higher) for r in runs] for lr, runs in by_lr.items()}
        chosen = select_lr(grid, higher)
        entries = []
        for lr, vals in grid.items():
            e = {"lr": lr, "best_per_seed": dict(zip(map(str, plan.seeds), vals)), "mean_best": sum(vals) / len(vals)}
            if sel != plan.metric:  # what the table reports for each lr: the test metric at the selected round
                rep_vals = [selected_value(r.rows, plan.metric, sel, higher) for r in by_lr[lr]]
                e[f"{plan.metric}_at_selected_per_seed"] = dict(zip(map(str, plan.seeds), rep_vals))
            entries.append(e)
        selection["arms"][arm.name] = {
            "algorithm": arm.algorithm, "overrides": arm.overrides, "chosen_lr": chosen, "grid": entries,
        }
        arms.append(ArmResult(arm.name, arm.algorithm, chosen, by_lr[chosen], grid=grid))
    return arms, selection


def _json_safe(x):
    """NaN and infinities (diverged runs) as null: selection.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def compare(plan: Plan, out: str | Path, force: bool = False, quiet: bool = False,
            plots: bool = True, jobs: int = 1, tracking=None) -> str:
    """Run, select, write selection.json, the table and the plots; returns the printed table."""
    from ..report.table import build_table, write_table

    out = Path(out)
    execute(plan, out, force=force, quiet=quiet, jobs=jobs, tracking=tracking)
    arms, selection = collect(plan, out)
    (out / "selection.json").write_text(json.dumps(_json_safe(selection), indent=2))
    table = build_table(arms, plan.reference, plan.metric, plan.select_metric, plan.select_note)
    text = write_table(out, table)
    if plots:
        from ..report.plots import plot_all
        plot_all(arms, out, plan.metric, plan.reference, table=table)
    return text
