"""Where an LLM round's time and memory go: forwards, direction generation, the rest; peak RSS
of a training round against inference alone on the same batch.

    python bench/llm_round.py --data-dir ../shared/data/sst2 --lora-r 8 --rounds 3
    python bench/llm_round.py --data-dir ../shared/data/sst2 --rounds 2          # full parameters
    python bench/llm_round.py --data-dir ../shared/data/sst2 --rounds 3 --device cuda
    python bench/llm_round.py --data-dir ../shared/data/sst2 --rounds 3 --device cuda --perturb-mode batched

On a GPU every timer synchronizes the device and the memory reported is also CUDA's peak
allocation (peak RSS is then the host's share only).

One process per invocation (peak RSS is its own; Linux's /proc/self/clear_refs resets the peak
between the inference phase and the training phase). A simulated round is m clients' local
updates (tau (P + 1) forwards each; hooks perturbation: each perturbed layer's direction is
generated inside the forward; batched: the P + 1 points in one stacked forward, their shifted
tensors built before it) plus the server's replay of the round's record, which is exactly
what a client pays per missed round when it catches up. All shares come from the same run.

"Directions" is all direction work, timed at the outermost call of the generator's ``fill``,
``shift`` (generate, scale by mu H^{-1/2}, add: fused in one pass for the Philox families) and
``combine`` (sum_p g_p u_p, then H^{-1/2}); the part of it done inside a forward (hooks
perturbation) is taken out of the forwards' share. ``--directions`` picks the family.
"""

from __future__ import annotations

import argparse
import json
import time

from llm_setup import add_model_args, body_params, model_config, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, autocast="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--directions", default=None, help="direction family (default: the config's default)")
    ap.add_argument("--perturb-mode", default="hooks", help="hooks, swap or batched")
    ap.add_argument("--batch-memory", default=None, help="batched mode's budget of stacked tensors, e.g. 4G")
    args = ap.parse_args()

    import torch

    from direction_timer import DirectionTimer
    from hiso.core.state import ModelState
    from hiso.experiments.peak_rss import peak_rss_mb, reset_peak_rss
    from hiso.runners.simulate import Simulation
    from hiso.tasks.registry import build_task

    cuda, sync = start(args)
    cfg = model_config(args, perturb_mode=args.perturb_mode, batch_memory=args.batch_memory,
                       **({"directions": args.directions} if args.directions else {}))
    t0 = time.perf_counter()
    task = build_task(cfg)
    model = task.build_model()
    load_s = time.perf_counter() - t0
    batch = task.batch(0, 0, 0, args.batch_size)
    if not reset_peak_rss():
        raise SystemExit("needs Linux's /proc/self/clear_refs to measure peak memory per phase")
    with torch.no_grad():
        for _ in range(2):  # warm-up: first touches of the weights' pages
            task.loss(model, batch)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            task.loss(model, batch)
        sync()
        t_fwd = (time.perf_counter() - t0) / 3
    rss_inference = peak_rss_mb()
    gpu_inference = torch.cuda.max_memory_allocated() / 2**20 if cuda else None

    timers = {"forward": 0.0, "apply": 0.0}
    dirs = DirectionTimer(sync)

    def timed_loss(m, b):
        dirs.forward = True
        sync()
        t = time.perf_counter()
        try:
            return loss(m, b)
        finally:
            sync()
            timers["forward"] += time.perf_counter() - t
            dirs.forward = False

    def timed_apply(self, rec):
        sync()
        t = time.perf_counter()
        apply(self, rec)
        sync()
        timers["apply"] += time.perf_counter() - t

    patch = dirs.installed()  # kept referenced: a collected context manager would undo the patch
    patch.__enter__()  # for the rest of this process
    inner = getattr(task, "task", task)  # under --device the task is wrapped (OnDevice): time the task's own loss
    loss, apply = inner.loss, ModelState.apply
    inner.loss = timed_loss
    ModelState.apply = timed_apply
    task._spare = model  # the simulation takes the model inference used (one copy in memory)
    sim = Simulation(task, cfg.zo(), clients_per_round=2, seed=0, batch_size=args.batch_size, eval_every=10**9,
                     perturb_mode=cfg.perturb_mode, batch_memory=cfg.batch_memory_bytes)
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sim.step()  # warm-up: scratch buffers
    for k in timers:
        timers[k] = 0.0
    dirs.reset()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        sim.step()
    sync()
    total = time.perf_counter() - t0
    R = args.rounds
    fwd = (timers["forward"] - dirs.in_forward) / R
    gen = dirs.total / R
    per = total / R
    n_fwd = 2 * cfg.local_steps * (cfg.perturbations + 1)
    # work of the round's forwards, a lower bound: 2 x non-embedding parameters x tokens (the
    # attention products and the label head left out)
    body = body_params(sim.state.model)
    flops = 2 * body * int(batch["attention_mask"].numel()) * n_fwd
    out = {
        "task": args.task, "model": args.model, "lora_r": args.lora_r, "algorithm": args.algorithm,
        "directions": cfg.directions, "autocast": getattr(task, "autocast", "none"), "threads": args.threads, "batch_size": args.batch_size,
        "trainable_params": sum(p.numel() for p in sim.state.params), "load_s": load_s,
        "s_per_round": per, "forwards_s": fwd, "directions_s": gen, "rest_s": per - fwd - gen,
        "forward_alone_s": t_fwd, "forwards_per_round": n_fwd, "round_over_forwards_alone": per / (n_fwd * t_fwd),
        "catch_up_s_per_missed_round": timers["apply"] / R, "perturb_mode": cfg.perturb_mode,
        "forward_tflop": flops / 1e12, "tflops_round": flops / per / 1e12, "tflops_forwards": flops / fwd / 1e12,
        "rss_inference_mb": rss_inference, "peak_rss_round_mb": peak_rss_mb(), "device": args.device,
        "gpu_name": torch.cuda.get_device_name(args.device) if cuda else None,
        "gpu_inference_mb": gpu_inference,
        "gpu_peak_round_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    }
    print(f"{args.task} {args.model} {'LoRA r=' + str(args.lora_r) if args.lora_r else 'full'} "
          f"({out['trainable_params']:,} trainable), {args.algorithm}, {cfg.directions}, autocast {out['autocast']}, {args.threads} threads:")
    print(f"  {per:.2f} s/round = forwards {fwd:.2f} s ({100 * fwd / per:.0f}%) + directions {gen:.2f} s "
          f"({100 * gen / per:.0f}%) + rest {per - fwd - gen:.2f} s; round = {out['round_over_forwards_alone']:.2f}x "
          f"its {n_fwd} forwards alone ({t_fwd:.2f} s each); perturbation {cfg.perturb_mode}")
    print(f"  work: {flops / 1e12:.2f} TFLOP of forwards a round: {out['tflops_round']:.3f} TFLOP/s over the round, "
          f"{out['tflops_forwards']:.3f} over its forwards")
    print(f"  catch-up: {out['catch_up_s_per_missed_round']:.2f} s per missed round; peak RSS: inference "
          f"{rss_inference:.0f} MB, training round {out['peak_rss_round_mb']:.0f} MB "
          f"({out['peak_rss_round_mb'] - rss_inference:+.0f} MB)")
    if cuda:
        print(f"  {out['gpu_name']}: CUDA peak allocation: inference {gpu_inference:.0f} MB, training round "
              f"{out['gpu_peak_round_mb']:.0f} MB ({out['gpu_peak_round_mb'] - gpu_inference:+.0f} MB)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
