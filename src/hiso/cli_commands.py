"""The ``hiso`` subcommands' handlers: each takes the parsed arguments and returns the exit status.

:mod:`hiso.cli` parses the command line and dispatches here (and re-exports these names)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from .config import RunConfig, load_config, option_fields, read_toml


def _fail(msg: str) -> int:
    print(f"hiso: error: {msg}", file=sys.stderr)
    return 2


def _tracking(args: argparse.Namespace, name: str):
    from .report.tracking import Tracking

    t = Tracking(args.tensorboard, args.mlflow, name=name)
    t.check()
    return t if t.active else None


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .report.footer import smaller_lr
    from .report.table import loss_rise_note
    from .runners.rundir import clear_run, run_to_dir
    from .tasks.registry import build_task, run_default_lr

    overrides = {k: getattr(args, k) for k in option_fields()}
    if args.resume is True:  # --out DIR --resume: resume or start, whichever DIR calls for
        if args.out is None:
            return _fail("--resume without a value continues --out DIR: give --out DIR (or --resume DIR)")
        if args.force:
            return _fail("--resume continues a run and --force overwrites it: choose one")
        from .runners.rundir import same_run
        cfg = load_config(args.config, **overrides)
        verdict, why = same_run(cfg, args.out)
        if verdict == "other":
            return _fail(f"{args.out} holds another run ({why}): use another --out, or --force to overwrite it")
        args.resume, args.out = (args.out, None) if verdict == "same" else (None, args.out)
    if args.out is not None and args.resume is not None:
        return _fail(f"--out {args.out} starts a run and --resume {args.resume} continues one: give one of them "
                     f"(or --out DIR --resume, no value, to continue DIR if it holds this run)")
    if (args.out is None) == (args.resume is None):
        return _fail("give --out DIR (a new run) or --resume DIR (an interrupted one)")
    if args.resume is not None:
        from .runners.continuing import continuation
        if args.force:
            return _fail("--resume continues a run and --force overwrites it: choose one")
        out = Path(args.resume)
        given = {**read_toml(args.config), **{k: v for k, v in overrides.items() if v is not None}}
        try:
            plan = continuation(out, given)
        except ValueError as e:
            return _fail(str(e))
        if plan.finished is not None:
            print(plan.finished)
            return 1 if plan.diverged else 0
        if plan.note and (not args.quiet or "was cut" in plan.note):  # a cut log is said even when quiet
            print(f"hiso: note: {plan.note}", file=sys.stderr)
        cfg = plan.cfg
        from .runners.portable import require_inputs
        require_inputs(cfg, out, {k: given[k] for k in ("data_dir", "model") if given.get(k)})
    else:
        if getattr(args, "method_file", None):
            return _fail("--method-file points a resumed run at its moved method file: give --resume DIR "
                         "(a new run names its method with --algorithm FILE.py:Class)")
        cfg = load_config(args.config, **overrides)
        out = Path(args.out)
        if why := _new_run_refusal(cfg, out, args.force):
            return _fail(why)
    tracking = _tracking(args, out.resolve().name)
    stage = _Stage(args.quiet)
    stage(f"{cfg.task}: loading the task")
    task = build_task(cfg)
    if args.show_partition:
        hist = getattr(task, "label_hist", None)
        if hist is None:
            return _fail(f"task {cfg.task} has no labels to show")
        from .data.partition import format_histograms
        print(format_histograms(hist, max_rows=None))
    stage.done()
    desc = f"{cfg.algorithm} on {cfg.task}"
    bar = tqdm(total=cfg.rounds, desc=f"{desc}: building the model, evaluating round 0" if args.resume is None
               else f"{desc}: replaying the log", unit="round", disable=args.quiet, dynamic_ncols=True)

    rise = {"first": None, "said": False}
    chosen = run_default_lr(cfg)  # what a message about too large an lr suggests

    def progress(row: dict) -> None:
        if not rise.get("named"):  # the rounds begin: the bar names the run again
            rise["named"] = True
            bar.set_description(desc, refresh=False)
        if row["round"] == 0:
            rise["first"] = row.get("eval_loss")
            if not args.quiet:
                shown = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k.startswith(("eval_", "val_"))
                                  and isinstance(v, (int, float)))
                bar.write(f"round 0: {shown}" if shown else "round 0", file=sys.stderr)
            return
        if not rise["said"] and (note := loss_rise_note(rise["first"], row, cfg.lr, chosen)):
            rise["said"] = True
            bar.write(f"hiso: {note}", file=sys.stderr)
        if bar.n == 0 and row["round"] > 1:  # a resumed run
            bar.update(row["round"] - 1)
        post = {"loss": f"{row['train_loss']:.4g}"} if row["train_loss"] is not None else {}  # (None under DP)
        for k in ("eval_acc", "gap"):
            if k in row:
                post[k] = f"{row[k]:.4g}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)

    if args.force:  # none of the old run's files may stay beside the new one's
        clear_run(out)
    try:
        summary = run_to_dir(cfg, out, progress, task=task, resume=args.resume is not None, tracking=tracking)
    finally:
        bar.close()
    comm = summary["communication_per_client"]
    if summary["diverged"]:
        print(f"hiso: {cfg.algorithm} diverged in round {summary['diverged']['round']} "
              f"({summary['diverged']['error']}); rounds so far are kept in {out}/; the lr ({cfg.lr:g}) is likely "
              f"too large ({smaller_lr(cfg.lr, chosen)})", file=sys.stderr)
        return 1
    final = ", ".join(f"{k}={v:.4g}" for k, v in summary["final"].items())
    print(f"{cfg.algorithm} on {cfg.task}: {cfg.rounds} rounds, {final}; "
          f"per client {comm['bytes_up_mean']:.0f} B up, {comm['bytes_down_mean']:.0f} B down (mean); "
          f"{_seconds(summary['s_per_round'])}/round; results in {out}/")
    _ending_note(cfg, out)
    return 0


def _seconds(s: float) -> str:
    """A duration for people: ``0.0354 s``, ``3.52 s``, ``169 s``."""
    return f"{s:.3g} s" if s < 100 else f"{s:.0f} s"


class _Stage:
    """One line on stderr naming what a run does before its bar starts (loading a language
    model takes minutes), erased when the next stage begins; nothing when quiet."""

    def __init__(self, quiet: bool):
        self.quiet, self.width = quiet or not sys.stderr.isatty(), 0

    def __call__(self, text: str) -> None:
        if not self.quiet:
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)

    def done(self) -> None:
        if not self.quiet and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def _with(cfg: RunConfig, name: str, value) -> RunConfig:
    """``cfg`` with the option ``name`` (a flag's name: a method's, ``nu``, too) set to ``value``."""
    from .config_parse import merge_options
    return RunConfig(**merge_options(cfg.model_dump(), {name: value}))


def _new_run_refusal(cfg: RunConfig, out: Path, force: bool) -> str | None:
    """Why a new run (hiso run, hiso flower) cannot start in ``out`` (None: it can, and the options
    its algorithm never reads have been named)."""
    from .runners.rundir import not_a_dir
    if why := not_a_dir(out):
        return why
    if (out / "config.json").exists() and not force:
        return f"{out} already holds a run (use --force to overwrite, or --resume {out} to continue it)"
    _warn_unused(cfg)
    return None


def _warn_unused(cfg: RunConfig) -> None:
    """Name the options a new run was given that its algorithm never reads (recorded, no effect)."""
    found = cfg.unused_options()
    unused = [f"{name} ({whose})" for name, whose in found.items()]
    if unused:
        kept = [name for name in found if name in RunConfig.model_fields]  # another method's flags are not kept
        where = (f"config.json records {'it' if len(unused) == 1 else 'them'} as given" if len(kept) == len(found)
                 else f"config.json records {', '.join(kept)} as given" if kept else "config.json does not record "
                 + ("it" if len(unused) == 1 else "them"))
        print(f"hiso: note: {cfg.algorithm} does not use {'; '.join(unused)}: {where}, with no effect on the run",
              file=sys.stderr)
    for why in cfg.weak_aggregation():
        print(f"hiso: note: {why}", file=sys.stderr)


def _ending_note(cfg: RunConfig, out: Path) -> None:
    """Say so when a run ended well below its best evaluation (see report.table.run_ending_note)."""
    from .report.runs import read_rows
    from .report.table import higher_is_better, run_ending_note
    from .runners.drivers import driver_of
    from .tasks.registry import task_info

    metric = next(iter(task_info(cfg.task).metrics))
    note = run_ending_note(read_rows(out), metric, higher_is_better(metric, cfg.task),
                            out if driver_of(cfg.method).keeps_log else None)
    if note:
        print(note)


def cmd_compare(args: argparse.Namespace) -> int:
    from .experiments.compare import build_plan, compare, parse_cli, table_plan

    if args.table_only and args.force:
        return _fail("--table-only runs nothing and --force reruns everything: choose one")
    at_round = args.at_round
    if at_round is not None:
        if not args.table_only:
            return _fail("--at-round tabulates runs as they stood at a round: give it with --table-only")
        if at_round != "latest":
            try:
                at_round = int(at_round)
            except ValueError:
                at_round = -1
            if at_round < 0:
                return _fail(f"--at-round takes a round (0 or more) or 'latest', not {args.at_round!r}")
    shared = {k: getattr(args, k) for k in option_fields() if hasattr(args, k)}
    flags = parse_cli(args.algorithms, args.seeds, args.lr_grid, args.reference, args.metric, args.select_on)
    # --table-only: the runs in --out are what the plan recorded there made, not what the
    # command line (or a config file edited since) would make now
    plan = table_plan(args.out, shared, flags) if args.table_only else build_plan(args.config, shared, flags)
    if args.table_only and args.config and not args.quiet:
        print(f"hiso: note: --table-only tabulates the plan recorded in {args.out}/compare.json; "
              f"{args.config} is not read", file=sys.stderr)
    if args.jobs < 1:
        return _fail(f"--jobs must be >= 1, got {args.jobs}")
    if at_round == "latest":  # resolved once here: the runs go on logging meanwhile
        from .experiments.compare import reached_part
        at_round = reached_part(plan, args.out, "latest")[2]
    try:
        text = compare(plan, args.out, force=args.force, quiet=args.quiet, jobs=args.jobs,
                       tracking=None if args.table_only else _tracking(args, "compare"), run=not args.table_only,
                       at_round=at_round, target=plan.target if args.target is None else args.target)
    except KeyboardInterrupt as e:
        if _stopped_by(e):
            raise
        print(f"hiso: interrupted; finished runs are kept in {args.out}/runs (rerun the same command to resume)",
              file=sys.stderr)
        return 128 + signal.SIGINT
    print(text, end="")
    if not args.quiet:
        where = args.out if at_round is None else f"{args.out.rstrip('/')}/round{at_round}"
        print(f"results in {where}/ (table.md, table.csv, frontier.md, frontier.csv, selection.json, *.png)")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from .runners.rundir import overwrites_run, rebuild, saved_config

    saved_config(args.run_dir)  # a run directory, before anything else is said about it
    out = Path(args.out)
    why = overwrites_run(out, args.run_dir)
    if why is not None:
        return _fail(f"--out {out} {why}: write the model elsewhere")
    if out.is_dir():
        return _fail(f"--out {out} is a directory: give a file name")
    state, ckpt = rebuild(args.run_dir, device=args.device, round=args.round)
    try:  # missing parents are made, as run and export make theirs
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        return _fail(f"--out {out}: {out.parent} is not a directory")
    from .atomic import save_atomic
    save_atomic(out, ckpt)
    print(f"rebuilt round {state.round} model from {args.run_dir} into {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .runners.export import export

    done = export(args.run_dir, args.out, args.format, round=args.round, force=args.force, dtype=args.dtype,
                  base_dir=args.base_dir)
    print(f"exported round {done['round']} of {args.run_dir} as {done['format']} into {done['out']}/: "
          f"{len(done['files'])} files, {done['bytes'] / 1e6:.1f} MB, {done['seconds']:.1f} s"
          + (f"; its base model is in {args.base_dir}/" if args.base_dir else ""))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .runners.evaluate import evaluate_run, write_eval
    from .runners.rundir import overwrites_run, saved_config

    saved_config(args.run_dir)  # a run directory, before anything else is said about it
    out = Path(args.out) if args.out else Path(args.run_dir) / "eval.json"
    if not out.parent.is_dir():
        return _fail(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        return _fail(f"--out {out} is a directory: give a file name")
    if out.name != "eval.json" and (why := overwrites_run(out, args.run_dir)) is not None:  # eval.json: its own
        return _fail(f"--out {out} {why}: write the metrics elsewhere")
    if args.eval_max is not None and args.eval_max < 1:
        return _fail(f"--eval-max must be >= 1, got {args.eval_max}")
    result = evaluate_run(args.run_dir, args.round, args.data_dir, args.eval_max, args.split, args.device)
    print(f"round {result['round']} of {args.run_dir}: "
          + ", ".join(f"{k}={v:.6g}" for k, v in result["metrics"].items()) + f" ({result['seconds']:.1f} s)")
    write_eval(result, out)
    print(f"written: {out}")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from .report.diagnose import diagnose, summary_text, write
    from .runners.runfiles import not_a_dir

    if args.batches < 1 or args.probes < 1:
        raise ValueError("--batches and --probes must be >= 1")
    if args.out is not None and (why := not_a_dir(args.out)) is not None:  # before the work, not after it
        return _fail(f"--out {why}")
    d = diagnose(args.run_dir, points=args.points, curvature=args.curvature, max_params=args.max_params,
                 batches=args.batches, probes=args.probes)
    paths = write(d, args.out or args.run_dir)
    print(summary_text(d))
    print(f"written: {', '.join(str(p) for p in paths)}")
    return 0


def _stopped_by(e: BaseException) -> int | None:
    """The signal (SIGTERM, SIGHUP) that stopped hiso, or None for Ctrl-C and other exceptions."""
    from .procs import Stopped
    return e.signum if isinstance(e, Stopped) and e.signum != signal.SIGINT else None


def cmd_plan(args: argparse.Namespace) -> int:
    """``hiso plan``: print :func:`hiso.runners.plan.format_plan` for the deployment."""
    from .runners.plan import Deployment, format_plan, plan
    from .runners.plan_memory import plan_structure, with_memory

    d, s = args.params, plan_structure(args)
    if s is not None:
        d = s.lora if args.lora_r else s.params
    elif d is None:
        from .tasks.registry import build_task
        opts = {"task": args.task} | ({"model": args.model} if args.model else {})
        model = build_task(RunConfig(**opts)).build_model()
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dep = Deployment(d, args.clients, args.sampled, args.rounds, args.local_steps, args.perturbations,
                     args.scalar_dtype, args.bandwidth, args.forward_s, args.snapshot_after, args.seed,
                     args.difference, args.ferret_k, args.ferret_blocks, args.sketch_bits, args.seed_pool,
                     args.seed_sampling)
    rows = plan([m.strip() for m in args.methods.split(",") if m.strip()], dep)
    print(format_plan(rows, dep))
    if s is not None:
        print(with_memory(rows, s, args.base_dtype, args.lora_r, args.quantize_embedding))
    return 0
