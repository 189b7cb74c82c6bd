"""The server's time and memory per round against clients per round (m) and population (M),
and what a client downloads and replays against its sampling gap, without a model.

    python bench/scale_server.py --pop 1000 10000 --m 10 100 1000 --rounds 200 --dim 57876

Drives the core Server as a run does (plan, each participant's encoded downlink, encoded
uplinks, aggregate) with a stand-in replica of ``dim`` float32 values for the snapshot rule
(automatic threshold unless ``--snapshot-after``). Time per round: the median of the rounds
after the first tenth; memory: tracemalloc's peak over a second, traced run, in MiB (the server's
history, synced array and the round's messages). The gap table bins every downlink by how
many rounds its client had missed: mean bytes, the share sent as a snapshot, and the
directions a client replays (tau x P per missed record; 0 after a snapshot).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hiso.core.messages import Uplink, decode_uplink, encode_downlink, encode_uplink  # noqa: E402
from hiso.core.server import Server  # noqa: E402
from hiso.runners.protocol import BlobReplica  # noqa: E402


def run(M: int, m: int, rounds: int, dim: int, tau: int, P: int, snapshot_after: int | None, gaps: list | None,
        traced: bool = False):
    blob = BlobReplica(dim)
    if traced:
        tracemalloc.start()
    server = Server(M, m, tau, P, seed=0, replica=blob, snapshot_after=snapshot_after)
    wire, zeros, times = server.wire, np.zeros((tau, P), np.float32), []
    for _ in range(rounds):
        t = time.perf_counter()
        plan = server.plan()
        ups = []
        for c in plan.participants:
            gap = plan.round - int(server.synced[c])
            msg = server.downlink(c)
            data = encode_downlink(msg, wire)
            if gaps is not None:  # not in the traced run: the table's rows are not the server's memory
                gaps.append((gap, len(data), msg.snapshot is not None, len(msg.missed)))
            ups.append(decode_uplink(encode_uplink(Uplink(c, plan.round, zeros, 0.0, plan.attempt), wire), wire))
        server.aggregate(ups)
        blob.round += 1
        times.append(time.perf_counter() - t)
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    tracemalloc.stop()
    return statistics.median(times[rounds // 10:]), peak / 2**20, server.snapshot_after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pop", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--m", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--dim", type=int, default=2 * 28938, help="replica values: x and H (default: the mnist cnn, HiSo)")
    ap.add_argument("--tau", type=int, default=1)
    ap.add_argument("--perturbations", type=int, default=3)
    ap.add_argument("--snapshot-after", type=int, default=None)
    a = ap.parse_args()
    print(f"{'M':>6} {'m':>5} {'ms/round':>9} {'us/client':>9} {'peak MiB':>9} {'K':>6}")
    gaps: list = []
    for M in a.pop:
        for m in a.m:
            if m > M:
                continue
            g: list = []
            s, _, k = run(M, m, a.rounds, a.dim, a.tau, a.perturbations, a.snapshot_after, g)
            _, mib, _ = run(M, m, a.rounds, a.dim, a.tau, a.perturbations, a.snapshot_after, None, traced=True)
            print(f"{M:>6} {m:>5} {s * 1e3:>9.2f} {s / m * 1e6:>9.1f} {mib:>9.2f} {k:>6}")
            gaps = g
    print(f"\ngap table (last run: M={a.pop[-1]}, m={a.m[-1]}): missed rounds -> downlink")
    print(f"{'gap':>11} {'n':>7} {'mean B':>9} {'snapshot':>9} {'replayed dirs':>14}")
    arr = np.array([(gp, b, s, r) for gp, b, s, r in gaps], dtype=np.float64)
    edges = [0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10**9]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = arr[(arr[:, 0] >= lo) & (arr[:, 0] < hi)]
        if len(sel):
            print(f"{lo:>5}-{hi - 1 if hi < 10**9 else 'inf':>5} {len(sel):>7} {sel[:, 1].mean():>9.0f} "
                  f"{sel[:, 2].mean():>9.2f} {sel[:, 3].mean() * a.tau * a.perturbations:>14.1f}")


if __name__ == "__main__":
    main()
