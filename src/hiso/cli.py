"""The ``hiso`` command: run an experiment into a directory, or rebuild a model from its log."""

from __future__ import annotations

import argparse
import signal
import sys
import warnings
from pathlib import Path

from .config import ALGORITHMS, ConfigError, RunConfig, load_config, read_toml, task_names


# RunConfig fields whose values are checked by name (not a Literal): their choices for --help
CHOICES = {"task": lambda: (*task_names(), "module:Class", "file.py:Class"), "algorithm": lambda: ALGORITHMS}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # no prefixes: `hiso run --round 5` would silently mean --rounds (--round is rebuild's, export's, eval's)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"hiso: error: {message}\n")


def field_choices(name: str) -> tuple[str, ...] | None:
    """The values a RunConfig field takes, for --help: its Literal's, or the tasks / ALGORITHMS."""
    from typing import Literal, get_args, get_origin

    if name in CHOICES:
        return CHOICES[name]()
    ann = RunConfig.model_fields[name].annotation
    for a in (ann, *get_args(ann)):  # Literal[...] or Literal[...] | None
        if get_origin(a) is Literal:
            return tuple(str(v) for v in get_args(a))
    return None


def field_help(name: str) -> str:
    """A field's one line of --help: its meaning (``Field(description=...)``) and its default.

    A description that says its own default (``default: ...``, e.g. lr's per-task default) is
    shown as is; otherwise the field's default value is appended.
    """
    field = RunConfig.model_fields[name]
    text = (field.description or "").replace("%", "%%")  # argparse formats help with %
    if "default:" not in text:
        text += f" (default: {shown_default(field.default)})"
    return text


def shown_default(value) -> str:
    """A default as --help says it: off for False, none for None."""
    return "off" if value is False else "none" if value is None else str(value)


