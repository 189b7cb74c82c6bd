"""Running a compare's plan: each (arm, lr, seed) into its run directory, serially or over a
pool of worker processes, with progress and per-run peak memory.

Runs and resuming
-----------------
Each (arm, lr, seed) runs with :func:`~hiso.runners.rundir.run_to_dir` into
``DIR/runs/<arm>/lr<lr>/seed<seed>/`` (``lr`` written as Python's shortest repr, e.g.
``lr0.001``, ``lr3e-05``), seeds outermost. A run whose ``summary.json`` exists is finished and
skipped, so an interrupted compare resumes where it stopped: a partly written run of a
scalar-only algorithm (or FedKSeed) continues from its log, bit for bit as if uninterrupted
(``hiso run --resume``); the full-model baselines' partial runs are redone. Asking for more
``rounds`` than a finished run has continues it the same way (the horizon of a compare can be
raised later without redoing its rounds); any other change of a finished run's
``config.json`` is an error unless ``--force``, which reruns everything. So is a run of a
user's method whose file changed since it was made (:mod:`hiso.methods.identity`): the arms are
named with the part that changed, and ``--accept-method-change`` runs them again with the file
as it is now. The task (data, partition) is built once per distinct
task configuration and shared by the runs that use it.

``peak_rss_mb`` of a run inside compare: on Linux the process's resident high-water mark is
reset before each run and read after it (``/proc/self/clear_refs``, ``VmHWM``), and stored as
``peak_rss_mb_run`` in the run's ``summary.json``; it is the whole process's peak during that
run (interpreter, torch, the loaded data and the run itself). Elsewhere the lifetime peak of
the process is all there is.

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
import sys
import time
from pathlib import Path
from typing import Any, Callable


from ..config import ConfigError, RunConfig

from ..atomic import write_atomic
from .peak_rss import peak_rss_mb as _vm_hwm_mb, reset_peak_rss as _reset_peak_rss  # noqa: F401
from .compare_plan import NOT_TASK_FIELDS, RESUME_IGNORED, Plan, RunSpec, lr_dirname


# --------------------------------------------------------------------------- running

def _task_key(cfg: RunConfig) -> tuple[int, str]:
    return cfg.seed, json.dumps({k: v for k, v in cfg.model_dump().items() if k not in NOT_TASK_FIELDS},
                                sort_keys=True)


def _finished(spec: RunSpec) -> bool:
    """Whether ``spec.dir`` holds a finished run of ``spec.cfg`` (raises if of another config)."""
    return _state(spec) == "finished"


class MethodChangedRuns(ConfigError):
    """Runs of a compare made with another version of their method file (``runs``: a run's
    label -> (its arm, the file, what changed))."""

    def __init__(self, runs: dict):
        self.runs = runs
        arms: dict[str, list] = {}
        for arm, file, what in runs.values():
            arms.setdefault(arm, [file, what, 0])[2] += 1
        named = "; ".join(f"arm {name} ({n} run{'s' if n > 1 else ''}; {Path(file).name} {what})"
                          for name, (file, what, n) in arms.items())
        super().__init__(f"{named}: made with another version of the method file; pass --accept-method-change to "
                         f"run {'them' if len(runs) > 1 else 'it'} again with the file as it is now, or restore it")


def _method_change(spec: RunSpec, old: dict) -> tuple[str, str] | None:
    """(file, what changed) where ``spec.dir``'s config.json (``old``) records another version
    of the run's method file than the one there now; None otherwise."""
    from ..methods.identity import source_of, what_changed
    recorded = old.get("method_source")
    if not isinstance(recorded, dict) or "sha256" not in recorded:
        return None
    now = source_of(spec.cfg.algorithm)
    if now is None or now["sha256"] == recorded["sha256"]:
        return None
    return now["file"], what_changed(recorded, now)


def refuse_method_changes(specs: list[RunSpec]) -> None:
    """Raise :class:`MethodChangedRuns` naming every run of ``specs`` that would be kept (finished,
    or continued) although its method file changed, unless ``--accept-method-change``."""
    runs = {}
    for spec in specs:
        try:
            _state(spec)
        except MethodChangedRuns as e:
            runs.update(e.runs)
        except ConfigError:
            continue  # (another refusal: _state raises it again where it is asked)
    if runs:
        raise MethodChangedRuns(runs)


def _state(spec: RunSpec, fix: str = "use --force to rerun, or another --out") -> str:
    """What to do with ``spec.dir`` (:func:`_config_state`); a run that would be kept though its
    method file changed is started again under ``--accept-method-change``, else refused."""
    state = _config_state(spec, fix)
    if state == "start":
        return state
    change = _method_change(spec, json.loads((spec.dir / "config.json").read_text()))
    if change is None:
        return state
    from ..methods.identity import ACCEPT
    if ACCEPT.get():
        return "start"
    raise MethodChangedRuns({spec.label: (spec.arm.name, *change)})


