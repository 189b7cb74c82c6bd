"""A client's memory and time with its frozen base held in float32, bfloat16, int8 or int4.

    python bench/base_dtype.py --data-dir ../shared/data/sst2 --lora-r 8 --algorithm decomfl --rounds 4
    python bench/base_dtype.py --data-dir ../shared/data/sst2 --lora-r 8 --model gemma3-270m --dtypes float32,int4

Each dtype runs in its own process, as a deployed client does, so its peak resident memory
(VmHWM) is its own: the task is built (the base read and held in the dtype; LoRA adapters in
float32), hiso's own count of the client's bytes is taken (resident: its model, adapters and H;
transient: one answer's peak), then ``--rounds`` rounds of the paper's federation (2 clients a
round, one shared replica: a client's answer and its fold of the round) are timed. One JSON line
per dtype: peak RSS after loading, resident memory once loading's freed pages are returned
(malloc_trim) after loading, once the mapped weight files are paged out, and after the rounds (the
working set the rounds touched again), the peak RSS of the rounds alone (VmHWM reset after hiso's
measuring answer: what a participating client needs, ``hiso plan``'s client memory), the peak RSS
of the whole process (loading's, as a rule), hiso's resident and transient bytes,
seconds a round, and the evaluation loss and accuracy after the rounds (--eval-max examples).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _vm_hwm_mb(key: str = "VmHWM") -> float:
    """The process's peak resident memory (VmHWM) or, with key="VmRSS", its resident memory now."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Reset the process's VmHWM to its resident memory now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_settled_mb() -> float:
    """Resident memory now, after the allocator returned what loading freed (glibc keeps freed
    pages otherwise): what the client holds while it takes part."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _vm_hwm_mb("VmRSS")


def _page_out_weight_files() -> None:
    """Ask the kernel to drop the resident pages of the mapped weight files (``*.safetensors``):
    transformers maps them, and the float32 tensors it keeps (all of them, or a quantized base's
    embeddings and norms) are views of the mapping. Afterwards the resident memory counts only
    the pages the rounds touch again: a client's working set, not the file it read."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                libc.madvise(lo, hi - lo, 21)  # MADV_PAGEOUT (Linux 5.4+)


def worker(args) -> None:
    import torch

    from hiso.config import load_config
    from hiso.runners.rundir import build_simulation
    from hiso.tasks.registry import build_task

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    cfg = load_config(None, task=args.task, model=args.model, data_dir=args.data_dir, lora_r=args.lora_r,
                      device=args.device,
                      algorithm=args.algorithm, base_dtype=args.worker, clients=6, sampled=2, min_size=2,
                      batch_size=args.batch_size, eval_max=args.eval_max, seed=args.seed, threads=args.threads,
                      **({"lr": args.lr} if args.lr else {}))
    t0 = time.perf_counter()
    task = build_task(cfg)
    sim = build_simulation(cfg, task)
    load_s, rss_load, rss_held = time.perf_counter() - t0, _vm_hwm_mb(), _rss_settled_mb()
    _page_out_weight_files()
    rss_paged = _rss_settled_mb()
    sim.measure_client()
    _rss_settled_mb()
    _reset_peak()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        sim.step()
    per = (time.perf_counter() - t0) / args.rounds
    rounds_peak = _vm_hwm_mb()
    ev = task.evaluate(sim.model)
    gpu = {"gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20, "gpu_now_mb": torch.cuda.memory_allocated() / 2**20,
           "gpu_name": torch.cuda.get_device_name()} if cuda else {}
    cost = sim.cost.row()
    print(json.dumps({"model": args.model, "algorithm": args.algorithm, "lora_r": args.lora_r, "base_dtype": args.worker,
                      "seed": args.seed, "rounds": args.rounds, "threads": args.threads, "load_s": load_s,
                      "peak_rss_after_load_mb": rss_load, "rss_after_load_mb": rss_held,
                      "rss_weights_paged_out_mb": rss_paged,
                      "rss_after_rounds_mb": _rss_settled_mb(), "peak_rss_rounds_mb": rounds_peak,
                      "peak_rss_mb": max(rss_load, rounds_peak), "s_per_round": per,
                      "resident_mb": (sim.cost.resident_bytes or 0) / 2**20,
                      "transient_mb": (sim.cost.transient_bytes or 0) / 2**20,
                      **gpu, **{k: v for k, v in cost.items() if "bytes" in k}, **ev}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--algorithm", default="decomfl")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,int4")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-max", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (then also CUDA's peak allocation)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    for dtype in args.dtypes.split(","):
        argv = [a for a in sys.argv[1:]]
        r = subprocess.run([sys.executable, __file__, *argv, "--worker", dtype], capture_output=True, text=True)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        print(lines[-1] if lines else json.dumps({"base_dtype": dtype, "error": r.stderr.strip().splitlines()[-1:]}),
              flush=True)


if __name__ == "__main__":
    main()
