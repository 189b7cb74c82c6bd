"""The ``hiso`` command: run an experiment into a directory, or rebuild a model from its log."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import warnings
from pathlib import Path

from .cli_commands import (_ending_note, _fail, _stopped_by,  # noqa: F401
                           cmd_compare, cmd_diagnose, cmd_eval, cmd_export,
                           cmd_plan, cmd_rebuild, cmd_run)
from .cli_flower import cmd_flower
from .cli_flags import (_add_accept_flag, _add_run_flags, _add_tracking_flags, _add_where_flags,  # noqa: F401
                        _help_task, field_choices, field_help, lr_defaults, lr_help, shown_default)
from .config import ALGORITHMS, ConfigError


class _Formatter(argparse.HelpFormatter):
    """argparse's, keeping a help text's own line breaks (--lr's defaults: one line a task)."""

    def _split_lines(self, text, width):
        split = super()._split_lines
        return [line for part in text.split("\n") for line in split(part, width)]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # no prefixes: `hiso run --round 5` would silently mean --rounds (--round is rebuild's, export's, eval's)
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        first = next((w for w in message.split()[2:] if w.startswith("--")), None)
        if message.startswith("unrecognized arguments:") and first is not None:
            message += self._hint(first.partition("=")[0])
        self.exit(2, f"hiso: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)  # for _hint: which command was asked
        return super().parse_args(args, namespace)

    def _hint(self, flag: str) -> str:
        """Where an unknown flag belongs: the nearest flag of the command given, and the other
        commands that take it as it is."""
        from .config_parse import nearest
        subs = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        command = next((w for w in getattr(self, "_argv", []) if w in subs), None)
        if command is None:
            return ""
        own = {o for a in subs[command]._actions for o in a.option_strings}
        elsewhere = [c for c, p in subs.items() if c != command and flag in p._option_string_actions]
        where = f" ({flag} is for hiso {', '.join(elsewhere)})" if elsewhere else ""
        return where + nearest(flag, own)


def build_parser(lr_task: str | None = None) -> argparse.ArgumentParser:
    """``hiso``'s parser; ``lr_task``: the task whose default lrs --lr's help lists (None: every one)."""
    parser = _Parser(prog="hiso", description="Federated zeroth-order fine-tuning with scalar-only communication.")
    from ._version import __version__
    parser.add_argument("--version", action="version", version=f"hiso {__version__}")
    parser.add_argument("-v", "--verbose-log", dest="verbosity", action="count", default=0,
                        help="say more of what hiso does (its log at info; -vv: debug)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None,
                        help="the level of hiso's log on stderr (default: warning; -v: info)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run one algorithm on one task into --out DIR")
    run.add_argument("--out", help="run directory to create")
    run.add_argument("--resume", metavar="DIR", nargs="?", const=True,
                     help="continue the interrupted run in DIR (its config.json; options that would change it are "
                     "refused). With --out DIR and no value: continue DIR if it holds this same run, start it if "
                     "DIR is empty, absent or has no config.json yet, refuse if DIR holds another run")
    run.add_argument("--config", help="TOML file of options (flags override it)")
    run.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.add_argument("--show-partition", action="store_true", help="print each client's label histogram")
    _add_accept_flag(run)
    _add_tracking_flags(run)
    _add_run_flags(run, lr_task=lr_task)
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
    cmp.add_argument("--target", type=float, help=(
        "a second target for the frontier (frontier.md, .csv, .png), in the metric's units (0.80: 80 %% "
        "accuracy): each arm's rounds, bytes, client compute and memory to reach it, Pareto-optimal arms marked "
        "(default: the config's [compare] target)"))
    cmp.add_argument("--select-on", choices=("val", "test"), help=(
        "choose each lr and each run's reported round on the validation split (val: the runs need "
        "--val-fraction > 0, which keeps that share of the held-out examples apart; the table reports the "
        "test metric at the chosen round) or on the reported test examples themselves (test: optimistic, "
        "labelled so). Default: val when the runs have a validation split, else test"))
    cmp.add_argument("--force", action="store_true", help="rerun finished runs too")
    cmp.add_argument("--accept-method-change", action="store_true", help=(
        "run again the runs of an arm whose method file (your own Method subclass) changed since they were made "
        "(without it they are refused, naming the arms and the part that changed; with --table-only they are left "
        "out of the table)"))
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
    cmp.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the table")
    _add_tracking_flags(cmp)
    _add_run_flags(cmp, exclude=("algorithm", "seed"), lr_task=lr_task)
    fl = sub.add_parser("flower", help="run on a Flower federation: a SuperLink and --nodes SuperNodes on 127.0.0.1 "
                        "(or --simulation: Flower's simulation engine)")
    fl.add_argument("--out", help="run directory to create (same files as hiso run)")
    fl.add_argument("--resume", metavar="DIR", help="continue the run in DIR whose ServerApp died (its config.json; "
                    "scalar-only algorithms)")
    fl.add_argument("--config", help="TOML file of options (flags override it)")
    fl.add_argument("--nodes", type=int, help="SuperNodes to start (default: --clients); the --clients partitions "
                    "are dealt to them in turn: node i serves partitions i, i+N, ...")
    fl.add_argument("--simulation", action="store_true", help="Flower's simulation engine (Ray), one virtual node per client")
    fl.add_argument("--round-timeout", type=float, help="seconds a round waits for answers (default: round 1 up to "
                    "a bound scaled with a model load, then 5x the slowest of the last 3 rounds, at least 30 s)")
    fl.add_argument("--join-timeout", type=float, help="seconds to wait for the nodes to join before round 1 "
                    "(default: 60 s plus 10 model loads per partition of a node)")
    fl.add_argument("--tls", action="store_true", help="TLS with a CA and certificate made for 127.0.0.1")
    fl.add_argument("--auth", action="store_true", help="SuperNode authentication (a registered key per node)")
    fl.add_argument("--workdir", help="keep Flower's home, logs, keys and the nodes' replicas here")
    fl.add_argument("--worker", action=argparse.BooleanOptionalAction, help="a long-lived worker per node holding its "
                    "model in memory, behind a thin relay ClientApp (scalar-only algorithms; the default for language "
                    "tasks, --no-worker: a ClientApp process that loads the model per message)")
    fl.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    fl.add_argument("--accept-method-change", action="store_true", help=(
        "with --resume: continue a run whose method file (your own Method subclass) changed since it was made "
        "(without it the run is refused, naming the part that changed); config.json records the change"))
    fl.add_argument("--verbose", action="store_true", help="print the Flower commands and where their logs are")
    _add_run_flags(fl, lr_task=lr_task)
    rb = sub.add_parser("rebuild", help="rebuild a run's final model from its config and history alone")
    rb.add_argument("run_dir", help="the run directory (what hiso run --out wrote)")
    rb.add_argument("--out", required=True, help="file to write the rebuilt model to (torch state dict)")
    rb.add_argument("--round", type=int, help="rebuild x_R, the model after the first R logged rounds (default: all)")
    _add_accept_flag(rb)
    ex = sub.add_parser("export", help="a run's model (any round) as a PEFT adapter, a Hugging Face model directory "
                        "or safetensors")
    ex.add_argument("run_dir", help="the run directory (what hiso run --out wrote)")
    ex.add_argument("--out", required=True, help="directory to create (written whole or not at all)")
    ex.add_argument("--format", choices=("peft", "merged", "state-dict"), help="peft: the LoRA adapter for "
                    "PeftModel.from_pretrained; merged: a model directory for AutoModelForCausalLM.from_pretrained; "
                    "state-dict: model.safetensors (any task). Default: merged for language runs, else state-dict")
    ex.add_argument("--round", type=int, help="export x_R, rebuilt from the first R logged rounds (default: the last)")
    ex.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the floating dtype a merged model or state dict is written in (an adapter is written "
                    "as trained, float32); a quantized base is merged in float32 first")
    ex.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export "
                    "(a directory holding anything else is refused)")
    ex.add_argument("--base-dir", metavar="DIR", help="--format peft: the adapter names DIR as its base "
                    "(base_model_name_or_path), and the run's base model is written there unless DIR holds it "
                    "already (default: the hub id the base came from, when known)")
    _add_accept_flag(ex)
    ev = sub.add_parser("eval", help="evaluate a run's model (any round) on its task, or on other data of the task")
    ev.add_argument("run_dir", help="the run directory (what hiso run --out wrote)")
    ev.add_argument("--round", type=int, help="evaluate x_R, rebuilt from the first R logged rounds "
                    "(default: the last)")
    ev.add_argument("--data-dir", help="the task's data from here instead of the run's")
    ev.add_argument("--eval-max", type=int, help="at most this many held-out examples, a seeded subset "
                    "(default: the run's)")
    ev.add_argument("--split", choices=("dev", "test"), help="dev: the validation share (val_*, runs with "
                    "--val-fraction); test: the held-out examples a run reports (eval_*). Default: both")
    ev.add_argument("--out", help="file for the metrics (default: RUN/eval.json)")
    ev.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    _add_accept_flag(ev)
    dg = sub.add_parser("diagnose", help="what a HiSo run's preconditioner H learned: its range over rounds, the "
                        "effective step lr/H, per tensor, and against measured curvature (PNG + text)")
    dg.add_argument("run_dir", help="the run directory (what hiso run --out wrote)")
    dg.add_argument("--out", help="directory for diagnose.png/.txt/.json (default: the run directory)")
    dg.add_argument("--points", type=int, default=20, help="rounds at which H is summarised (default: 20)")
    dg.add_argument("--curvature", choices=("auto", "yes", "no"), default="auto",
                    help="measure the Hessian diagonal (Hutchinson) and gradient second moment with autograd at "
                    "the final model: auto = when the model has at most --max-params numbers (default: auto)")
    dg.add_argument("--max-params", type=int, default=1_000_000, help="size limit of --curvature auto (default: 1e6)")
    dg.add_argument("--batches", type=int, default=8, help="unseen training batches for the curvature (default: 8)")
    dg.add_argument("--probes", type=int, default=4, help="Rademacher probes per batch for Hutchinson (default: 4)")
    pl = sub.add_parser("plan", help="before running: each method's bytes, compute and memory per client and the "
                        "server's per round, for a model size, population and schedule, beside FedAvg's")
    size = pl.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=int, help="the model's trainable parameters (d)")
    size.add_argument("--task", help="a built-in task whose model is counted (with --model for the LM tasks)")
    size.add_argument("--params-model", help="a language model, counted from its structure with its client's "
                      "memory by --base-dtype: a size (1B, 8B: an assumed Llama-3 shape), a short name, a local "
                      "directory with a config.json or a hub name")
    pl.add_argument("--model", help="the LM tasks' model name (see hiso run --model)")
    pl.add_argument("--lora-r", type=int, help="LoRA rank: d is the adapters' (default: full parameters)")
    pl.add_argument("--base-dtype", choices=("float32", "bfloat16", "int8", "int4"), default="float32",
                    help="how a LoRA client holds the frozen base, as hiso run's (default: float32)")
    pl.add_argument("--quantize-embedding", action=argparse.BooleanOptionalAction, default=True,
                    help="under --base-dtype int8/int4, the embedding and head int8 per row, as hiso run's (default: on)")
    pl.add_argument("--clients", type=int, required=True, help="population (M)")
    pl.add_argument("--sampled", type=int, required=True, help="clients per round (m)")
    pl.add_argument("--rounds", type=int, required=True, help="rounds")
    pl.add_argument("--local-steps", type=int, default=1, help="tau (default: 1)")
    pl.add_argument("--perturbations", type=int, default=5, help="P (default: 5)")
    pl.add_argument("--scalar-dtype", default="float32",
                    choices=("float32", "float16", "bfloat16", "int8", "int4", "int2", "sign"),
                    help="the scalars' format on the wire and in the log, as hiso run's (default: float32)")
    pl.add_argument("--bandwidth", type=float, help="a client's link in bytes/s (adds seconds; the snapshot rule "
                    "weighs replay against download)")
    pl.add_argument("--forward-s", type=float, default=0.0, help="seconds of one client forward (default: 0)")
    pl.add_argument("--snapshot-after", type=int, help="snapshot rule (default: automatic)")
    pl.add_argument("--difference", choices=("forward", "central"), help="the ZO methods' finite difference "
                    "(default: each method's own: forward; central for feedsign and fedkseed)")
    pl.add_argument("--ferret-k", type=int, help="ferret, sketch, fedkrso: K directions per block (default: as hiso run)")
    pl.add_argument("--ferret-blocks", type=int, help="ferret, sketch, fedkrso: B blocks (default: as hiso run)")
    pl.add_argument("--sketch-bits", type=int, help="sketch: bits per projection (default: as hiso run)")
    pl.add_argument("--seed-pool", type=int, help="fedkseed: K seeds in the pool (default: as hiso run)")
    pl.add_argument("--seed-sampling", choices=("weighted", "uniform"), help="fedkseed: how a step draws its seed "
                    "(default: weighted; its pool directions materialised are then a bound, uniform's are exact)")
    pl.add_argument("--methods", default="hiso,decomfl,fedavg", help="comma-separated, any of hiso run's "
                    "--algorithm (default: hiso,decomfl,fedavg)")
    pl.add_argument("--seed", type=int, default=0, help="the run seed: who is sampled when (default: 0)")
    for p in (rb, ex, ev):
        _add_where_flags(p, data=p is not ev)
    run.add_argument("--method-file", metavar="FILE", help="with --resume: the run's method file (your own Method "
                     "subclass) is here now (checked against its sha256 in config.json)")
    from .tasks.lm_pack import add_cache_parser
    add_cache_parser(sub, _Parser)
    rb.add_argument("--device", default="cpu", help="where to replay the history: cpu (default, whatever device "
                    "the run used), cuda or cuda:N")
    for p in sub.choices.values():  # -v after the command too (hiso run -v), as before it (hiso -v run)
        p.add_argument("-v", "--verbose-log", dest="verbosity", action="count", default=argparse.SUPPRESS,
                       help="say more of what hiso does (as hiso -v COMMAND)")
    return parser


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


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes (it may be replaced)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _log_level(args) -> None:
    """hiso's loggers (``hiso.*``: faults, Flower, ...) on stderr at the level asked for."""
    name = args.log_level or {0: "warning", 1: "info"}.get(args.verbosity, "debug")
    level = getattr(logging, name.upper())
    logger = logging.getLogger("hiso")
    logger.setLevel(min(level, logger.level or logging.WARNING))
    handler = next((h for h in logger.handlers if getattr(h, "_hiso", False)), None)
    if handler is None:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("hiso: %(levelname)s: %(message)s"))
        handler._hiso = True
        logger.addHandler(handler)
    handler.setLevel(level)  # (a run's own loggers, e.g. faults.log's at info, pass through it)


