"""Does ``torch.compile`` make a language model's training forward cheaper? Eager vs compiled.

    python bench/llm_compile.py --data-dir ../shared/data/sst2 --lora-r 8 --threads 1
    python bench/llm_compile.py --data-dir ../shared/data/sst2 --lora-r 8 --no-pack
    python bench/llm_compile.py --data-dir ../shared/data/sst2 --device cuda --mode reduce-overhead

The same training batches (client 0, rounds 0..batches-1) through one model, eager and then with
``model.forward`` compiled (``--mode``: default, reduce-overhead (CUDA graphs on a GPU),
max-autotune-no-cudagraphs; ``--dynamic``). Reported: the first compiled pass over the batches
(compilation included, wall seconds), the median time per forward eager and compiled (CPU seconds on a CPU,
synchronised wall seconds on a GPU) and their ratio, the largest loss gap between them, and the
same gap at a perturbed point: the compiled model run under swap perturbation (every trainable
tensor pointed at its shifted value for the forward), which is how a compiled forward would
serve a ZO step. A gap at the perturbed point as small as at the base point says the compiled
graph reads the parameters it is given rather than values baked in when it was traced.
"""

from __future__ import annotations

import argparse
import json
import time

from llm_setup import add_model_args, model_config, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, autocast="auto")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--mode", default="default", help="torch.compile mode")
    ap.add_argument("--dynamic", choices=("auto", "true", "false"), default="auto",
                    help="torch.compile's dynamic (auto: recompile as dynamic on a second shape)")
    ap.add_argument("--no-pack", action="store_true", help="padded batches instead of one packed row")
    args = ap.parse_args()

    import numpy as np
    import torch

    from hiso.core.directions import DirectionGenerator
    from hiso.core.perturb import Perturber, Shift
    from hiso.tasks.registry import build_task

    cuda, sync = start(args)
    cfg = model_config(args, pack_sequences=not args.no_pack)
    task = build_task(cfg)
    model = task.build_model().to(args.device).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [task.batch(0, r, 0, args.batch_size) for r in range(args.batches)]

    def clock() -> float:
        if cuda:
            sync()
            return time.perf_counter()
        return time.process_time()

    def losses(times: list | None = None) -> list[float]:
        out = []
        for b in batches:
            t = clock()
            out.append(float(task.loss(model, b)))
            if times is not None:
                times.append(clock() - t)
        return out

    gen = DirectionGenerator(cfg.directions)
    shift = Shift(gen, seed=123, scale=cfg.mu)
    swap = Perturber(model, params, mode="swap")

    def perturbed() -> float:
        with swap.at(shift):
            return float(task.loss(model, batches[0]))

    with torch.no_grad():
        losses()  # warm-up
        eager_t: list[float] = []
        eager = losses(eager_t)
        eager_p = perturbed()
        dyn = {"auto": None, "true": True, "false": False}[args.dynamic]
        model.forward = torch.compile(model.forward, mode=args.mode, dynamic=dyn)
        sync()
        t = time.perf_counter()  # wall: compilation runs in worker processes too
        losses()
        sync()
        first = time.perf_counter() - t
        comp_t: list[float] = []
        comp = losses(comp_t)
        comp_p = perturbed()
    unit = "s" if cuda else "CPU s"
    out = {"task": args.task, "model": args.model, "lora_r": args.lora_r, "device": args.device,
           "threads": args.threads, "mode": args.mode, "dynamic": args.dynamic, "packed": not args.no_pack,
           "autocast": task.autocast, "batches": args.batches, "first_compiled_pass_s": first,
           "eager_s": float(np.median(eager_t)), "compiled_s": float(np.median(comp_t)),
           "max_loss_gap": max(abs(a - b) for a, b in zip(eager, comp)),
           "perturbed_loss_gap": abs(eager_p - comp_p), "perturbation_moves_loss": abs(eager_p - eager[0])}
    out["eager_over_compiled"] = out["eager_s"] / out["compiled_s"]
    print(f"{args.task} {args.model} LoRA r={args.lora_r} on {args.device}, {args.threads} thread(s), "
          f"{'packed' if out['packed'] else 'padded'}, compile mode {args.mode}: forward {out['eager_s']:.3f} {unit} "
          f"eager, {out['compiled_s']:.3f} compiled ({out['eager_over_compiled']:.2f}x); first compiled pass "
          f"{first:.1f} s wall; loss gap {out['max_loss_gap']:.1e} (at a perturbed point {out['perturbed_loss_gap']:.1e}, "
          f"which moves the loss by {out['perturbation_moves_loss']:.1e})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
