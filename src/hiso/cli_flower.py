"""``hiso flower``'s handler: check the options, start a loopback Flower federation, run, stop it."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_commands import _ending_note, _fail, _new_run_refusal, _with
from .config import RunConfig, load_config, option_fields
from .runners.drivers import driver_of


def _record_accepted_method(out: Path, cfg: RunConfig) -> None:
    """``--resume --accept-method-change`` of a run whose method file changed: config.json records
    the change (the earlier digest, the round it was accepted at) before the ServerApp, another
    process, reads it, as ``hiso run --resume`` records it."""
    from .atomic import write_atomic
    from .methods.identity import source_of
    from .runners.runfiles import config_text, method_source, saved_config
    old, now = method_source(out) or {}, source_of(cfg.algorithm) or {}
    if old.get("sha256") in (None, now.get("sha256")):
        return
    try:
        rows = sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        rows = 0
    write_atomic(out / "config.json", config_text(cfg, saved_config(out)[1], out, max(rows - 1, 0)))


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
        given = {k: getattr(args, k) for k in option_fields() if getattr(args, k) is not None}
        changed = [k for k, v in given.items() if _with(cfg, k, v).model_dump() != cfg.model_dump()]
        if changed or args.config or args.force:
            return _fail(f"--resume continues {out} as its config.json says: drop "
                         f"{'--' + changed[0].replace('_', '-') if changed else '--config/--force'}")
        if (out / "summary.json").exists():
            print(f"{out} is a finished run: nothing to resume")
            return 0
        if not (driver := driver_of(cfg.method)).replica_catches_up:  # (a resumed ServerApp finds the nodes' replicas)
            why = ("its nodes keep no replica that catches up on the log" if driver.keeps_log else
                   "full-model algorithms keep no log to rebuild their state from")
            return _fail(f"{cfg.algorithm} runs cannot be resumed on Flower: {why} (start again with --out DIR --force)")
        _record_accepted_method(out, cfg)
    else:
        cfg = load_config(args.config, **{k: getattr(args, k) for k in option_fields()})
        out = Path(args.out)
        if why := _new_run_refusal(cfg, out, args.force):
            return _fail(why)
        data_dir = cfg.task_options.data_dir
        if data_dir and not Path(data_dir).expanduser().exists():  # before a federation is started
            return _fail(f"--data-dir {data_dir}: directory not found")
        from .runners.portable import paths_from_here
        cfg = paths_from_here(cfg)  # the ServerApp and nodes run in other working directories
    if args.resume is not None and args.simulation:
        return _fail("--resume continues a deployment (SuperLink and SuperNodes); not with --simulation")
    if cfg.drop_rate or cfg.late_rate or cfg.duplicate_rate or cfg.corrupt_rate:
        return _fail("simulated network faults (--drop-rate, ..., --corrupt-rate) are for hiso run, not flower")
    if cfg.byzantine and (cfg.byzantine_per_round or "random" in cfg.attack):
        return _fail("Flower nodes attack as fixed Byzantine clients (--byzantine K) with scale, sign-flip or nan: "
                     "not --byzantine-per-round or random")
    if cfg.secagg and args.worker:  # (None: not given)
        return _fail("--secagg runs without --worker: SecAgg+ needs the ClientApp itself to answer")
    from .flower.records import noise_seed_refusal
    if why := noise_seed_refusal(cfg):
        return _fail(why)
    nodes = cfg.clients if args.nodes is None else args.nodes
    if not args.simulation and not 1 <= nodes <= cfg.clients:
        return _fail(f"--nodes must be 1 to --clients ({cfg.clients}): the partitions are dealt to the nodes; "
                     f"got {nodes}")
    for opt in ("round_timeout", "join_timeout"):
        if getattr(args, opt) is not None and not getattr(args, opt) > 0:
            return _fail(f"--{opt.replace('_', '-')} must be a positive number of seconds, got {getattr(args, opt)}")
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
            run_simulation(cfg, out, round_timeout=args.round_timeout or 30.0,  # (the virtual nodes' replicas)
                           state_dir=Path(args.workdir) / "replicas" if args.workdir else None,
                           **({"wait_nodes_s": args.join_timeout} if args.join_timeout else {}))
        else:
            from .flower.follow import MetricsFollower
            from .flower.launch import default_worker
            follow = MetricsFollower(out, cfg.rounds)
            worker = default_worker(cfg) if args.worker is None else args.worker
            if args.worker is None and not worker and driver_of(cfg.method).replica_catches_up and not cfg.secagg:
                print("hiso flower: --worker keeps each node's task and replica loaded between messages: faster "
                      "rounds where starting a ClientApp costs more than a round's work", flush=True)
            print(f"hiso flower: {nodes} SuperNodes serving {cfg.clients} partitions"
                  + (" (node i: partitions i, i+N, ...)" if nodes < cfg.clients else "")
                  + ("; a worker per node keeps the model loaded" if worker else "")
                  + f"; round timeout {f'{args.round_timeout:g} s' if args.round_timeout else 'from the measured rounds'}",
                  flush=True)
            try:
                run_local(cfg, out, nodes, tls=args.tls, auth=args.auth, round_timeout=args.round_timeout,
                          join_timeout=args.join_timeout, workdir=args.workdir, verbose=args.verbose,
                          resume=args.resume is not None, worker=worker, progress=follow.poll)
            finally:
                follow.poll()
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
