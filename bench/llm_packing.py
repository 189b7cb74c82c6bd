"""Packed vs padded forwards for a language task: CPU time per training forward and the loss gap.

    python bench/llm_packing.py --data-dir ../shared/data/sst2 [--task sst2] [--lora-r 8] [--batches 6]

The same training batches (client 0, rounds 0..batches-1, batch --batch-size) through the same
model, each loss computed padded (``pack_sequences=False``) and packed, interleaved, at --threads
threads (on --device cuda: synchronised wall seconds instead of CPU seconds). Reported: the batches' real tokens against their padded size, process CPU seconds per
forward in each layout (median), their ratio, how many batches the cost rule packed, and the
largest |loss difference| (float rounding; a ZO scalar divides it by mu).
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
    ap.add_argument("--lora-r", type=int, default=8, help="0: all parameters")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import numpy as np
    import torch

    from hiso.config import load_config
    from hiso.tasks.packed_forward import hidden_size, packing_pays
    from hiso.tasks.registry import build_task

    torch.set_num_threads(args.threads)
    tasks = {}
    for pack in (False, True):
        cfg = load_config(task=args.task, model=args.model, data_dir=args.data_dir, lora_r=args.lora_r or None,
                          autocast="none", clients=6, lr=1e-2, pack_sequences=pack)
        tasks[pack] = build_task(cfg)
    model = tasks[True].build_model().to(args.device)
    cuda = args.device.startswith("cuda")

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()
    batches = [tasks[True].batch(0, r, 0, args.batch_size) for r in range(args.batches)]
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    size = sum(b["attention_mask"].numel() for b in batches)
    packed = sum(packing_pays(b["attention_mask"], hidden_size(model)) for b in batches)
    times = {False: [], True: []}
    gap = 0.0
    with torch.no_grad():
        tasks[False].loss(model, batches[0])  # warm-up
        tasks[True].loss(model, batches[0])
        for b in batches:
            loss = {}
            for pack in (False, True):
                t = clock()
                loss[pack] = float(tasks[pack].loss(model, b))
                times[pack].append(clock() - t)
            gap = max(gap, abs(loss[True] - loss[False]))
    out = {"task": args.task, "model": args.model, "lora_r": args.lora_r, "threads": args.threads, "device": args.device,
           "batch_size": args.batch_size, "batches": args.batches, "real_tokens": real, "padded_tokens": size,
           "batches_packed": int(packed), "packing_probe": tasks[True]._pack_ok,
           "padded_cpu_s": float(np.median(times[False])), "packed_cpu_s": float(np.median(times[True])),
           "max_loss_gap": gap}
    out["packed_over_padded"] = out["packed_cpu_s"] / out["padded_cpu_s"]
    print(f"{args.task} {args.model} LoRA r={args.lora_r}, batch {args.batch_size}, {args.threads} thread(s): "
          f"{real} real of {size} padded tokens ({size / real:.2f}x); {packed}/{args.batches} batches packed; "
          f"forward {out['padded_cpu_s']:.3f} {'s' if cuda else 'CPU s'} padded, {out['packed_cpu_s']:.3f} packed "
          f"({out['packed_over_padded']:.2f}x); largest loss gap {gap:.1e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
