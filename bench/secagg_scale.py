"""What SecAgg+ costs a round at 10, 100 and 500 clients (issue 44): plain mean, SecAgg+ with every
client sharing with every other (the complete graph), and with its sparse graph (``secagg_shares``).

The federation runs over Flower's messages delivered in process (:class:`hiso.flower.loopback.
LoopbackGrid`: real ClientApps with the mod, the real workflow, hiso's ServerApp), one process,
so each ClientApp call's CPU is timed apart from the server's. Per round (the median of the
rounds run): each client's CPU seconds (mean and max over the round's clients), the server's CPU
seconds (the round's CPU less the clients' and the loopback's own copying and byte counting), the
round's wall seconds, and the bytes of the records of its messages per client, both ways
(Flower's serialisation without the message envelope), per SecAgg+ stage.

Where a full round would take hours on this machine (the complete graph at 500 clients: each
client secret-shares two keys into n shares with threshold n / 2, O(n^2) field operations in
pycryptodome's pure Python; the server recombines each client's seed from the n shares it got,
O(n^2) each, O(n^3) a round), ``--model``
times one client's cryptography and a few of the server's recombinations at that size instead,
with Flower's own functions, and scales them by the protocol's counts (an estimate, said so in
its output; checked against a measured round with ``--model`` at a size that also runs).

    PYTHONPATH=src python bench/secagg_scale.py --n 10,100 --arms plain,full,sparse --shares 5,21 --rounds 3
    PYTHONPATH=src python bench/secagg_scale.py --model 100,500
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

TASK = dict(task="quadratic", algorithm="hiso", dim=40, local_steps=2, perturbations=3, lr=0.05, threads=1,
            eval_every=10**6)
STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")


def _stage(msg) -> str:
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
    rec = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    return str(rec["stage"]) if rec is not None else msg.metadata.message_type


def timed_grid(cfg, state_dir: Path, nodes: dict[int, int]):
    """A LoopbackGrid that times each ClientApp call (CPU, per node) and counts each message's
    record bytes per stage; ``overhead`` is the loopback's own CPU (copies, byte counting)."""
    from hiso.flower.loopback import LoopbackGrid
    from hiso.flower.secagg import payload_bytes

    class Timed(LoopbackGrid):
        def __init__(self, *a):
            super().__init__(*a)
            self.node_cpu, self.client_cpu, self.overhead = defaultdict(float), 0.0, 0.0
            self.stage_bytes = defaultdict(int)
            app = self.app

            def call(msg, ctx):
                stage, down = _stage(msg), payload_bytes(msg.content)
                c0 = time.process_time()
                rep = app(msg, ctx)
                c = time.process_time() - c0
                self.node_cpu[msg.metadata.dst_node_id] += c
                self.client_cpu += c
                up = 0 if rep.has_error() else payload_bytes(rep.content)
                self.stage_bytes[stage] += down + up
                return rep
            self.app = call

        def push_messages(self, msgs):
            c0, cl0 = time.process_time(), self.client_cpu
            try:
                return super().push_messages(msgs)
            finally:
                self.overhead += (time.process_time() - c0) - (self.client_cpu - cl0)
    return Timed(cfg, state_dir, nodes)


def grid_bits(n: int) -> int:
    """The default 24 grid bits, or fewer where n answers would overflow the 32-bit modulus."""
    return min(24, 32 - math.ceil(math.log2(n + 1)))


def measure(n: int, arm: str, shares: int | None, rounds: int, work: Path) -> dict:
    """Run ``rounds`` rounds of ``n`` clients (all sampled) for one arm; per-round medians."""
    from hiso.config import RunConfig
    from hiso.flower.app import FlowerFederation, Settings, serve
    from hiso.flower.loopback import server_task
    from hiso.flower.secagg import SecAggFederation
    extra = {} if arm == "plain" else {"secagg": True, **({"secagg_shares": shares} if arm == "sparse" else {}),
                                       "secagg_bits": grid_bits(n)}
    cfg = RunConfig(**TASK, clients=n, sampled=n, rounds=rounds, **extra)
    out = work / f"n{n}-{arm}{shares or ''}"
    grid = timed_grid(cfg, out / "replicas", {100 + p: p for p in range(n)})
    fed_cls = SecAggFederation if cfg.secagg else FlowerFederation
    step, rows = fed_cls.step, []

    def timed(self):
        snap = (time.process_time(), time.perf_counter(), grid.client_cpu, grid.overhead, dict(grid.node_cpu),
                dict(grid.stage_bytes))
        try:
            return step(self)
        finally:
            cpu, wall = time.process_time() - snap[0], time.perf_counter() - snap[1]
            client, over = grid.client_cpu - snap[2], grid.overhead - snap[3]
            per_node = [grid.node_cpu[k] - snap[4].get(k, 0.0) for k in grid.node_cpu]
            rows.append({"wall_s": wall, "server_cpu_s": cpu - client - over, "clients_cpu_s": client,
                         "client_cpu_s_mean": client / n, "client_cpu_s_max": max(per_node),
                         "bytes_per_client": {k: (v - snap[5].get(k, 0)) / n for k, v in grid.stage_bytes.items()
                                              if v - snap[5].get(k, 0)}})
    with server_task():
        fed_cls.step = timed
        try:
            serve(grid, cfg, Settings(out_dir=str(out / "out"), round_timeout=60, poll_s=0.0, suspect_grace_s=0.0))
        finally:
            fed_cls.step = step
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    stages = {k: statistics.median(r["bytes_per_client"].get(k, 0) for r in rows) for k in rows[-1]["bytes_per_client"]}
    return {"n": n, "arm": arm, "shares": shares if arm == "sparse" else (n if arm == "full" else None),
            "threshold": cfg.secagg_threshold, "bits": cfg.secagg_bits if cfg.secagg else None, "rounds": len(rows),
            **{k: med(k) for k in ("wall_s", "server_cpu_s", "clients_cpu_s", "client_cpu_s_mean", "client_cpu_s_max")},
            "bytes_per_client": sum(stages.values()), "bytes_per_client_by_stage": stages}