def _add_run_flags(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per RunConfig field; every default is None so the config file can show through.

    Choices are shown, not enforced here: RunConfig validates them (also for the TOML file)."""
    group = p.add_argument_group("run options (each is also a TOML key: --local-steps 2 is local_steps = 2)")
    for name, field in RunConfig.model_fields.items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        if ann is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=field_help(name))
            continue
        typ = {int: int, float: float}.get(ann, None)
        if typ is None and ann in (float | None, int | None):
            typ = float if ann == (float | None) else int
        choices = field_choices(name)
        group.add_argument(flag, dest=name, type=typ or str, default=None, help=field_help(name),
                           metavar="{" + ",".join(choices) + "}" if choices else None)


def _add_tracking_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensorboard", metavar="DIR", help="also log each round to TensorBoard event files under "
                   "DIR/<run name> (pip install 'hiso[track]')")
    p.add_argument("--mlflow", metavar="URI", help="also log each round to MLflow: a tracking URI, or a directory "
                   "for a local file store (pip install 'hiso[track]')")


def _tracking(args: argparse.Namespace, name: str):
    from .report.tracking import Tracking

    t = Tracking(args.tensorboard, args.mlflow, name=name)
    t.check()
    return t if t.active else None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hiso", description="Federated zeroth-order fine-tuning with scalar-only communication.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"hiso {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run one algorithm on one task into --out DIR")
    run.add_argument("--out", help="run directory to create")
    run.add_argument("--resume", metavar="DIR", nargs="?", const=True,
                     help="continue the interrupted run in DIR (its config.json; options that would change it are "
                     "refused). With --out DIR and no value: continue DIR if it holds this same run, start it if "
                     "DIR is empty, absent or has no config.json yet, refuse if DIR holds another run")
    run.add_argument("--config", help="TOML file of options (flags override it)")
    run.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--show-partition", action="store_true", help="print each client's label histogram")
    _add_tracking_flags(run)
    _add_run_flags(run)
    cmp = sub.add_parser("compare", allow_abbrev=False,
                         help="run algorithms x lr grid x seeds into --out DIR; table and plots")
    cmp.add_argument("--out", required=True, help="comparison directory (reused: finished runs are skipped)")
    cmp.add_argument("--config", help="TOML file: shared options at the top level, plus a [compare] table")
    cmp.add_argument("--algorithms", help="comma-separated algorithms or variants, e.g. hiso,decomfl "
                     f"(algorithms: {', '.join(ALGORITHMS)}; default: hiso,decomfl)")
    cmp.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: the config's [compare] seeds, else 0)")
    cmp.add_argument("--lr-grid", action="append", metavar="NAME=LR,LR,...",
                     help="lrs to try for an algorithm or variant among those compared (repeatable)")
    cmp.add_argument("--reference", help="the algorithm the others are measured against (default: decomfl)")
    cmp.add_argument("--metric", help="eval metric to select and compare on (default: eval_acc, or gap)")
    cmp.add_argument("--select-on", choices=("val", "test"), help=(
        "choose each lr and each run's reported round on the validation split (val: the runs need "
        "--val-fraction > 0, which keeps that share of the held-out examples apart; the table reports the "
        "test metric at the chosen round) or on the reported test examples themselves (test: optimistic, "
        "labelled so). Default: val when the runs have a validation split, else test"))
    cmp.add_argument("--force", action="store_true", help="rerun finished runs too")
    cmp.add_argument("--table-only", action="store_true", help=(
        "run nothing: the table and plots of the runs finished so far (each arm at the lrs finished for every "
        "seed; what is left out is listed), e.g. beside a compare still running in --out. The plan is the one "
        "recorded in --out (compare.json: what was last started there; --config is not read); options given "
        "override it, e.g. --seeds 0 or --lr-grid to tabulate part of it"))
    cmp.add_argument("--at-round", metavar="ROUND", help=(
        "with --table-only: the table and plots of the runs, finished or still going, as they stood at "
        "round ROUND (or 'latest': the last round every run has logged), into --out/roundROUND/; the lrs "
        "whose runs have not logged it for every seed are left out and listed"))
    cmp.add_argument("--jobs", type=int, default=1,
                     help="runs at a time, each in its own worker process (default 1). A worker starts Python "
                     "and torch and builds its own task (a few seconds), so for runs of a few seconds each, "
                     "--jobs 2 can be slower than serial; set --threads 1 with it")
    cmp.add_argument("--quiet", action="store_true", help="no progress output, only the table")
    _add_tracking_flags(cmp)
    _add_run_flags(cmp, exclude=("algorithm", "seed"))
    fl = sub.add_parser("flower", help="run on a Flower federation: a SuperLink and --nodes SuperNodes on 127.0.0.1 "
                        "(or --simulation: Flower's simulation engine)")
    fl.add_argument("--out", help="run directory to create (same files as hiso run)")
    fl.add_argument("--resume", metavar="DIR", help="continue the run in DIR whose ServerApp died (its config.json; "
                    "scalar-only algorithms)")
    fl.add_argument("--config", help="TOML file of options (flags override it)")
    fl.add_argument("--nodes", type=int, help="SuperNodes to start, node i serving partition i (default: --clients)")
    fl.add_argument("--simulation", action="store_true", help="Flower's simulation engine (Ray), one virtual node per client")
    fl.add_argument("--round-timeout", type=float, default=30.0, help="seconds a round waits for answers (default 30)")
    fl.add_argument("--tls", action="store_true", help="TLS with a CA and certificate made for 127.0.0.1")
    fl.add_argument("--auth", action="store_true", help="SuperNode authentication (a registered key per node)")
    fl.add_argument("--workdir", help="keep Flower's home, logs, keys and the nodes' replicas here")
    fl.add_argument("--worker", action="store_true", help="a long-lived worker per node holding its model in memory, "
                    "behind a thin relay ClientApp (scalar-only algorithms)")
    fl.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    fl.add_argument("--verbose", action="store_true", help="print the Flower commands and where their logs are")
    _add_run_flags(fl)
    rb = sub.add_parser("rebuild", help="rebuild a run's final model from its config and history alone")
    rb.add_argument("run_dir")
    rb.add_argument("--out", required=True, help="file to write the rebuilt model to (torch state dict)")
    rb.add_argument("--round", type=int, help="rebuild x_R, the model after the first R logged rounds (default: all)")
    ex = sub.add_parser("export", help="a run's model (any round) as a PEFT adapter, a Hugging Face model directory "
                        "or safetensors")
    ex.add_argument("run_dir")
    ex.add_argument("--out", required=True, help="directory to create (written whole or not at all)")
    ex.add_argument("--format", choices=("peft", "merged", "state-dict"), help="peft: the LoRA adapter for "
                    "PeftModel.from_pretrained; merged: a model directory for AutoModelForCausalLM.from_pretrained; "
                    "state-dict: model.safetensors (any task). Default: merged for language runs, else state-dict")
    ex.add_argument("--round", type=int, help="export x_R, rebuilt from the first R logged rounds (default: the last)")
    ex.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export "
                    "(a directory holding anything else is refused)")
    ev = sub.add_parser("eval", help="evaluate a run's model (any round) on its task, or on other data of the task")
    ev.add_argument("run_dir")
    ev.add_argument("--round", type=int, help="evaluate x_R, rebuilt from the first R logged rounds "
                    "(default: the last)")
    ev.add_argument("--data-dir", help="the task's data from here instead of the run's")
    ev.add_argument("--eval-max", type=int, help="at most this many held-out examples, a seeded subset "
                    "(default: the run's)")
    ev.add_argument("--split", choices=("dev", "test"), help="dev: the validation share (val_*, runs with "
                    "--val-fraction); test: the held-out examples a run reports (eval_*). Default: both")
    ev.add_argument("--out", help="file for the metrics (default: RUN/eval.json)")
    ev.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    dg = sub.add_parser("diagnose", help="what a HiSo run's preconditioner H learned: its range over rounds, the "
                        "effective step lr/H, per tensor, and against measured curvature (PNG + text)")
    dg.add_argument("run_dir")
    dg.add_argument("--out", help="directory for diagnose.png/.txt/.json (default: the run directory)")
    dg.add_argument("--points", type=int, default=20, help="rounds at which H is summarised (default: 20)")
    dg.add_argument("--curvature", choices=("auto", "yes", "no"), default="auto",
                    help="measure the Hessian diagonal (Hutchinson) and gradient second moment with autograd at "
                    "the final model: auto = when the model has at most --max-params numbers (default: auto)")
    dg.add_argument("--max-params", type=int, default=1_000_000, help="size limit of --curvature auto (default: 1e6)")
    dg.add_argument("--batches", type=int, default=8, help="unseen training batches for the curvature (default: 8)")
    dg.add_argument("--probes", type=int, default=4, help="Rademacher probes per batch for Hutchinson (default: 4)")
    from .tasks.lm_pack import add_cache_parser
    add_cache_parser(sub, _Parser)
    rb.add_argument("--device", default="cpu", help="where to replay the history: cpu (default, whatever device "
                    "the run used), cuda or cuda:N")
    return parser


def _fail(msg: str) -> int:
    print(f"hiso: error: {msg}", file=sys.stderr)
    return 2


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .report.table import loss_rise_note
    from .runners.rundir import clear_run, run_to_dir
    from .tasks.registry import build_task

    overrides = {k: getattr(args, k) for k in RunConfig.model_fields}
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
        from .runners.runfiles import continuation
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
        if plan.note and not args.quiet:
            print(plan.note, file=sys.stderr)
        cfg = plan.cfg
    else:
        cfg = load_config(args.config, **overrides)
        out = Path(args.out)
        if why := _new_run_refusal(cfg, out, args.force):
            return _fail(why)
    tracking = _tracking(args, out.resolve().name)
    task = build_task(cfg)
    if args.show_partition:
        hist = getattr(task, "label_hist", None)
        if hist is None:
            return _fail(f"task {cfg.task} has no labels to show")
        from .data.partition import format_histograms
        print(format_histograms(hist, max_rows=None))
    bar = tqdm(total=cfg.rounds, desc=f"{cfg.algorithm} on {cfg.task}", unit="round",
               disable=args.quiet, dynamic_ncols=True)

    rise = {"first": None, "said": False}

    def progress(row: dict) -> None:
        if row["round"] == 0:
            rise["first"] = row.get("eval_loss")
            return
        if not rise["said"] and (note := loss_rise_note(rise["first"], row, cfg.lr)):
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
              f"({summary['diverged']['error']}); rounds so far are kept in {out}/", file=sys.stderr)
        return 1
    final = ", ".join(f"{k}={v:.4g}" for k, v in summary["final"].items())
    print(f"{cfg.algorithm} on {cfg.task}: {cfg.rounds} rounds, {final}; "
          f"per client {comm['bytes_up_mean']:.0f} B up, {comm['bytes_down_mean']:.0f} B down (mean); "
          f"{summary['s_per_round'] * 1e3:.1f} ms/round; results in {out}/")
    _ending_note(cfg, out)
    return 0


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
    unused = [f"{name} ({whose})" for name, whose in cfg.unused_options().items()]
    if unused:
        print(f"hiso: note: {cfg.algorithm} does not use {'; '.join(unused)}: config.json records "
              f"{'it' if len(unused) == 1 else 'them'} as given, with no effect on the run", file=sys.stderr)
    for why in cfg.weak_aggregation():
        print(f"hiso: note: {why}", file=sys.stderr)


def _ending_note(cfg: RunConfig, out: Path) -> None:
    """Say so when a run ended well below its best evaluation (see report.table.run_ending_note)."""
    from .report.runs import read_rows
    from .report.table import higher_is_better, run_ending_note
    from .tasks.registry import task_info

    metric = next(iter(task_info(cfg.task).metrics))
    note = run_ending_note(read_rows(out), metric, higher_is_better(metric, cfg.task), out if cfg.scalar_only else None)
    if note:
        print(note)


def cmd_compare(args: argparse.Namespace) -> int:
    from .runners.compare import build_plan, compare, parse_cli, table_plan

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
    shared = {k: getattr(args, k) for k in RunConfig.model_fields if hasattr(args, k)}
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
        from .runners.compare import reached_part
        at_round = reached_part(plan, args.out, "latest")[2]
    try:
        text = compare(plan, args.out, force=args.force, quiet=args.quiet, jobs=args.jobs,
                       tracking=None if args.table_only else _tracking(args, "compare"), run=not args.table_only,
                       at_round=at_round)
    except KeyboardInterrupt as e:
        if _stopped_by(e):
            raise
        print(f"hiso: interrupted; finished runs are kept in {args.out}/runs (rerun the same command to resume)",
              file=sys.stderr)
        return 128 + signal.SIGINT
    print(text, end="")
    if not args.quiet:
        where = args.out if at_round is None else f"{args.out.rstrip('/')}/round{at_round}"
        print(f"results in {where}/ (table.md, table.csv, selection.json, *.png)")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    import torch

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
    torch.save(ckpt, out)
    print(f"rebuilt round {state.round} model from {args.run_dir} into {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .runners.export import export

    done = export(args.run_dir, args.out, args.format, round=args.round, force=args.force)
    print(f"exported round {done['round']} of {args.run_dir} as {done['format']} into {done['out']}/: "
          f"{len(done['files'])} files, {done['bytes'] / 1e6:.1f} MB, {done['seconds']:.1f} s")
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


def cmd_flower(args: argparse.Namespace) -> int:
    import importlib.util
    import json
    import os

    if importlib.util.find_spec("flwr") is None:
        return _fail("Flower is not installed: pip install -e '.[flower]'")
    from .flower.launch import FlowerRunError, run_local

    if (args.out is None) == (args.resume is None):
        return _fail("give --out DIR (a new run) or --resume DIR (one whose ServerApp died)")
    if args.resume is not None:
        from .runners.rundir import saved_config
        out = Path(args.resume)
        cfg, _ = saved_config(out)
        given = {k: getattr(args, k) for k in RunConfig.model_fields if getattr(args, k) is not None}
        changed = [k for k, v in given.items() if load_config(None, **{**cfg.model_dump(), k: v}).model_dump()[k]
                   != cfg.model_dump()[k]]
        if changed or args.config or args.force:
            return _fail(f"--resume continues {out} as its config.json says: drop "
                         f"{'--' + changed[0].replace('_', '-') if changed else '--config/--force'}")
        if (out / "summary.json").exists():
            print(f"{out} is a finished run: nothing to resume")
            return 0
        if not cfg.scalar_only:
            return _fail(f"{cfg.algorithm} runs cannot be resumed: full-model algorithms keep no log to rebuild "
                         "their state from (start again with --out DIR --force)")
    else:
        cfg = load_config(args.config, **{k: getattr(args, k) for k in RunConfig.model_fields})
        out = Path(args.out)
        if why := _new_run_refusal(cfg, out, args.force):
            return _fail(why)
    if args.resume is not None and args.simulation:
        return _fail("--resume continues a deployment (SuperLink and SuperNodes); not with --simulation")
    if cfg.drop_rate or cfg.late_rate or cfg.duplicate_rate or cfg.corrupt_rate:
        return _fail("simulated network faults (--drop-rate, ..., --corrupt-rate) are for hiso run, not flower")
    if cfg.byzantine and (cfg.byzantine_per_round or "random" in cfg.attack):
        return _fail("Flower nodes attack as fixed Byzantine clients (--byzantine K) with scale, sign-flip or nan: "
                     "not --byzantine-per-round or random")
    if cfg.secagg and args.worker:
        return _fail("--secagg runs without --worker: SecAgg+ needs the ClientApp itself to answer")
    from .flower.records import noise_seed_refusal
    if why := noise_seed_refusal(cfg):
        return _fail(why)
    nodes = cfg.clients if args.nodes is None else args.nodes
    if not args.simulation and not 1 <= nodes <= cfg.clients:
        return _fail(f"--nodes must be 1 to --clients ({cfg.clients}): node i serves partition i; got {nodes}")
    if not args.round_timeout > 0:
        return _fail(f"--round-timeout must be a positive number of seconds, got {args.round_timeout}")
    try:  # the ServerApp writes there: find out now, not after starting the federation
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(f"Permission denied: '{out}'")
    except OSError as e:
        return _fail(f"cannot write the run directory {out}: {e.strerror or e}")
    if args.force:  # none of the old run's files may stay beside the new one's
        from .runners.rundir import clear_run
        clear_run(out)
    try:
        if args.simulation:
            from .flower.sim import run_simulation
            run_simulation(cfg, out, round_timeout=args.round_timeout)
        else:
            run_local(cfg, out, nodes, tls=args.tls, auth=args.auth,
                      round_timeout=args.round_timeout, workdir=args.workdir, verbose=args.verbose,
                      resume=args.resume is not None, worker=args.worker)
    except (FlowerRunError, ValueError) as e:
        return _fail(str(e))
    summary = json.loads((out / "summary.json").read_text())
    final = ", ".join(f"{k}={v:.4g}" for k, v in summary["final"].items())
    print(f"{cfg.algorithm} on {cfg.task} over Flower: {summary['rounds_done']} rounds, {final}; "
          f"{summary['s_per_round']:.2f} s/round; results in {out}/")
    from .flower.launch import missed_answers_note
    if note := missed_answers_note(out):
        print(note)
    _ending_note(cfg, out)
    return 0


def _stopped_by(e: BaseException) -> int | None:
    """The signal (SIGTERM, SIGHUP) that stopped hiso, or None for Ctrl-C and other exceptions."""
    from .procs import Stopped
    return e.signum if isinstance(e, Stopped) and e.signum != signal.SIGINT else None


def main(argv: list[str] | None = None) -> int:
    """The ``hiso`` command. Run as a program (``argv`` None), it owns every process it starts
    (:mod:`hiso.procs`): a stop signal or an error stops them all."""
    if argv is not None:
        return _main(argv)
    from .procs import own_processes
    try:
        with own_processes():
            return _main(argv)
    except BrokenPipeError:  # the reader went away (`hiso compare ... | head`): end quietly, as a shell tool
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + signal.SIGPIPE


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    """hiso's own warnings as one line on stderr, like its errors; others as Python shows them."""
    if category.__module__.startswith("hiso."):
        print(f"hiso: warning: {message}", file=sys.stderr)
    else:
        _default(message, category, filename, lineno, file, line)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "flower":
            return cmd_flower(args)
        if args.command == "diagnose":
            return cmd_diagnose(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "cache":
            from .tasks.lm_pack import cmd_cache
            return cmd_cache(args)
        return cmd_rebuild(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # DataError is a ValueError
        return _fail(str(e))
    except KeyboardInterrupt as e:
        if sig := _stopped_by(e):
            print(f"hiso: stopped by {signal.Signals(sig).name}; every process it started is stopped, "
                  "the run directory holds every round logged so far", file=sys.stderr)
            return 128 + sig
        out = getattr(args, "out", None) or getattr(args, "resume", None)
        kept = (f"; {out} holds every round logged so far" if isinstance(out, str) and Path(out).is_dir()
                else "")
        print(f"hiso: interrupted{kept}", file=sys.stderr)
        return 128 + signal.SIGINT  # 130, as a shell reports Ctrl-C (2 is a usage error)


if __name__ == "__main__":
    sys.exit(main())
