"""``hiso compare``: several algorithms x an lr grid x seeds on one task, each algorithm's lr
chosen on the grid, then a table and plots.

Three rooms: :mod:`hiso.experiments.compare_plan` (the configuration and the plan),
:mod:`hiso.experiments.compare_run` (running it, resumable) and this module (choosing each arm's lr,
then the table and the plots).

Selection and outputs
---------------------
* **What the choices are made on** (``select_on``, ``--select-on``). ``"val"``: on a validation
  split, so the reported examples are never looked at while choosing. It needs runs with one: a
  task that supports it (registered with ``validation=True``: mnist, fashion-mnist, sst2, qqp, squad) and
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
  it was). ``--table-only`` tabulates ``DIR`` by this plan (:func:`~hiso.experiments.compare_plan.table_plan`),
  not by the config file, which may have changed since; flags given override it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..config import ConfigError
from ..report.table import ArmResult, RunResult, best_of, load_run_result, selected_value

# names callers import from here (hiso.cli, tests, bench)
from ..atomic import write_atomic
from .compare_plan import Arm, CompareSpec, Plan, RunSpec, build_plan, lr_dirname, parse_cli, run_dir  # noqa: F401
from .compare_plan import table_plan  # noqa: F401
from .compare_run import _finished, execute  # noqa: F401


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


def collect(plan: Plan, out: str | Path, at_round: int | None = None) -> tuple[list[ArmResult], dict]:
    """Load every run, choose each arm's lr; returns the arms (at their lr) and selection.json's
    content. ``at_round``: every run as it stood at that round (finished or not)."""
    out = Path(out)
    higher = plan.higher_is_better
    sel = plan.select_metric
    rule = (f"per arm, the lr with the best mean over seeds of each run's best {sel} over its evaluated "
            "rounds (ties: first listed)")
    rule += (" (selected on test: the reported examples themselves)" if sel == plan.metric else
             f"; each run reports its {plan.metric} at its first round of best {sel}")
    arms, selection = [], {"metric": plan.metric, "higher_is_better": higher, "seeds": plan.seeds,
                           **({"at_round": at_round} if at_round is not None else {}),
                           "reference": plan.reference, "select_on": plan.select_on, "select_metric": sel,
                           **({"select_note": plan.select_note} if plan.select_note else {}),
                           "rule": rule, "arms": {}}
    for arm in plan.arms:
        by_lr: dict[float, list[RunResult]] = {}
        for lr in arm.lrs:
            by_lr[lr] = [load_run_result(run_dir(out, arm.name, lr, s), seed=s, at_round=at_round)
                         for s in plan.seeds]
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


def finished_part(plan: Plan, out: str | Path) -> tuple[Plan, list[str]]:
    """``plan`` cut to what has finished in ``out`` (for ``--table-only``): each arm keeps the lrs
    whose runs have finished for every seed; an arm with none is left out. Returns the cut plan
    and one line per thing left out. A finished run of another configuration is still an error."""
    from dataclasses import replace

    from .compare_run import _state, refuse_method_changes

    out = Path(out)
    fix = f"{out}/compare.json records how its runs were made: drop {{option}}"
    refuse_method_changes(plan.runs(out))
    arms, left = [], []
    for arm in plan.arms:
        done, missing = [], []
        for lr in arm.lrs:
            todo = [s for s in plan.seeds if _state(RunSpec(arm, lr, s, plan.config(arm, lr, s),
                                                           run_dir(out, arm.name, lr, s)), fix) != "finished"]
            if todo:
                missing.append(f"lr={lr:g} (seed{'s' if len(todo) > 1 else ''} {','.join(map(str, todo))})")
            else:
                done.append(lr)
        if done:
            arms.append(replace(arm, lrs=tuple(done)))
        if missing:
            left.append(f"{arm.name}: " + ("" if done else "no lr finished for every seed; ") + ", ".join(missing))
    if not any(a.name == plan.reference for a in arms):
        raise ConfigError(f"--table-only: the reference {plan.reference} has no lr finished for every seed in {out}/runs "
                          f"(give --seeds or --lr-grid to what has finished, or --reference another arm)")
    return replace(plan, arms=arms), left


def reached_part(plan: Plan, out: str | Path, at_round: int | str) -> tuple[Plan, list[str], int]:
    """``plan`` cut to the runs in ``out`` that stood at round ``at_round`` (an int, or ``"latest"``:
    the last round every run kept has logged), for ``--table-only --at-round``: each arm keeps the
    lrs whose runs, finished or not, have logged that round for every seed (a run that ended
    earlier, diverged, counts as it ended). Returns the cut plan, one line per thing left out,
    and the round."""
    from dataclasses import replace

    from ..report.runs import last_round
    from .compare_run import _state, refuse_method_changes

    out = Path(out)
    fix = f"{out}/compare.json records how its runs were made: drop {{option}}"
    refuse_method_changes(plan.runs(out))
    # (arm, lr) -> seed -> (its last logged round, whether it has ended there)
    stood: dict[tuple[str, float], dict[int, tuple[int, bool]]] = {}
    left: list[str] = []
    for arm in plan.arms:
        for lr in arm.lrs:
            at: dict[int, tuple[int, bool]] = {}
            for s in plan.seeds:
                d = run_dir(out, arm.name, lr, s)
                state = _state(RunSpec(arm, lr, s, plan.config(arm, lr, s), d), fix)
                last = last_round(d) if state != "start" else None
                if last is not None:
                    at[s] = (last, state == "finished")
            if len(at) == len(plan.seeds):
                stood[(arm.name, lr)] = at
            else:
                missing = [s for s in plan.seeds if s not in at]
                left.append(f"{arm.name}: lr={lr:g} (not started for seed{'s' if len(missing) > 1 else ''} "
                            f"{','.join(map(str, missing))})")
    if at_round == "latest":
        going = [r for at in stood.values() for r, ended in at.values() if not ended]
        at_round = min(going) if going else max((r for at in stood.values() for r, _ in at.values()), default=0)
    at_round = int(at_round)
    arms = []
    for arm in plan.arms:
        keep = []
        for lr in arm.lrs:
            at = stood.get((arm.name, lr))
            if at is None:
                continue
            short = {s: r for s, (r, ended) in at.items() if r < at_round and not ended}
            if short:
                left.append(f"{arm.name}: lr={lr:g} (" + ", ".join(f"seed {s} at round {r}" for s, r in short.items())
                            + f", not yet {at_round})")
            else:
                keep.append(lr)
        if keep:
            arms.append(replace(arm, lrs=tuple(keep)))
    if not any(a.name == plan.reference for a in arms):
        raise ConfigError(f"--at-round {at_round}: the reference {plan.reference} has no lr whose runs have logged "
                          f"round {at_round} for every seed in {out}/runs (an earlier --at-round, --seeds or "
                          "--lr-grid to what has run, or --reference another arm)")
    return replace(plan, arms=arms), left, at_round


def compare(plan: Plan, out: str | Path, force: bool = False, quiet: bool = False,
            plots: bool = True, jobs: int = 1, tracking=None, run: bool = True,
            at_round: int | str | None = None, target: float | None = None) -> str:
    """Run, select, write selection.json, the table and the plots; returns the printed table.
    ``run=False`` (``--table-only``) runs nothing: the table of the runs finished so far (safe
    beside a compare still running in ``out``). ``at_round`` (with ``run=False``): the runs,
    finished or not, as they stood at that round (``"latest"``: the last round all have logged),
    written into ``out/roundR/`` so that the final table in ``out`` is never replaced by a cut.
    The frontier (:mod:`hiso.report.frontier`: each arm's rounds, bytes, client compute and memory
    to the reference's best and to ``target``, Pareto-optimal arms marked) follows the table."""
    from ..report.table import build_table, write_table

    out = dest = Path(out)
    if at_round is not None and run:
        raise ValueError("at_round tabulates runs as they stood: it runs nothing (run=False)")
    if run:
        execute(plan, out, force=force, quiet=quiet, jobs=jobs, tracking=tracking)
    elif at_round is not None:
        plan, left, at_round = reached_part(plan, out, at_round)
        if left and not quiet:
            print(f"not at round {at_round} yet, left out of the table:\n  " + "\n  ".join(left), file=sys.stderr)
        dest = out / f"round{at_round}"
        dest.mkdir(exist_ok=True)
    else:
        plan, left = finished_part(plan, out)
        if left and not quiet:
            print("not finished yet, left out of the table:\n  " + "\n  ".join(left), file=sys.stderr)
    arms, selection = collect(plan, out, at_round=at_round)
    write_atomic(dest / "selection.json", json.dumps(_json_safe(selection), indent=2))
    table = build_table(arms, plan.reference, plan.metric, plan.select_metric, plan.select_note)
    text = write_table(dest, table)
    from ..report.frontier import frontiers, write_frontier
    text += "\n## Frontier\n\n" + write_frontier(dest, frontiers(table, arms, target), plot=plots)
    if plots:
        from ..report.plots import plot_all
        plot_all(arms, dest, plan.metric, plan.reference, table=table)
    return text