def _config_state(spec: RunSpec, fix: str = "use --force to rerun, or another --out") -> str:
    """What to do with ``spec.dir``: ``"finished"`` (skip it), ``"continue"`` (a run of this
    configuration cut short, or a finished one asked to more rounds now: continued from its log,
    exactly as an uninterrupted run) or ``"start"`` (nothing there, a partial run that cannot be
    continued, or a partial run of another configuration). A finished run of another
    configuration is an error (:class:`ConfigError`) whose message ends with ``fix`` (``{option}``
    in it: the option that differs)."""
    from ..runners.drivers import driver_of
    from ..runners.continuing import extend_refusal
    from ..runners.runfiles import ended_early, resume_point

    try:
        old = json.loads((spec.dir / "config.json").read_text())
    except (OSError, ValueError):
        return "start"
    if isinstance(old, dict):  # an older hiso's file, as today's (hiso.compat)
        from ..compat import migrate
        try:
            old = migrate(old)[0]
        except ValueError as e:
            raise ConfigError(f"{spec.dir / 'config.json'}: {e}") from None
    from ..runners.portable import comparable
    try:  # its paths (relative to the run directory) and the ones asked for now, as absolute ones
        old = comparable(old, spec.dir)
    except (ValueError, TypeError, AttributeError):  # (a method file gone, a damaged file: as before)
        return "start"
    new = comparable(json.loads(json.dumps(spec.cfg.model_dump())))
    diff = []
    for k in sorted(set(old) | set(new)):
        if k in RESUME_IGNORED or k in ("task_info", "method_source", "schema"):
            continue
        if k not in old and k in RunConfig.model_fields and new[k] == RunConfig.model_fields[k].get_default(
                call_default_factory=True):
            continue  # an option added after that run was made, asked for at its default
        if old.get(k) != new.get(k):
            diff.append(k)
    try:
        summary = json.loads((spec.dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    done_rounds = old.get("rounds", 0)
    longer = diff == ["rounds"] and spec.cfg.rounds > done_rounds
    refusal = extend_refusal(spec.cfg, done_rounds if longer else None)
    can_continue = refusal is None
    if summary is not None:
        ended = ended_early(summary)
        if longer and not ended and extend_refusal(spec.cfg) is not None:
            return "start"  # a full-model baseline keeps no log: run again to the new horizon
        if diff and not (longer and (can_continue or ended)):
            k = diff[0]
            why = (f": {refusal}" if longer else
                   " (a run can be continued to more rounds, not cut to fewer)" if k == "rounds" else "")
            raise ConfigError(f"{spec.dir} holds a finished run with {k} = {old.get(k)!r}, not {new.get(k)!r} "
                              f"as asked now{why} ({fix.format(option='--' + k.replace('_', '-'))})")
        # (a summary without rounds_done, as older or hand-made ones, counts as the whole run)
        if ended or (not longer and summary.get("rounds_done", done_rounds) >= done_rounds):
            return "finished"  # (a diverged run stays the result at any horizon)
    elif diff and not longer:
        return "start"
    if not can_continue:
        return "start"
    try:  # a log that cannot be continued (damaged before its end, an old format): run it again
        resume_point(spec.dir, driver_of(spec.cfg.method).record_shape(spec.cfg), spec.cfg)
    except (OSError, ValueError):
        return "start"
    return "continue"


_PROGRESS = None  # in a worker process: the queue its runs report their rounds to


def _init_worker(queue, parent: int | None = None) -> None:
    global _PROGRESS
    _PROGRESS = queue
    # tqdm's default lock (an evaluation's bar takes it) is a named semaphore that a spawned
    # worker owns alone, shared with no one; a worker stopped with its compare never unregisters
    # it, and Python's resource tracker then warned of "leaked semaphore objects" after each stop
    import threading

    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())
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


def _run_in_worker(spec: RunSpec, tracking=None, resume: bool = False) -> dict:
    """One run in a worker process (``--jobs`` > 1): its own task, its own peak memory."""
    from ..tasks.registry import build_task
    from ..runners.rundir import run_to_dir

    reset = _reset_peak_rss()
    task = build_task(spec.cfg)
    summary = run_to_dir(spec.cfg, spec.dir, _round_reporter(spec.label, spec.cfg.rounds), task=task,
                         tracking=tracking, resume=resume)
    hwm = _vm_hwm_mb() if reset else None
    if hwm is not None:
        summary["peak_rss_mb_run"] = hwm
        write_atomic(spec.dir / "summary.json", json.dumps(summary, indent=2))
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
    """Stop a process pool's workers now (their runs are lost; finished runs are on disk).

    The queued runs are cancelled by the pool's own manager thread (``shutdown(cancel_futures=
    True)``), before the workers are stopped: that thread then finds the pool broken and fails
    every future it still holds, and a future cancelled from here instead (``Future.cancel``)
    made it raise ``InvalidStateError`` with a traceback on every Ctrl-C."""
    from ..procs import stop_processes
    procs = list((getattr(pool, "_processes", None) or {}).values())  # (shutdown forgets them)
    pool.shutdown(wait=False, cancel_futures=True)
    stop_processes([p.pid for p in procs if p.pid], grace=5.0)


def _continuing(labels: set[str]) -> str:
    return (f"{len(labels)} run{'s' if len(labels) > 1 else ''} continue{'' if len(labels) > 1 else 's'} from "
            f"{'their' if len(labels) > 1 else 'its'} log (cut short, or asked to more rounds): "
            + ", ".join(sorted(labels)))


def _execute_parallel(plan: Plan, specs: list[RunSpec], todo: list[RunSpec], jobs: int, bar, tracking=None,
                      resume: set[str] = frozenset()) -> int:
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
        pending = {pool.submit(_run_in_worker, spec, _tracked(tracking, spec), spec.label in resume): spec
                   for spec in todo}
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
                              f"{_run_seconds(summary)}", file=sys.stderr)
                running = ", ".join(f"{lab}: {r}/{by_label[lab].cfg.rounds}" for lab, r in sorted(at.items()))
                bar.set_postfix_str(f"runs {done + skipped}/{len(specs)}" + (f"; {running}" if running else ""))
        except BaseException:
            _stop_workers(pool)  # or leaving the with-block would wait for the running runs to finish
            bar.write(f"stopped: {done + skipped} of {len(specs)} runs are finished and kept "
                      "(rerun the same command to resume)", file=sys.stderr)
            raise
    return done


