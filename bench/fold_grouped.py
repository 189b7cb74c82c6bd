"""The replica's fold of one round: a launch per tensor against one grouped launch (CUDA, Triton),
on SmolLM2-135M's 272 parameter shapes (134.5M elements), for DeComFL and HiSo at P = 5.

    python bench/fold_grouped.py --device cuda --rounds 12
    python bench/fold_grouped.py --device cpu --layers 2 --rounds 3    # CPU: both are the per-tensor fold

Two replicas from the same x_0 fold the same records, one per-tensor (``chain.GROUPED = False``)
and one grouped, interleaved round by round; each fold is synchronised and timed, the median of
all rounds but the first two reported, and the two replicas' states compared bit for bit at the end.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from grouped_shift import LAYERS, smollm2_shapes
from hiso.config import RunConfig
from hiso.core import chain
from hiso.core.history import RoundRecord
from hiso.core.seeds import round_seeds
from hiso.core.state import ModelState


def _replica(shapes, algorithm: str, device: str) -> ModelState:
    torch.manual_seed(0)
    m = torch.nn.Module()
    for j, s in enumerate(shapes):
        m.register_parameter(f"p{j}", torch.nn.Parameter(torch.randn(s, device=device) * 0.02))
    return ModelState(m, RunConfig(algorithm=algorithm, lr=1e-5, perturbations=5).zo(), run_seed=0)


def _timed(state: ModelState, rec: RoundRecord, grouped: bool, cuda: bool) -> float:
    chain.GROUPED = grouped
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    state.apply(rec)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=LAYERS, help="fewer layers for a quick check (default: 30)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    shapes = smollm2_shapes(args.layers)
    n = sum(int(np.prod(s)) for s in shapes)
    name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    print(f"device: {name}, {len(shapes)} tensors, {n:,} elements, P = 5, philox-rademacher")
    print("| method | per tensor (ms) | grouped (ms) | speed-up | bits equal |")
    print("|---|---:|---:|---:|---|")
    res = {"device": name, "tensors": len(shapes), "elements": n}
    for algorithm in ("decomfl", "hiso"):
        a, b = _replica(shapes, algorithm, args.device), _replica(shapes, algorithm, args.device)
        ta, tb = [], []
        for r in range(args.rounds):
            g = np.random.default_rng(r).normal(size=(1, 5)).astype(np.float32)
            rec = RoundRecord(r, round_seeds(0, r, 0, 1, 5), g, (0,), 0)
            ta.append(_timed(a, rec, False, cuda))
            tb.append(_timed(b, rec, True, cuda))
        chain.GROUPED = True
        sa, sb = a.state_dict(), b.state_dict()
        equal = all(torch.equal(sa[part][k], sb[part][k]) for part in ("model", "h") if part in sa for k in sa[part])
        pa, pb = statistics.median(ta[2:] or ta), statistics.median(tb[2:] or tb)
        print(f"| {algorithm} | {pa * 1e3:.2f} | {pb * 1e3:.2f} | {pa / pb:.2f}x | {'yes' if equal else 'NO'} |")
        res[algorithm] = {"per_tensor_ms": round(pa * 1e3, 3), "grouped_ms": round(pb * 1e3, 3), "bits_equal": equal}
    print(json.dumps({"bench": "fold_grouped", **res}))


if __name__ == "__main__":
    main()
