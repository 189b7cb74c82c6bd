"""Time and memory of a round for HiSo and DeComFL, and how much of it is direction generation.

    python bench/round_cost.py --dim 1000000 --rounds 20

Each algorithm runs in its own subprocess (so peak RSS is its own). Reported per algorithm:
seconds per round, the share of it spent on direction work (generate, scale, add; replay: see
``direction_timer.py``) with ``--directions`` (default: the default family), the ratio of a round
to the forward passes it contains, and peak RSS above the RSS after building the task and
running forwards (what inference alone costs; Linux only: the peak is reset between the two
phases through /proc/self/clear_refs). All ratios come from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def worker(args) -> dict:
    import torch

    from hiso.config import RunConfig
    from hiso.experiments.peak_rss import peak_rss_mb, reset_peak_rss
    from hiso.runners.simulate import Simulation
    from hiso.tasks.registry import build_task

    from direction_timer import DirectionTimer

    torch.set_num_threads(args.threads)
    cfg = RunConfig(task="quadratic", algorithm=args.algorithm, dim=args.dim, clients=args.clients,
                    sampled=args.sampled, perturbations=args.perturbations, local_steps=args.local_steps,
                    lr=1e-4, rounds=args.rounds, **({"directions": args.directions} if args.directions else {}))
    task = build_task(cfg)
    model = task.build_model()
    if not reset_peak_rss():
        raise SystemExit("needs Linux's /proc/self/clear_refs to measure peak memory per phase")
    with torch.no_grad():
        for _ in range(3):  # warm-up: first touches of fresh memory are not the forward's cost
            task.loss(model, task.batch(0, 0, 0, 1))
        t0 = time.perf_counter()
        for _ in range(10):
            task.loss(model, task.batch(0, 0, 0, 1))
        t_fwd = (time.perf_counter() - t0) / 10
    base_rss = peak_rss_mb()  # peak while only inference ran (task data + model + forwards)
    del model  # the simulation builds its own copy

    timer = DirectionTimer()
    sim = Simulation(task, cfg.zo(), clients_per_round=cfg.sampled, seed=0, eval_every=10**9)
    reset_peak_rss()
    with timer.installed():
        sim.step()  # warm-up (buffer allocation)
        timer.reset()
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            sim.step()
        per_round = (time.perf_counter() - t0) / args.rounds
    fwd_per_round = cfg.sampled * cfg.local_steps * (cfg.perturbations + 1)
    return {
        "algorithm": args.algorithm, "directions": cfg.directions, "dim": args.dim, "s_per_round": per_round,
        "generation_share": timer.total / args.rounds / per_round,
        "forward_s": t_fwd, "forwards_per_round": fwd_per_round,
        "round_over_forwards": per_round / (fwd_per_round * t_fwd),
        "rss_inference_mb": base_rss, "peak_rss_mb": peak_rss_mb(),
        "extra_over_inference_mb": peak_rss_mb() - base_rss,
        "param_mb": args.dim * 4 / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--sampled", type=int, default=2)
    ap.add_argument("--perturbations", type=int, default=5)
    ap.add_argument("--local-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--directions", help="direction family (default: the default family)")
    ap.add_argument("--algorithm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.algorithm:
        print(json.dumps(worker(args)))
        return
    rows = []
    for alg in ("decomfl", "hiso"):
        cmd = [sys.executable, __file__, "--algorithm", alg] + sys.argv[1:]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    for r in rows:
        print(f"{r['algorithm']:8s} {r['directions']} d={r['dim']:,}: {r['s_per_round'] * 1e3:7.1f} ms/round, "
              f"directions {100 * r['generation_share']:4.1f}% of it, round = {r['round_over_forwards']:.2f}x "
              f"its {r['forwards_per_round']} forwards, peak RSS {r['peak_rss_mb']:.0f} MB "
              f"({r['extra_over_inference_mb']:+.0f} MB over inference's peak; the parameters are {r['param_mb']:.1f} MB)")
    d, h = rows
    print(f"hiso/decomfl: time per round {h['s_per_round'] / d['s_per_round']:.2f}x, "
          f"extra memory {h['extra_over_inference_mb'] - d['extra_over_inference_mb']:+.0f} MB")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
