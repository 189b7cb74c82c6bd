"""Measure hiso over Flower against the in-process simulator (docs/flower.md, Measurements).

    python bench/flower_rounds.py deploy --nodes 2 --clients 2 --sampled 2 --rounds 5 [--task mnist ...]
    python bench/flower_rounds.py sim --clients 100 --sampled 10 --rounds 10 [--secagg [--secagg-shares 21]]
    python bench/flower_rounds.py secagg --sampled-list 3,5,10 --rounds 3 [--task mnist ...]

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
    from hiso.config import load_config
    over = {k: v for k, v in vars(args).items() if k in ("task", "algorithm", "clients", "sampled", "rounds", "dim",
                                                          "local_steps", "perturbations", "batch_size", "seed", "lr",
                                                          "data_dir", "partition", "alpha", "min_size",
                                                          "eval_max", "secagg", "secagg_shares", "secagg_bits")
            and v is not None}
    return load_config(None, eval_every=10**6, threads=1, **over)


def _same(a: Path, b: Path) -> bool:
    """The two runs' final models (and H) and their logs are the same, bit for bit."""
    import torch
    from hiso.core.history import read_history
    x, y = torch.load(a / "model.pt", weights_only=False), torch.load(b / "model.pt", weights_only=False)
    log = [[(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in read_history(d / "history.bin")[2]]
           for d in (a, b)]
    return (log[0] == log[1] and all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])
            and all(torch.equal(x["h"][k], y["h"][k]) for k in x.get("h") or {}))


def _inproc(cfg, out: Path) -> dict:
    from hiso.runners.rundir import run_to_dir
    return run_to_dir(cfg, out)


def _client_timings(state_dir: Path) -> dict:
    rows = []
    for f in state_dir.glob("*/p*/timings.jsonl"):
        rows += [json.loads(x) for x in f.read_text().splitlines()]
    if not rows:
        return {}
    med = lambda k: float(np.median([r[k] for r in rows if r.get(k) is not None]))  # noqa: E731
    if all(r.get("worker") for r in rows):  # a long-lived worker: no process per message
        return {"messages": len(rows), "median_open_s": med("open_s"), "median_handle_s": med("handle_s"),
                "median_relay_cpu_before_send_s": med("relay_cpu_before_send_s")}
    out = {"messages": len(rows), "median_process_start_to_handler_s": med("since_process_start_s"),
           "median_open_replica_s": med("open_s"), "median_handle_s": med("handle_s")}
    if all("cpu_handler_s" in r for r in rows):  # CPU seconds: comparable whatever the load
        out.update(median_cpu_before_handler_s=med("cpu_before_handler_s"), median_cpu_handler_s=med("cpu_handler_s"),
                   total_cpu_clientapps_s=float(sum(r["cpu_before_handler_s"] + r["cpu_handler_s"] for r in rows)))
    return out


def _load() -> list[float]:
    """The machine's load average (1, 5, 15 min): how busy it was while we measured."""
    import os
    return [round(x, 2) for x in os.getloadavg()]


def _server_timings(run: Path) -> dict:
    t = json.loads((run / "flower.json").read_text())["flower"]["timings"]
    return {"median_send_and_receive_s": float(np.median([r["send_and_receive_s"] for r in t])),
            "median_aggregate_apply_s": float(np.median([r["aggregate_apply_s"] for r in t])),
            "median_join_s": float(np.median([r.get("join_s", 0.0) for r in t])),
            "rounds_partial": sum(r["participants"] != r["sampled"] for r in t),
            **({"median_secagg_stage_s": [float(np.median([r["secagg_stages"][i]["s"] for r in t])) for i in range(4)],
                "median_secagg_record_bytes_per_round": float(np.median([sum(s["bytes_down"] + s["bytes_up"]
                                                                             for s in r["secagg_stages"]) for r in t]))}
               if t and "secagg_stages" in t[0] else {})}