def _main(argv: list[str] | None) -> int:
    args = build_parser(_help_task(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    _log_level(args)
    from .methods.identity import ACCEPT
    from .runners.portable import RELOCATED
    token = ACCEPT.set(bool(getattr(args, "accept_method_change", False)))
    where = RELOCATED.set(_relocated(args))
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _command(args)
    finally:
        RELOCATED.reset(where)
        ACCEPT.reset(token)


def _relocated(args: argparse.Namespace) -> dict:
    """Where the user says a run's inputs are now (rebuild, export, eval, run --resume)."""
    if args.command not in ("rebuild", "export", "eval", "run"):
        return {}
    keys = ("method_file",) if args.command == "run" else ("model", "method_file") if args.command == "eval" \
        else ("data_dir", "model", "method_file")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None)}


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
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "cache":
            from .tasks.lm_pack import cmd_cache
            return cmd_cache(args)
        return cmd_rebuild(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # DataError is a ValueError
        return _fail(str(e))
    except OSError as e:  # a full disk: named in one line; every file written so far is whole (hiso.atomic)
        from .atomic import disk_full
        if not disk_full(e):
            raise
        out = getattr(args, "out", None) or getattr(args, "resume", None)
        kept = (f"; {out} holds every round logged so far: free space and continue it with --resume"
                if args.command == "run" and isinstance(out, str) else "")
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"a write failed: {where}{e.strerror or 'no space left on device'}{kept}")
    except KeyboardInterrupt as e:
        out = getattr(args, "out", None) or getattr(args, "resume", None)
        kept = (f"; {out} holds every round logged so far" if isinstance(out, str) and Path(out).is_dir()
                else "")
        # (hiso flower has said how to continue it, with the federation's work directory)
        again = f" (continue it: hiso run --resume {out})" if kept and args.command == "run" else ""
        if sig := _stopped_by(e):
            print(f"hiso: stopped by {signal.Signals(sig).name}; every process it started is stopped{kept}{again}",
                  file=sys.stderr)
            return 128 + sig
        print(f"hiso: interrupted{kept}{again}", file=sys.stderr)
        return 128 + signal.SIGINT  # 130, as a shell reports Ctrl-C (2 is a usage error)


if __name__ == "__main__":
    sys.exit(main())
