"""The plan of ``hiso compare``: its configuration (a TOML file and flags) turned into
arms x lr grid x seeds, each run's directory, and what may differ when a run is resumed.

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
    target = 0.80             # the frontier's second target (frontier.md), in the metric's units

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
(repeatable; replaces that name's grid; one no compared arm uses is refused, while the file
may keep grids for arms that ``--algorithms`` leaves out), ``--reference``, ``--metric``,
``--select-on`` replace the file's values. Every run's configuration is validated before the
first run starts.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..config import ALGORITHMS, ConfigError, RunConfig, load_config, one_line, option_fields, read_toml
from ..methods.registry import default_reference, is_user_method
from ..report.table import val_metric
from ..tasks.registry import higher_is_better, task_info

PER_ARM_FORBIDDEN = {"lr": "use [compare.lr_grid]", "seed": "use [compare] seeds",
                     "task": "compare one task at a time", "algorithm": None}
SHARED_FORBIDDEN = {"algorithm": "set [compare] algorithms (or --algorithms)",
                    "seed": "set [compare] seeds (or --seeds)",
                    # (the other arms' methods have other options, or none: the shared part is every arm's)
                    "method_opts": "a method's own options belong to its arm: [compare.variants] "
                                   "NAME = { algorithm = \"FILE.py:Class\", method_opts = { KEY = VALUE } }, "
                                   "then --algorithms ...,NAME"}
# RunConfig fields that do not change the task a run is built on (the task cache's key is
# every other field, so a new field is assumed to matter until listed here)
NOT_TASK_FIELDS = {"algorithm", "rounds", "sampled", "local_steps", "perturbations", "lr", "mu",
                   "difference", "batch_size", "eval_every", "weighted", "mode", "perturb_mode", "batch_memory",
                   "method_opts", "threads", "diverge_factor", "checkpoint_every"}
# RunConfig fields that may differ between a finished run and the one asked for now
RESUME_IGNORED = {"threads", "checkpoint_every"}
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
    target: float | None = None  # the frontier's second target, in the metric's units (--target)


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
    target: float | None = None  # the frontier's second target ([compare] target or --target)

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
                **({"target": self.target} if self.target is not None else {}),
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
        if k not in option_fields():
            raise ConfigError(f"{where}: unknown option {k!r}")


def _check_used(name: str, alg: str, overrides: dict[str, Any], shared: dict[str, Any], lr: float) -> None:
    """An arm's own option its algorithm never reads ({algorithm = "decomfl", nu = 0.2}) is a
    mistake in the plan, refused; a shared one may be meant for the other arms."""
    if not overrides:
        return
    unused = load_config(None, **{**shared, **overrides, "algorithm": alg, "lr": lr}).unused_options()
    for key in overrides:
        if key in unused:
            raise ConfigError(f"{name}: {alg} does not use {key} ({unused[key]}); drop it from the arm")


def build_plan(config: str | Path | dict[str, Any] | None = None, shared_flags: dict[str, Any] | None = None,
               compare_flags: dict[str, Any] | None = None) -> Plan:
    """The validated plan from a TOML file (or its values, e.g. :func:`recorded`), shared
    RunConfig flags and ``[compare]`` flags.

    Raises :class:`ConfigError` (one line) for anything wrong, before anything runs.
    """
    file_vals = copy.deepcopy(config) if isinstance(config, dict) else read_toml(config)
    raw_cmp = file_vals.pop("compare", {})
    if not isinstance(raw_cmp, dict):
        raise ConfigError("compare: must be a table ([compare])")
    shared = {**file_vals, **{k: v for k, v in (shared_flags or {}).items() if v is not None}}
    for k, why in SHARED_FORBIDDEN.items():
        if k in shared:
            raise ConfigError(f"{k}: not a shared option in a comparison; {why}")
    asked_grids = list((compare_flags or {}).get("lr_grid", {}))  # (the file's are merged in below)
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
        if not _known(keys["algorithm"]):
            raise ConfigError(f"{where}: unknown algorithm {keys['algorithm']!r} (choose from {', '.join(ALGORITHMS)})")
        _check_keys(where, keys)
    for alg, keys in spec.overrides.items():
        where = f"compare.overrides.{alg}"
        if not _known(alg):
            raise ConfigError(f"{where}: unknown algorithm {alg!r} (choose from {', '.join(ALGORITHMS)})")
        if "algorithm" in keys:
            raise ConfigError(f"{where}: algorithm cannot be overridden")
        _check_keys(where, keys)

    known = set(ALGORITHMS) | set(spec.variants) | {n for n in spec.algorithms if is_user_method(n)}
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
        _check_used(name, alg, overrides, shared, lrs[0])
    # a grid asked for on the command line that no arm uses is a mistake (dropped silently, a
    # reference among the arms left out changed the table); a file may keep grids for arms it
    # does not run every time (--algorithms picks them)
    used = {a.name if a.name in spec.lr_grid else a.algorithm for a in arms}
    for name in asked_grids:
        if name not in used:
            raise ConfigError(f"--lr-grid {name}: no compared arm uses it (compared: {', '.join(spec.algorithms)}); "
                              f"add {name} to --algorithms or drop its grid")

    reference = spec.reference
    if reference is None:
        reference = default_reference(spec.algorithms)
    elif reference not in spec.algorithms:
        raise ConfigError(f"compare.reference: {reference!r} is not one of the compared algorithms ({', '.join(spec.algorithms)})")

    arms, reference = _named_by_display(arms, reference, spec.variants)
    task = shared.get("task", RunConfig.model_fields["task"].default)
    metrics = task_info(task).metrics  # the task registers its metrics (validated above)
    metric = spec.metric or next(iter(metrics))
    if metric not in metrics:
        raise ConfigError(f"compare.metric: task {task} reports {', '.join(metrics)}, not {metric!r}")

    select_on, note = _select_on(spec.select_on, task, metric, shared.get("val_fraction") or 0.0)
    plan = Plan(shared, arms, list(spec.seeds), reference, metric, select_on, note, spec.target)
    for arm in arms:  # validate every run's configuration now, not after hours of runs
        for lr in arm.lrs:
            plan.config(arm, lr, spec.seeds[0])
    return plan


def _named_by_display(arms: list, reference: str, variants: dict) -> tuple[list, str]:
    """A user's method given as an arm by its spec (``path/to/file.py:Class``) is named by its
    display name (made unique), so its runs stay under --out and tables name it as it names
    itself; variants and built-in methods keep their names."""
    import dataclasses
    import re

    from ..methods.registry import method_info
    taken = {a.name for a in arms if not (is_user_method(a.name) and a.name not in variants)}
    out, renamed = [], {}
    for a in arms:
        if is_user_method(a.name) and a.name not in variants:
            base = re.sub(r"[^A-Za-z0-9.+_-]", "_", method_info(a.algorithm).display) or "method"
            name, k = base, 2
            while name in taken:
                name, k = f"{base}-{k}", k + 1
            taken.add(name)
            renamed[a.name] = name
            a = dataclasses.replace(a, name=name)
        out.append(a)
    return out, renamed.get(reference, reference)


def recorded(out: str | Path) -> dict[str, Any]:
    """The plan last started in ``out`` (its ``compare.json``) as a config file's values: the
    shared options at the top level and a ``[compare]`` table, every arm with its grid. It lets
    ``--table-only`` tabulate ``out`` without the file and flags that made its runs (which may
    since have changed, e.g. a compare extended with ``--rounds``)."""
    path = Path(out) / "compare.json"
    if not path.is_file():
        raise ConfigError(f"{out} holds no compare (no {path.name}): nothing to tabulate "
                          f"(hiso compare --out {out} without --table-only runs one)")
    try:
        rec = json.loads(path.read_text())
        arms = [(a["name"], a["algorithm"], dict(a["overrides"]), list(a["lr_grid"])) for a in rec["arms"]]
        table = {"algorithms": [a[0] for a in arms], "seeds": list(rec["seeds"]), "reference": rec["reference"],
                 "metric": rec["metric"], "lr_grid": {name: lrs for name, _, _, lrs in arms},
                 "variants": {name: {"algorithm": alg, **o} for name, alg, o, _ in arms if name != alg},
                 "overrides": {alg: o for name, alg, o, _ in arms if name == alg and o}}
        shared = dict(rec["shared"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a compare plan hiso can read ({type(e).__name__}: {e})") from None
    if rec.get("select_on") and not rec.get("select_note"):  # (a note: the default, worked out again)
        table["select_on"] = rec["select_on"]
    if rec.get("target") is not None:
        table["target"] = rec["target"]
    return {**shared, "compare": table}


def table_plan(out: str | Path, shared_flags: dict[str, Any] | None = None,
               compare_flags: dict[str, Any] | None = None) -> Plan:
    """The plan of ``--table-only``: the one recorded in ``out`` (:func:`recorded`) with the
    flags given on top (fewer seeds, arms or lrs, another reference, metric or select_on)."""
    values = recorded(out)
    flags = compare_flags or {}
    if "algorithms" in flags and "reference" not in flags and values["compare"]["reference"] not in flags["algorithms"]:
        del values["compare"]["reference"]  # not among the arms asked for: the default reference
    return build_plan(values, shared_flags, flags)


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


def _known(algorithm: str) -> bool:
    """A built-in method, or a user's (module:Class; RunConfig imports and checks it)."""
    return algorithm in ALGORITHMS or is_user_method(algorithm)