def model(n: int, shares: int, threshold: int, repeat: int = 20) -> dict:
    """One client's SecAgg+ cryptography with ``shares`` - 1 neighbours and the server's unmask
    of one client with every neighbour present, timed with Flower's functions (CPU s); the round's totals scale
    them by n. What it leaves out: hiso's training, Flower's (de)serialisation, the workflow's
    bookkeeping (all O(n shares) or less)."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import (bytes_to_private_key, bytes_to_public_key, generate_key_pairs,
                                                      private_key_to_bytes, public_key_to_bytes)
    shape = [(TASK["local_steps"] * TASK["perturbations"] + 2,)]  # the scalars, the loss, Flower's weight
    keys = [generate_key_pairs() for _ in range(2)]
    sk, pk = private_key_to_bytes(keys[0][0]), public_key_to_bytes(keys[1][1])
    c = time.process_time()
    for _ in range(2):
        generate_key_pairs()
    setup = time.process_time() - c
    c = time.process_time()
    seed_shares = create_shares(os.urandom(32), threshold, shares)
    key_shares = create_shares(sk, threshold, shares)
    split = time.process_time() - c
    c = time.process_time()
    for _ in range(repeat):  # per neighbour: a key agreement and an encryption, then (collect) the reverse and a mask
        k = generate_shared_key(bytes_to_private_key(sk), bytes_to_public_key(pk))
        ct = encrypt(k, seed_shares[0] + key_shares[0] + bytes(16))
        decrypt(k, ct)
        pseudo_rand_gen(generate_shared_key(bytes_to_private_key(sk), bytes_to_public_key(pk)), 2**32, shape)
    per_neighbour = (time.process_time() - c) / repeat
    c, repeat = time.process_time(), 2 if shares <= 100 else 1
    for _ in range(repeat):  # the server: each client's seed rebuilt from all its neighbours' shares (Flower
        pseudo_rand_gen(combine_shares(seed_shares), 2**32, shape)  # passes every share it got), and its mask
    per_client_unmask = (time.process_time() - c) / repeat
    client = setup + split + (shares - 1) * per_neighbour
    return {"n": n, "shares": shares, "threshold": threshold, "estimate": True,
            "client_cpu_s": client, "client_split_s": split, "client_per_neighbour_s": per_neighbour,
            "clients_cpu_s": n * client, "server_cpu_s": n * per_client_unmask,
            "server_unmask_per_client_s": per_client_unmask}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda x: [int(v) for v in x.split(",") if v]  # noqa: E731
    p.add_argument("--n", type=ints, default=[], help="clients a round (all sampled), measured")
    p.add_argument("--arms", default="plain,full,sparse")
    p.add_argument("--shares", type=ints, default=[5, 21], help="sparse: the shares at each --n (the last repeats)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", type=ints, default=[], help="clients a round, estimated (complete graph and sparse)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hiso-secagg-scale-"))
    print(json.dumps({"loadavg": os.getloadavg(), "cpu": _cpu(), "workdir": str(work)}), flush=True)
    for i, n in enumerate(args.n):
        k = args.shares[min(i, len(args.shares) - 1)]
        for arm in args.arms.split(","):
            print(json.dumps(measure(n, arm, k, args.rounds, work)), flush=True)
    for i, n in enumerate(args.model):
        k = args.shares[min(i, len(args.shares) - 1)]
        for shares in (n, k):
            print(json.dumps(model(n, shares, max(2, min(shares, n) // 2 + 1))), flush=True)
    print(json.dumps({"loadavg": os.getloadavg()}), flush=True)
    return 0


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