def execute(plan: Plan, out: str | Path, force: bool = False, quiet: bool = False,
            jobs: int = 1, tracking=None) -> dict[str, int]:
    """Run every unfinished run of ``plan`` into ``out``; returns counts run / skipped.

    ``jobs`` > 1 runs that many runs at once in worker processes (set ``threads = 1`` then).
    """
    from tqdm import tqdm

    from ..tasks.registry import build_task
    from ..runners.rundir import clear_run, run_to_dir

    out = Path(out)
    specs = plan.runs(out)
    if not force:
        refuse_method_changes(specs)  # every arm whose method file changed, named in one line
    states = {s.label: ("start" if force else _state(s)) for s in specs}  # refuses a changed config
    todo = [s for s in specs if states[s.label] != "finished"]
    resume = {s.label for s in todo if states[s.label] == "continue"}
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused compare writes nothing
    write_atomic(out / "compare.json", json.dumps(plan.to_json(), indent=2))
    for s in todo:  # a run started afresh (--force, or a partial one that cannot continue) keeps no old file
        if states[s.label] == "start" and s.dir.is_dir():
            clear_run(s.dir)
    skipped = len(specs) - len(todo)
    if jobs > 1 and len(todo) > 1:  # a bar of rounds, moved by the workers' reports
        bar = tqdm(total=sum(s.cfg.rounds for s in todo), desc="compare", unit="round", disable=quiet,
                   dynamic_ncols=True, file=sys.stderr)
        if not quiet:
            if skipped:
                bar.write(f"{skipped} of {len(specs)} runs already finished in {out}/runs: skipped", file=sys.stderr)
            if resume:
                bar.write(_continuing(resume), file=sys.stderr)
            bar.write(f"--jobs {jobs}: {len(todo)} runs, {min(jobs, len(todo))} at a time, each in a worker "
                      "process that starts Python and torch and builds its own task (seconds): for runs of a "
                      "few seconds --jobs 1 is faster", file=sys.stderr)
        t_start = time.perf_counter()
        try:
            done = _execute_parallel(plan, specs, todo, jobs, bar, tracking, resume)
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
        bar.write(f"{skipped} of {len(specs)} runs already finished in {out}/runs: skipped", file=sys.stderr)
    if resume and not quiet:
        bar.write(_continuing(resume), file=sys.stderr)
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
                summary = run_to_dir(spec.cfg, spec.dir, progress, task=tasks[key], tracking=_tracked(tracking, spec),
                                     resume=spec.label in resume)
            except BaseException:
                bar.write(f"{spec.label}: failed after {time.perf_counter() - t0:.0f} s; {done + skipped} "
                          f"of {len(specs)} runs are finished and kept (rerun the same command to resume)", file=sys.stderr)
                raise
            hwm = _vm_hwm_mb() if reset else None
            if hwm is not None:
                summary["peak_rss_mb_run"] = hwm
                write_atomic(spec.dir / "summary.json", json.dumps(summary, indent=2))
            done += 1
            bar.update(1)
            if not quiet:
                best = summary.get("best", {}).get(plan.select_metric, float("nan"))
                bar.write(f"[{done + skipped}/{len(specs)}] {spec.label}: best {plan.select_metric} {best:.4g}, "
                          f"{_run_seconds(summary)}", file=sys.stderr)
    finally:
        bar.close()
    return {"run": done, "skipped": skipped, "total": len(specs)}
