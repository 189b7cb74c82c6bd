"""float32 vs bfloat16-autocast forwards for ZO: speed, and the noise bf16 adds to the scalars.

    python bench/llm_precision.py --data-dir ../shared/data/sst2 --directions 8 [--lora-r 8]

Same model (float32 weights), same batch, same seeds: each ZO scalar
g = (f(x + mu z) - f(x)) / mu is computed once with float32 forwards and once under bfloat16
autocast. Reported: seconds per forward in each precision, the correlation of the two sets of
scalars, and the median relative error |g_bf16 - g_fp32| / |g_fp32|, at each --mu.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--lora-r", type=int)
    ap.add_argument("--directions", type=int, default=8)
    ap.add_argument("--mu", type=float, nargs="+", default=[1e-3, 1e-2])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import numpy as np
    import torch

    from hiso.config import load_config
    from hiso.core.directions import DirectionGenerator
    from hiso.core.perturb import Perturber, Shift
    from hiso.core.state import trainable_params
    from hiso.tasks.registry import build_task

    torch.set_num_threads(args.threads)
    cfg = load_config(task=args.task, model=args.model, data_dir=args.data_dir, lora_r=args.lora_r,
                      autocast="none", clients=6, min_size=2, lr=1e-6)
    task = build_task(cfg)
    model = task.build_model()
    params = [p for _, p in trainable_params(model)]
    pert, gen = Perturber(model, params), DirectionGenerator()
    batch = task.batch(0, 0, 0, args.batch_size)
    times = {"none": [], "bf16": []}

    @torch.no_grad()
    def f(seed=None, mu=0.0) -> float:
        t = time.perf_counter()
        with pert.at(Shift(gen, seed, mu)):
            v = float(task.loss(model, batch))
        times[task.autocast].append(time.perf_counter() - t)
        return v

    rows = []
    for mode in ("none", "bf16"):
        task.autocast = mode
        f()  # warm-up
        times[mode].clear()
        f0 = f()
        for mu in args.mu:
            for s in range(args.directions):
                rows.append({"mode": mode, "mu": mu, "seed": s, "g": (f(1000 + s, mu) - f0) / mu})
    out = {"fp32_forward_s": float(np.median(times["none"])), "bf16_forward_s": float(np.median(times["bf16"]))}
    print(f"{args.task} {args.model} {'LoRA r=' + str(args.lora_r) if args.lora_r else 'full'}, batch {args.batch_size}, "
          f"{args.threads} threads: forward fp32 {out['fp32_forward_s']:.2f} s, bf16 {out['bf16_forward_s']:.2f} s "
          f"(bf16/fp32 = {out['bf16_forward_s'] / out['fp32_forward_s']:.2f}x)")
    for mu in args.mu:
        a = np.array([r["g"] for r in rows if r["mode"] == "none" and r["mu"] == mu])
        b = np.array([r["g"] for r in rows if r["mode"] == "bf16" and r["mu"] == mu])
        corr = float(np.corrcoef(a, b)[0, 1])
        rel = float(np.median(np.abs(b - a) / np.maximum(np.abs(a), 1e-12)))
        out[f"mu={mu}"] = {"corr": corr, "median_rel_err": rel, "g_fp32": a.tolist(), "g_bf16": b.tolist()}
        print(f"  mu={mu:g}: corr(g_fp32, g_bf16) = {corr:.3f}, median |g_bf16 - g_fp32| / |g_fp32| = {rel:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
