"""Continuing a run directory: whether ``hiso run --resume DIR`` meets the same run
(:func:`same_run`), whether its log lets it go on to a later horizon (:func:`extend_refusal`),
and what continuing it does (:func:`continuation`). Its driver (:mod:`hiso.runners.drivers`)
says whether the run keeps a log and how many rounds that log holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import RUNTIME_ONLY, RunConfig, load_config
from .drivers import driver_of
from .portable import WHERE_FIELDS, comparable
from .runfiles import ended_early, made_before, saved_config, short_log


def same_run(cfg: RunConfig, run_dir: str | Path) -> tuple[str, str]:
    """What ``run_dir`` holds for ``hiso run --out DIR --resume``, and why: ``"same"`` (a run of
    ``cfg``, to continue), ``"empty"`` (absent, empty or no ``config.json`` yet: a run killed
    before it wrote one; start it) or ``"other"`` (another run; the reason names a difference)."""
    if not (Path(run_dir) / "config.json").exists():
        return "empty", ""
    saved, _ = saved_config(run_dir)
    a, b = comparable(saved.model_dump()), comparable(cfg.model_dump())  # (paths as absolute ones)
    older = made_before(run_dir)  # options the run predates: it resumes with their old values
    diff = [k for k in b if a.get(k) != b.get(k) and k not in older and k not in RUNTIME_ONLY]
    if not diff or (diff == ["rounds"] and cfg.rounds > saved.rounds and extend_refusal(cfg, saved.rounds) is None):
        return "same", ""  # (or the same run asked to more rounds: continued to them)
    return "other", f"{diff[0]} = {a.get(diff[0])!r} there, {b.get(diff[0])!r} here"


def extend_refusal(cfg: RunConfig, rounds: int | None = None) -> str | None:
    """Why a run of ``cfg`` cannot be continued from its log (None: it can), and with ``rounds``
    (the horizon it was started with) why it cannot be continued from there to ``cfg.rounds``.
    Extending is resuming with a later horizon: the rounds done are kept and the run goes on
    exactly as a run started with the larger ``rounds`` would have."""
    if not driver_of(cfg.method).keeps_log:
        return f"{cfg.algorithm} runs keep no log to rebuild their state from"
    if rounds is not None and rounds != cfg.rounds and cfg.dp_epsilon is not None:
        return (f"its DP noise was solved for epsilon {cfg.dp_epsilon:g} over {rounds} rounds: more rounds "
                "would spend more than that budget (give --dp-noise-multiplier to fix the noise instead)")
    return None


@dataclass
class Continuation:
    """What ``hiso run --resume DIR`` does with DIR: continue it with ``cfg`` (``note`` says so
    when it extends a finished run), or nothing (``finished`` says why; ``diverged``: exit 1)."""
    cfg: RunConfig
    finished: str | None = None
    diverged: bool = False
    note: str | None = None


def _by_option(values: dict) -> dict:
    """A configuration's values with its method's options also by their own names (``nu``), as
    the flags that set them are named."""
    return {**(values.get("method_opts") or {}), **values}


def continuation(out: Path, given: dict) -> Continuation:
    """How to continue the run in ``out`` with the options ``given`` (command line and config file):
    options must agree with its ``config.json``, except a larger ``rounds``, which continues the run
    (finished or not) to that horizon. Raises ``ValueError`` (one line) for what cannot be done."""
    from ..config_parse import merge_options
    cfg, _ = saved_config(out)
    saved = cfg.model_dump()
    asked = load_config(None, **merge_options(saved, given))  # a method's flag (nu) over its method_opts
    wanted = asked.model_dump()
    same = _by_option(comparable(wanted)), _by_option(comparable(saved))  # paths as absolute ones
    changed = [k for k in given if same[0].get(k) != same[1].get(k) and k not in RUNTIME_ONLY + WHERE_FIELDS]
    # as asked now: how it runs, and where its data or base model are (the task is checked on resume)
    cfg = cfg.model_copy(update={k: getattr(asked, k) for k in RUNTIME_ONLY + WHERE_FIELDS if k in given or
                                 k in RUNTIME_ONLY})
    longer = changed == ["rounds"] and asked.rounds > cfg.rounds
    if longer:  # the same run continued to a later horizon, if its log allows it
        why = extend_refusal(asked, cfg.rounds)
        if why is not None:
            raise ValueError(f"{out} cannot be continued to {asked.rounds} rounds: {why}")
    elif changed:
        k = next((k for k in changed if k != "rounds"), changed[0])  # (rounds alone could be fine)
        raise ValueError(f"--resume continues {out} as configured in its config.json: {k} = "
                         f"{_by_option(wanted).get(k)!r} would change its {_by_option(saved).get(k)!r} (start a "
                         f"new run with --out instead; only a larger "
                         f"--rounds continues it further)")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    if summary is None or not (ended_early(summary) or summary["rounds_done"] >= cfg.rounds):
        return Continuation(asked if longer else cfg)  # cut short (or killed while being extended)
    logged = None if ended_early(summary) else driver_of(cfg.method).logged_rounds(out)
    if logged is not None and (why := short_log(out, logged)) is not None:  # finished, then its log cut
        return Continuation(asked if longer else cfg, note=f"{why}: continuing from round {logged}")
    done = summary["rounds_done"]
    if longer and done >= cfg.rounds:  # finished at its horizon: on to the new one
        return Continuation(asked, note=f"{out}: continuing its {done} rounds to {asked.rounds}")
    why = (f"diverged in round {summary['diverged']['round']}" if summary["diverged"]
           else "stopped at its privacy budget" if done < cfg.rounds else f"{done} rounds")
    return Continuation(cfg, diverged=bool(summary["diverged"]),
                        finished=f"{out} is a finished run ({why}): nothing to "
                                 + (f"continue to {asked.rounds} rounds" if longer else "resume"))
