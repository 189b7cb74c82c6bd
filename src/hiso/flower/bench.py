"""Measure hiso over Flower against the in-process simulator (docs/flower.md, Measurements).

    python -m hiso.flower.bench deploy --nodes 2 --clients 2 --sampled 2 --rounds 5 [--task mnist ...]
    python -m hiso.flower.bench sim --clients 100 --sampled 10 --rounds 10

Prints one JSON object: seconds per round (deployment or simulation engine, and the
in-process simulator on the same configuration), where a round's time goes (server side:
``flower.json``; client side: each node's ``timings.jsonl``), the protocol's payload per
client per round and the bytes the SuperLink counted on the wire, and whether the final
models are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _cfg(args):
    from ..config import load_config
    over = {k: v for k, v in vars(args).items() if k in ("task", "algorithm", "clients", "sampled", "rounds", "dim",
                                                          "local_steps", "perturbations", "batch_size", "seed", "lr",
                                                          "data_dir", "partition", "eval_max")}
    return load_config(None, eval_every=10**6, threads=1, **over)


def _same(a: Path, b: Path) -> bool:
    import torch
    x, y = torch.load(a / "model.pt", weights_only=False), torch.load(b / "model.pt", weights_only=False)
    return all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])


def _inproc(cfg, out: Path) -> dict:
    from ..runners.rundir import run_to_dir
    return run_to_dir(cfg, out)


def _client_timings(state_dir: Path) -> dict:
    rows = []
    for f in state_dir.glob("*/p*/timings.jsonl"):
        rows += [json.loads(x) for x in f.read_text().splitlines()]
    if not rows:
        return {}
    med = lambda k: float(np.median([r[k] for r in rows]))  # noqa: E731
    return {"messages": len(rows), "median_process_start_to_handler_s": med("since_process_start_s"),
            "median_open_replica_s": med("open_s"), "median_handle_s": med("handle_s")}


def _server_timings(run: Path) -> dict:
    t = json.loads((run / "flower.json").read_text())["flower"]["timings"]
    return {"median_send_and_receive_s": float(np.median([r["send_and_receive_s"] for r in t])),
            "median_aggregate_apply_s": float(np.median([r["aggregate_apply_s"] for r in t])),
            "rounds_partial": sum(r["participants"] != r["sampled"] for r in t)}


def deploy(args) -> dict:
    from .launch import LocalFederation
    cfg = _cfg(args)
    work = Path(tempfile.mkdtemp(prefix="hiso-flower-bench-"))
    t0 = time.perf_counter()
    with LocalFederation(nodes=args.nodes, workdir=work / "fed") as fed:
        t_up = time.perf_counter() - t0
        st = fed.run(cfg, work / "flower", timeout=3600, round_timeout=args.round_timeout)
        state_dir = fed.state_dir
        t_all = time.perf_counter() - t0
    s_fl = json.loads((work / "flower" / "summary.json").read_text())
    s_ip = _inproc(cfg, work / "inproc")
    comm = s_fl["communication_per_client"]
    traffic = st.get("network-traffic", {})
    per_client_round = traffic.get("total-bytes", 0) / max(cfg.rounds * cfg.sampled, 1)
    return {
        "what": "deployment", "nodes": args.nodes, "config": {k: getattr(cfg, k) for k in
                                                              ("task", "algorithm", "clients", "sampled", "rounds",
                                                               "local_steps", "perturbations")},
        "s_per_round_flower": s_fl["s_per_round"], "s_per_round_inproc": s_ip["s_per_round"],
        "startup_s": t_up, "total_s": t_all,
        "server": _server_timings(work / "flower"), "clients": _client_timings(state_dir),
        "payload_bytes_per_client": comm, "payload_bytes_per_sampled_client_round":
            (comm["bytes_up_mean"] + comm["bytes_down_mean"]) * cfg.clients / (cfg.rounds * cfg.sampled),
        "wire_bytes_superlink": traffic, "wire_bytes_per_sampled_client_round": per_client_round,
        "bit_identical_to_inproc": _same(work / "flower", work / "inproc"),
        "flower_status": st["status"], "workdir": str(work),
    }


def sim(args) -> dict:
    from .sim import run_simulation
    cfg = _cfg(args)
    work = Path(tempfile.mkdtemp(prefix="hiso-flower-sim-bench-"))
    t0 = time.perf_counter()
    s_fl = run_simulation(cfg, work / "flower", state_dir=work / "replicas", num_cpus=args.cpus)
    t_all = time.perf_counter() - t0
    s_ip = _inproc(cfg, work / "inproc")
    return {"what": "simulation engine", "virtual_nodes": cfg.clients, "sampled": cfg.sampled, "rounds": cfg.rounds,
            "s_per_round_flower_sim": s_fl["s_per_round"], "s_per_round_inproc": s_ip["s_per_round"],
            "total_s_including_ray_start": t_all, "server": _server_timings(work / "flower"),
            "clients": _client_timings(work / "replicas"), "peak_rss_mb_server": s_fl["peak_rss_mb"],
            "bit_identical_to_inproc": _same(work / "flower", work / "inproc"), "workdir": str(work)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hiso.flower.bench")
    p.add_argument("what", choices=["deploy", "sim"])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus", type=int, default=None, help="Ray CPUs (sim)")
    p.add_argument("--round-timeout", type=float, default=120.0)
    for k, t in (("task", str), ("algorithm", str), ("clients", int), ("sampled", int), ("rounds", int), ("dim", int),
                 ("local_steps", int), ("perturbations", int), ("batch_size", int), ("seed", int), ("lr", float),
                 ("data_dir", str), ("partition", str), ("eval_max", int)):
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=t)
    args = p.parse_args(argv)
    out = deploy(args) if args.what == "deploy" else sim(args)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
