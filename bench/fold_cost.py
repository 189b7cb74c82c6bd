"""The replica's fold (ModelState.apply) alone, this checkout against another, interleaved.

    python bench/fold_cost.py --other /path/to/older/checkout/src --dim 2000000 --pairs 6

Each measurement is a fresh process (one thread) that builds a 4-tensor model of ``dim``
parameters, folds 12 seeded records into it and reports the median of the last 10 folds, for
HiSo and for DeComFL with momentum and the step normalisation (the stages of the chain). The
two checkouts alternate (other, this, other, this, ...), so a slow spell of the machine hits
both; the ratio of the medians of the per-process medians is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {"hiso": {"algorithm": "hiso"}, "decomfl+momentum+step_norm": {"algorithm": "decomfl", "momentum": 0.9,
                                                                     "step_norm": "std"}}


def worker(dim: int) -> dict:
    import numpy as np
    import torch

    from hiso.config import RunConfig
    from hiso.core.history import RoundRecord
    from hiso.core.seeds import round_seeds
    from hiso.core.state import ModelState
    torch.set_num_threads(1)
    out = {}
    for name, kw in ARMS.items():
        zo = RunConfig(lr=1e-3, perturbations=5, **kw).zo()
        model = torch.nn.Sequential(*[torch.nn.Linear(1000, max(dim // 4000, 1), bias=False) for _ in range(4)])
        state = ModelState(model, zo, run_seed=0)
        times = []
        for r in range(12):
            g = np.random.default_rng(r).normal(size=(1, 5)).astype(np.float32)
            rec = RoundRecord(r, round_seeds(0, r, 0, 1, 5), g, (0,), 0)
            t = time.perf_counter()
            state.apply(rec)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times[2:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=False, help="the src/ directory of the checkout to compare against")
    ap.add_argument("--dim", type=int, default=2_000_000)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.dim)))
        return
    here = str(Path(__file__).resolve().parent.parent / "src")
    sides = {"this": here} | ({"other": args.other} if args.other else {})
    got: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(args.pairs):
        for side in reversed(list(sides)):
            env = {**os.environ, "PYTHONPATH": sides[side]}
            cmd = [sys.executable, __file__, "--worker", "--dim", str(args.dim)]
            got[side].append(json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                       text=True).stdout))
    for arm in ARMS:
        med = {side: statistics.median(r[arm] for r in rows) for side, rows in got.items()}
        line = ", ".join(f"{side} {1e3 * t:.2f} ms" for side, t in med.items())
        ratio = f"; this / other = {med['this'] / med['other']:.3f}" if "other" in med else ""
        print(f"{arm:28s} d={args.dim:,}: fold {line}{ratio}")


if __name__ == "__main__":
    main()
