"""hiso on a Flower federation under network faults: the figures of docs/flower.md (issue 43).

Every SuperNode reaches the SuperLink through its own fault proxy on 127.0.0.1
(hiso.flower.faultproxy; this machine has no netem). Scenarios, each a fresh federation:

    baseline   proxies that inject nothing
    cut        the last node's link down (blackhole) for --cut-s, longer than --round-timeout
    cut-link   the same with every SuperNode in its own network namespace, joined by a veth
               pair, and the last pair set down (`ip link set down`: needs root; skipped otherwise)
    lossy      every link --latency-s (+ up to --jitter-s) each way, --reset-p of chunks reset
    superlink  `hiso flower --workdir W` whose SuperLink is SIGKILLed after --kill-after rounds,
               then `hiso flower --resume DIR --workdir W`

Each prints one JSON line: rounds that lost an answer, answers lost, re-plans, the nodes'
reconnections (Flower's retry lines) and failed tries, the proxies' connections, resets and
bytes, protocol bytes, wall time, and the checks (every replica bit-identical to the server,
every round recomputed in process, rounds equal to a fault-free `hiso run`).

    PYTHONPATH=src python bench/flower_faults.py [--scenarios cut,lossy] [--nodes 3 --sampled 2 --rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="baseline,cut,cut-link,lossy,superlink")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--sampled", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--algorithm", default="decomfl")
    ap.add_argument("--round-timeout", type=float, default=20.0)
    ap.add_argument("--cut-s", type=float, default=30.0)
    ap.add_argument("--latency-s", type=float, default=0.1)
    ap.add_argument("--jitter-s", type=float, default=0.02)
    ap.add_argument("--reset-p", type=float, default=0.03)
    ap.add_argument("--kill-after", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help="per-node workers (hiso flower --worker)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    known = {"baseline", "cut", "cut-link", "lossy", "superlink"}
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if bad := [s for s in chosen if s not in known]:
        ap.error(f"--scenarios: unknown {', '.join(bad)} (choose from {', '.join(sorted(known))})")
    if not 1 <= args.sampled <= args.nodes:
        ap.error("--sampled must be 1 to --nodes")

    from hiso.config import RunConfig
    from flower_fault_harness import can_make_namespaces, cut_off_one_node, superlink_killed
    cfg = RunConfig(task="quadratic", algorithm=args.algorithm, clients=args.nodes, sampled=args.sampled,
                    rounds=args.rounds, local_steps=2, perturbations=3, dim=40, lr=0.05, eval_every=100,
                    threads=1, seed=args.seed)
    root = Path(args.out or tempfile.mkdtemp(prefix="hiso-flower-faults-"))
    lossy = dict(latency_s=args.latency_s, jitter_s=args.jitter_s, reset_p=args.reset_p)
    for name in chosen:
        work = root / name
        t0, load0 = time.monotonic(), os.getloadavg()[0]
        try:
            if name == "cut-link" and not can_make_namespaces():
                print(json.dumps({"scenario": name, "skipped": "cannot make network namespaces here"}), flush=True)
                continue
            if name == "superlink":
                fig = superlink_killed(cfg, work, round_timeout=args.round_timeout, after=args.kill_after,
                                       worker=args.worker)
            else:
                fig = cut_off_one_node(cfg, work, round_timeout=args.round_timeout,
                                       cut_s=args.cut_s if name.startswith("cut") else 0.0, worker=args.worker,
                                       how="link" if name == "cut-link" else "blackhole",
                                       **(lossy if name == "lossy" else {}))
            fig["ok"] = True
        except Exception as e:  # a finding: print it with the others
            fig = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        fig.update(scenario=name, s=round(time.monotonic() - t0, 1), load_before=round(load0, 2),
                   load_after=round(os.getloadavg()[0], 2), dir=str(work))
        print(json.dumps(fig), flush=True)


if __name__ == "__main__":
    main()