class CountingProxy:
    """A TCP relay on 127.0.0.1 that counts the bytes each way (what the nodes really send and
    receive from the SuperLink: HTTP, headers and all)."""

    def __init__(self, listen_port: int, target_port: int):
        import socket
        import threading
        self.up = self.down = 0  # node -> SuperLink, SuperLink -> node
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", listen_port))
        self._target = target_port
        self._threads = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading
        while True:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            try:
                t = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                c.close()
                continue
            for a, b, up in ((c, t, True), (t, c, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, a, b, up: bool) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
                with self._lock:
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
        except OSError:
            pass
        finally:
            for x in (a, b):
                try:
                    x.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._srv.close()


def deploy(args) -> dict:
    from hiso.flower.launch import LocalFederation, free_port
    cfg = _cfg(args)
    load0 = _load()
    work = Path(tempfile.mkdtemp(prefix="hiso-flower-bench-"))
    t0 = time.perf_counter()
    link, relay = free_port(), free_port()
    proxy = CountingProxy(relay, link)
    with LocalFederation(nodes=args.nodes, workdir=work / "fed", port=link, node_link_port=relay,
                         worker=args.worker) as fed:
        t_up = time.perf_counter() - t0
        idle0 = (proxy.up, proxy.down)
        time.sleep(args.idle_s)  # what idle nodes cost on the wire (polling, heartbeats)
        idle = ((proxy.up - idle0[0]) + (proxy.down - idle0[1])) / max(args.idle_s, 1e-9) / args.nodes
        run0 = (proxy.up, proxy.down)
        t_run = time.perf_counter()
        st = fed.run(cfg, work / "flower", timeout=3600, round_timeout=args.round_timeout,
                     wait_nodes_s=args.wait_nodes_s)
        run_s = time.perf_counter() - t_run
        run_bytes = {"up": proxy.up - run0[0], "down": proxy.down - run0[1]}
        state_dir = fed.state_dir
        t_all = time.perf_counter() - t0
    proxy.close()
    s_fl = json.loads((work / "flower" / "summary.json").read_text())
    s_ip = _inproc(cfg, work / "inproc")
    comm = s_fl["communication_per_client"]
    traffic = st.get("network-traffic", {})
    per_client_round = traffic.get("total-bytes", 0) / max(cfg.rounds * cfg.sampled, 1)
    return {
        "what": "deployment" + (" with per-node workers" if args.worker else ""), "nodes": args.nodes, "config": {k: getattr(cfg, k) for k in
                                                              ("task", "algorithm", "clients", "sampled", "rounds",
                                                               "local_steps", "perturbations")},
        "s_per_round_flower": s_fl["s_per_round"], "s_per_round_inproc": s_ip["s_per_round"],
        "startup_s": t_up, "total_s": t_all,
        "server": _server_timings(work / "flower"), "clients": _client_timings(state_dir),
        "payload_bytes_per_client": comm, "payload_bytes_per_sampled_client_round":
            (comm["bytes_up_mean"] + comm["bytes_down_mean"]) * cfg.clients / (cfg.rounds * cfg.sampled),
        "superlink_counted_bytes": traffic, "superlink_counted_bytes_per_sampled_client_round": per_client_round,
        "tcp_bytes_nodes_superlink_during_run": run_bytes,
        "tcp_bytes_per_sampled_client_round": (run_bytes["up"] + run_bytes["down"]) / max(cfg.rounds * cfg.sampled, 1),
        "tcp_bytes_per_idle_node_per_s": idle, "run_s": run_s,
        # the same less what the nodes would have sent idle for as long (polling, heartbeats)
        "tcp_bytes_per_sampled_client_round_less_idle":
            (run_bytes["up"] + run_bytes["down"] - idle * args.nodes * run_s) / max(cfg.rounds * cfg.sampled, 1),
        "bit_identical_to_inproc": _same(work / "flower", work / "inproc"),
        "flower_status": st["status"], "workdir": str(work), "loadavg_before": load0, "loadavg_after": _load(),
    }


def _round_seconds(run: Path) -> list[float]:
    """Each round's wall seconds, from the run's metrics rows (evaluations excluded)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    walls = [0.0] + [r["wall_s"] for r in rows if r["round"] > 0]
    return [b - a for a, b in zip(walls, walls[1:])]


class _ChildMemory:
    """The peak resident memory of this process's descendants (Ray's GCS, raylet and workers),
    sampled every 0.5 s while it is entered: the largest process and their largest sum."""

    def __enter__(self):
        import threading
        self.peak_sum = self.peak_one = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        import psutil
        me = psutil.Process()
        while not self._stop.wait(0.5):
            rss = []
            for p in me.children(recursive=True):
                try:
                    rss.append(p.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
            self.peak_sum, self.peak_one = max(self.peak_sum, sum(rss)), max([self.peak_one, *rss])

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def sim(args) -> dict:
    """The simulation engine against the in-process run of the same configuration, which runs
    first in a child process (so that each peak resident memory is its own run's)."""
    import multiprocessing
    from hiso.flower.sim import run_simulation
    cfg = _cfg(args)
    load0 = _load()
    work = Path(tempfile.mkdtemp(prefix="hiso-flower-sim-bench-"))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        s_ip = pool.apply(_inproc, (cfg, work / "inproc"))
    t0 = time.perf_counter()
    with _ChildMemory() as ray_mem:
        s_fl = run_simulation(cfg, work / "flower", state_dir=work / "replicas", num_cpus=args.cpus,
                              round_timeout=args.round_timeout, wait_nodes_s=args.wait_nodes_s)
    t_all = time.perf_counter() - t0
    rs_fl, rs_ip = _round_seconds(work / "flower"), _round_seconds(work / "inproc")
    replicas = list((work / "replicas").glob("*/p*/replica.bin"))
    return {"what": "simulation engine", "virtual_nodes": cfg.clients, "sampled": cfg.sampled, "rounds": cfg.rounds,
            "s_per_round_flower_sim": s_fl["s_per_round"], "s_per_round_inproc": s_ip["s_per_round"],
            "round_s_flower_sim": rs_fl, "round_s_inproc": rs_ip,
            "median_round_s_after_first_flower_sim": float(np.median(rs_fl[1:] or rs_fl)),
            "median_round_s_after_first_inproc": float(np.median(rs_ip[1:] or rs_ip)),
            "total_s_including_ray_start": t_all, "server": _server_timings(work / "flower"),
            "clients": _client_timings(work / "replicas"), "peak_rss_mb_server": s_fl["peak_rss_mb"],
            "peak_rss_mb_inproc": s_ip["peak_rss_mb"], "peak_rss_mb_ray_largest_process": ray_mem.peak_one,
            "peak_rss_mb_ray_all_processes": ray_mem.peak_sum, "replicas": len(replicas),
            "replica_bytes": sum(f.stat().st_size for f in replicas),
            "bit_identical_to_inproc": _same(work / "flower", work / "inproc"), "workdir": str(work),
            "loadavg_before": load0, "loadavg_after": _load()}


def secagg_cost(args) -> dict:
    """What SecAgg+ adds to a round, without the transport: the same federation over Flower's
    messages delivered in process (:class:`hiso.flower.loopback.LoopbackGrid`: real ClientApps
    with the mod, the real workflow), plain and ``--secagg``, for each number of sampled clients
    (all sampled): seconds and CPU seconds per round (medians; every client's and the server's
    work, in this one process), the bytes of the round's messages' records per client (Flower's
    serialisation, without the message envelope), and the SecAgg+ stages' share of it. A
    deployment adds Flower's cost per message on top: a plain round is one message per client,
    a SecAgg+ round four."""
    from hiso.flower.app import FlowerFederation, Settings, serve
    from hiso.flower.loopback import LoopbackGrid, server_task
    from hiso.flower.secagg import SecAggFederation
    work = Path(tempfile.mkdtemp(prefix="hiso-secagg-bench-"))
    load0, out = _load(), {}
    for n in args.sampled_list:
        row = {}
        for secure in (False, True):
            args.clients = args.sampled = n
            args.secagg = secure or None
            cfg = _cfg(args)
            run = work / f"n{n}-{'secagg' if secure else 'plain'}"
            cpu = []
            fed_cls = SecAggFederation if secure else FlowerFederation
            step = fed_cls.step

            def timed(self, step=step):  # CPU of a round: every client's and the server's work
                c0 = time.process_time()
                try:
                    return step(self)
                finally:
                    cpu.append(time.process_time() - c0)
            with server_task():
                grid = LoopbackGrid(cfg, run / "replicas", {100 + p: p for p in range(n)})
                fed_cls.step = timed
                try:
                    serve(grid, cfg, Settings(out_dir=str(run / "out"), round_timeout=5, poll_s=0.0,
                                              suspect_grace_s=0.0))
                finally:
                    fed_cls.step = step
            timings = json.loads((run / "out" / "flower.json").read_text())["flower"]["timings"]
            walls = [t["nodes_s"] + t["send_and_receive_s"] + t["aggregate_apply_s"] for t in timings]
            train = grid.bytes["train"]
            r = {"median_s_per_round": float(np.median(walls)), "median_cpu_s_per_round": float(np.median(cpu)),
                 "record_bytes_per_client_round": (train[0] + train[1]) / (n * cfg.rounds)}
            if secure:
                stages = [t["secagg_stages"] for t in timings]
                r["stages"] = {name: {"s": float(np.median([st[i]["s"] for st in stages])),
                                      "bytes_per_client": float(np.median([(st[i]["bytes_down"] + st[i]["bytes_up"]) / n
                                                                           for st in stages]))}
                               for i, name in enumerate(("setup", "share_keys", "collect_masked_vectors", "unmask"))}
            row["secagg" if secure else "plain"] = r
        row["bit_identical_to_inproc"] = _same(run / "out", _inproc_dir(cfg, work / f"n{n}-inproc"))
        out[f"sampled={n}"] = row
    return {"what": "SecAgg+ over Flower's messages in process", "config": {k: getattr(cfg, k) for k in (
        "task", "algorithm", "rounds", "local_steps", "perturbations", "secagg_clip", "secagg_bits",
        "secagg_modulus_bits")}, **out, "workdir": str(work), "loadavg_before": load0, "loadavg_after": _load()}


def _inproc_dir(cfg, out: Path) -> Path:
    _inproc(cfg, out)
    return out


def replica_cost(args) -> dict:
    """Per-message cost of a node's state for a d-parameter model, without Flower's overhead:
    the memory-mapped replica (open + commit; the round's replay itself is the same whatever
    holds the state) against carrying the model in ``Context.state`` (an ArrayRecord built from
    the state dict and read back, as the SuperNode ships it into and out of each ClientApp)."""
    import torch
    from torch import nn

    from hiso.core import ModelState, RoundRecord, ZOConfig
    from hiso.flower.replica import Replica
    out = {}
    for d in args.dims:
        zo = ZOConfig(lr=1e-3, perturbations=1)
        make = lambda: nn.Linear(d, 1, bias=False)  # noqa: E731
        root = Path(tempfile.mkdtemp(prefix="hiso-replica-cost-"))
        Replica.open(root, "k", 0, ModelState(make(), zo)).close()
        rec = RoundRecord(0, np.array([[7]], np.uint64), np.array([[0.1]], np.float32))
        t = {"build_x0_s": [], "mmap_open_s": [], "replay_one_round_s": [], "commit_s": []}
        for i in range(args.repeat):
            tb = time.perf_counter()
            st = ModelState(make(), zo)  # every ClientApp process builds the model skeleton (x_0)
            t0 = time.perf_counter()
            rep = Replica.open(root, "k", 0, st)
            t1 = time.perf_counter()
            t["build_x0_s"].append(t0 - tb)
            rep.begin()
            rep.state.apply(RoundRecord(rep.state.round, rec.seeds, rec.scalars))
            t2 = time.perf_counter()
            rep.commit()
            rep.close()
            t3 = time.perf_counter()
            t["mmap_open_s"].append(t1 - t0); t["replay_one_round_s"].append(t2 - t1); t["commit_s"].append(t3 - t2)
        row = {k: float(np.median(v)) for k, v in t.items()}
        try:
            from flwr.app import ArrayRecord
            sd = nn.Linear(d, 1, bias=False).state_dict()
            c = []
            for i in range(args.repeat):
                t0 = time.perf_counter()
                ar = ArrayRecord(sd)  # into the context ...
                blob = ar.deflate()   # ... serialised to cross the process boundary ...
                back = ArrayRecord.inflate(blob, children={k: v for k, v in ar.children.items()} if hasattr(ar, "children") else None)
                back.to_torch_state_dict()  # ... and back into a model
                c.append(time.perf_counter() - t0)
            row["context_state_one_way_s"] = float(np.median(c))
        except Exception as e:  # noqa: BLE001 - a Flower API difference must not hide the replica numbers
            row["context_state_one_way_s"] = f"not measured: {type(e).__name__}: {e}"
        out[f"d={d}"] = row
    return {"what": "replica cost per message", "threads": torch.get_num_threads(), **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/flower_rounds.py")
    p.add_argument("what", choices=["deploy", "sim", "replica", "secagg"])
    p.add_argument("--secagg", action="store_true", default=None, help="deploy, sim: with secure aggregation")
    p.add_argument("--sampled-list", type=lambda x: [int(v) for v in x.split(",")], default=[3, 5, 10],
                   help="secagg: the numbers of (all sampled) clients to measure")
    p.add_argument("--dims", type=lambda x: [int(v) for v in x.split(",")], default=[10**4, 10**6, 10**7])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus", type=int, default=None, help="Ray CPUs (sim)")
    p.add_argument("--round-timeout", type=float, default=120.0)
    p.add_argument("--worker", action="store_true", help="deploy: a long-lived worker per node behind the relay ClientApp")
    p.add_argument("--wait-nodes-s", type=float, default=300.0, help="how long the ServerApp waits for every node")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle federation measured on the wire")
    for k, t in (("task", str), ("algorithm", str), ("clients", int), ("sampled", int), ("rounds", int), ("dim", int),
                 ("local_steps", int), ("perturbations", int), ("batch_size", int), ("seed", int), ("lr", float),
                 ("data_dir", str), ("partition", str), ("alpha", float), ("min_size", int), ("eval_max", int),
                 ("secagg_shares", int), ("secagg_bits", int)):
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=t)
    args = p.parse_args(argv)
    out = {"deploy": deploy, "sim": sim, "replica": replica_cost, "secagg": secagg_cost}[args.what](args)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
