"""Hooks against batched perturbation on one model, in one process: a client's local update
(tau (P + 1) forwards) timed in each mode, the modes interleaved so both see the same machine
load, with the same batch and seeds; the scalars of the modes compared.

    python bench/perturb_modes.py --data-dir ../shared/data/sst2 --lora-r 8 --reps 5
    python bench/perturb_modes.py --data-dir ../shared/data/sst2 --reps 3            # full parameters
    python bench/perturb_modes.py --data-dir ../shared/data/sst2 --lora-r 8 --device cuda

Reports per mode the median seconds per local update, the ratio batched / hooks (below 1:
batched is faster), a single forward's time alone and the achieved TFLOP/s of the update's
forwards (2 x non-embedding parameters x tokens per forward: a lower bound on the work, the
attention products and the label head are left out), and the largest scalar difference.
Also the process's CPU seconds per update: at ``--threads 1`` on a shared machine a steadier
measure of the work than wall time (other processes lengthen the wall, not the CPU time,
though they still share caches and memory bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llm_setup import add_model_args, body_params, model_config, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, autocast="none")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--perturbations", type=int, default=5)
    ap.add_argument("--batch-memory", default=None, help="batched mode's budget, e.g. 4G (default: the run default)")
    ap.add_argument("--modes", default="hooks,batched")
    args = ap.parse_args()

    import numpy as np
    import torch

    from hiso.config import parse_size
    from hiso.core.estimator import local_update
    from hiso.core.perturb import Perturber
    from hiso.core.state import ModelState
    from hiso.tasks.registry import build_task

    cuda, sync = start(args)
    cfg = model_config(args, perturbations=args.perturbations)
    task = build_task(cfg)
    state = ModelState(task.build_model(), cfg.zo())
    batch = task.batch(0, 0, 0, args.batch_size)
    tokens = int(batch["attention_mask"].numel()) if isinstance(batch, dict) and "attention_mask" in batch else None
    body = body_params(state.model)
    modes = args.modes.split(",")
    budget = parse_size(args.batch_memory) if args.batch_memory else None
    perturbers = {m: Perturber(state.model, state.params, m, budget) for m in modes}
    tau, P = cfg.zo().shape
    seeds = (np.arange(tau * P, dtype=np.uint64) + 12345).reshape(tau, P)

    def update(mode):
        return local_update(state, perturbers[mode], task.loss, [batch] * tau, seeds)

    with torch.no_grad():
        for _ in range(2):
            task.loss(state.model, batch)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            task.loss(state.model, batch)
        sync()
        t_fwd = (time.perf_counter() - t0) / 3
    scalars = {m: update(m).scalars for m in modes}  # warm-up, and the scalars compared
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for m in modes:
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            update(m)
            sync()
            times[m].append(time.perf_counter() - t0)
            cpu[m].append(time.process_time() - c0)
    n_fwd = tau * (P + 1)
    flops = 2 * body * tokens * n_fwd if tokens else None
    out = {"task": args.task, "model": args.model, "lora_r": args.lora_r, "device": args.device,
           "gpu_name": torch.cuda.get_device_name(args.device) if cuda else None, "threads": args.threads,
           "batch_size": args.batch_size, "tokens_per_forward": tokens, "forwards_per_update": n_fwd,
           "trainable_params": sum(p.numel() for p in state.params), "forward_alone_s": t_fwd, "reps": args.reps,
           "s_per_update": {m: statistics.median(t) for m, t in times.items()},
           "all_s": times, "cpu_s_per_update": {m: statistics.median(t) for m, t in cpu.items()}}
    out["update_over_forwards_alone"] = {m: s / (n_fwd * t_fwd) for m, s in out["s_per_update"].items()}
    if flops:
        out["tflops"] = {m: flops / s / 1e12 for m, s in out["s_per_update"].items()}
    if "hooks" in modes and "batched" in modes:
        out["batched_over_hooks"] = out["s_per_update"]["batched"] / out["s_per_update"]["hooks"]
        out["batched_over_hooks_cpu"] = out["cpu_s_per_update"]["batched"] / out["cpu_s_per_update"]["hooks"]
        out["max_scalar_diff"] = float(np.abs(scalars["batched"] - scalars["hooks"]).max())
        out["max_abs_scalar"] = float(np.abs(scalars["hooks"]).max())
    what = f"LoRA r={args.lora_r}" if args.lora_r else "full"
    print(f"{args.task} {args.model} {what}, {n_fwd} forwards of {args.batch_size} examples per update, "
          f"{args.threads} threads, {args.device}; one forward alone {t_fwd:.3f} s")
    for m in modes:
        s = out["s_per_update"][m]
        tf = f", {out['tflops'][m]:.3f} TFLOP/s" if flops else ""
        print(f"  {m:8s} {s:.3f} s per update (median of {args.reps}) = {out['update_over_forwards_alone'][m]:.2f}x "
              f"its forwards alone{tf}; CPU {out['cpu_s_per_update'][m]:.3f} s")
    if "batched_over_hooks" in out:
        print(f"  batched / hooks = {out['batched_over_hooks']:.3f} (CPU time: {out['batched_over_hooks_cpu']:.3f}); largest scalar difference "
              f"{out['max_scalar_diff']:.2e} (largest scalar {out['max_abs_scalar']:.2e})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
