"""Does HiSo's learned H track curvature? On the quadratic the true diagonal Hessian is known.

    python bench/h_vs_curvature.py --dims 10,100,1000 --rounds 1000

For each d: run HiSo (homogeneous clients, so only curvature and ZO noise matter) and report
the correlation of log H with log lambda, and the spread (p90/p10) of both. A ZO step's
per-coordinate signal is grad_j while its noise is about ||grad|| / sqrt(P), so the EMA of
ghat^2 can only see curvature when d is not much larger than P.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from hiso.methods.hiso_method import hiso
from hiso.runners.simulate import Simulation
from hiso.tasks.quadratic import QuadraticTask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="10,100,1000")
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--perturbations", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for d in (int(x) for x in args.dims.split(",")):
        task = QuadraticTask(20, seed=0, dim=d, sigma=args.sigma, heterogeneity=0.0)
        sim = Simulation(task, hiso(lr=args.lr, perturbations=args.perturbations), clients_per_round=4,
                         eval_every=10**9)
        for _ in sim.run(args.rounds):
            pass
        h, lam = sim.state.h[0].numpy(), task.lam.numpy()
        spread = lambda v: np.percentile(v, 90) / np.percentile(v, 10)  # noqa: E731
        print(f"d={d:6d}: corr(log H, log lambda) = {np.corrcoef(np.log(h), np.log(lam))[0, 1]:+.3f}, "
              f"H spread p90/p10 = {spread(h):.2f}, lambda spread = {spread(lam):.2f}")


if __name__ == "__main__":
    main()
