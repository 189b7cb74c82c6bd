"""Peak memory of a small run: full-MNIST CNN run on the authors' schedule, and its parts.

    python bench/memory_small.py --data-dir PATH/TO/mnist --rounds 50 --out /tmp/mem

prints one JSON line per measurement: the peak RSS (ru_maxrss) of a fresh process that (a)
imports torch, (b) imports hiso's modules, (c) runs ``hiso run`` (64 clients, 8 sampled, batch
32, P = 5, tau = 1, full 10,000-image evaluation every 25 rounds), and the seconds one
evaluation on the 10,000 test images takes at eval chunks of 128 and 500. Each in its own
process, so one peak does not hide another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, resource, sys, time
what = sys.argv[1]
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if what == "torch":
    import torch
elif what == "hiso":
    import hiso.cli, hiso.runners.rundir, hiso.experiments.compare, hiso.config
    getattr(hiso.config, "task_names", lambda: None)()  # loads the task modules (where there is a registry)
elif what == "run":
    from hiso.cli import main
    t0 = time.perf_counter()
    code = main(["run", "--task", "mnist", "--data-dir", sys.argv[2], "--clients", "64", "--sampled", "8",
                 "--batch-size", "32", "--perturbations", "5", "--rounds", sys.argv[3], "--eval-every", "25",
                 "--threads", "1", "--quiet", "--force", "--out", sys.argv[4]])
    assert code == 0
elif what.startswith("eval"):
    import torch
    torch.set_num_threads(1)
    from hiso.tasks.vision import VisionTask
    task = VisionTask("mnist", 64, seed=0, data_dir=sys.argv[2])
    task.eval_batch_size = int(what[4:])
    model = task.build_model()
    task.evaluate(model)
    t0 = time.perf_counter()
    for _ in range(3):
        task.evaluate(model)
    print(json.dumps({"what": what, "eval_s": (time.perf_counter() - t0) / 3, "peak_rss_mb": peak()}))
    sys.exit(0)
print(json.dumps({"what": what, "peak_rss_mb": peak()}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--rounds", default="50")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for what in ("torch", "hiso", "run", "eval128", "eval500"):
        subprocess.run([sys.executable, "-c", CHILD, what, args.data_dir, args.rounds, args.out], check=True, env=env)


if __name__ == "__main__":
    main()
