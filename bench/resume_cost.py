"""What a resume costs with and without a checkpoint (``DIR/checkpoint.pt``), on a language model.

A resume at round r without a checkpoint replays r rounds (one direction-combination of the d
trainable values each); from a checkpoint at round c it loads the state once and replays r - c.
This bench measures, in one process on the flags' model: the seconds one replayed round takes
(``ModelState.apply`` on records of the run's shape), the seconds a checkpoint takes to write
(``Checkpoints.write``, fsync included) and to load into the replica (``load_start`` +
``load_state_dict``), and prints the resume time both ways at a few rounds.

    python bench/resume_cost.py --data-dir DATA/sst2 [--lora-r 8] [--device cuda] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_setup import add_model_args, model_config, start  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, autocast="none")
    ap.add_argument("--rounds", type=int, default=5, help="replayed rounds timed (median)")
    ap.add_argument("--at", default="500,1000,2500", help="resume rounds to print the totals for")
    ap.add_argument("--since", type=int, default=100, help="rounds between the checkpoint and the resume point")
    args = ap.parse_args()
    _, sync = start(args)

    from hiso.core.history import HistoryWriter, RoundRecord
    from hiso.core.seeds import round_seeds
    from hiso.core.state import ModelState
    from hiso.runners.checkpoint import Checkpoints, load_start
    from hiso.tasks.registry import build_task

    cfg = model_config(args, checkpoint_every="1")
    task = build_task(cfg)
    zo = cfg.zo()
    tau, P = zo.shape
    state = ModelState(task.build_model(), zo, run_seed=cfg.seed)
    d = sum(p.numel() for p in state.params)
    rng = np.random.default_rng(0)
    recs = [RoundRecord(r, round_seeds(cfg.seed, r, 0, tau, P), rng.standard_normal((tau, P)).astype(np.float32) * 1e-3,
                        (0, 1)) for r in range(args.rounds + 1)]
    state.apply(recs[0])  # warm-up (kernel compilation, allocation)
    sync()
    times = []
    for rec in recs[1:]:
        t0 = time.perf_counter()
        state.apply(rec)
        sync()
        times.append(time.perf_counter() - t0)
    replay = float(np.median(times))

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        with HistoryWriter(out / "history.bin", tau, P, seed=cfg.seed, scalar_dtype=cfg.scalar_dtype,
                           directions=cfg.direction_spec) as w:
            for rec in recs:
                w.write(rec)
        ck = Checkpoints(out, cfg)
        t0 = time.perf_counter()
        ck.write(state, state.round)
        write_s = time.perf_counter() - t0
        size = (out / "checkpoint.pt").stat().st_size
        fresh = ModelState(task.build_model(), zo, run_seed=cfg.seed)
        t0 = time.perf_counter()
        saved, why = load_start(out, cfg, len(recs))
        assert saved is not None, why
        fresh.load_state_dict(saved)
        sync()
        load_s = time.perf_counter() - t0
    same = all(bool((a == b).all()) for a, b in zip(fresh.params, state.params))
    result = {"model": args.model, "lora_r": args.lora_r, "device": args.device, "threads": args.threads,
              "algorithm": args.algorithm, "trainable": d, "replay_s_per_round": round(replay, 4),
              "checkpoint_write_s": round(write_s, 3), "checkpoint_load_s": round(load_s, 3),
              "checkpoint_mb": round(size / 2**20, 1), "loaded_state_equal": same}
    print(json.dumps(result))
    for r in (int(x) for x in args.at.split(",")):
        print(f"resume at round {r}: from x_0 {r * replay:.1f} s; from a checkpoint {args.since} rounds before "
              f"{load_s + args.since * replay:.1f} s")


if __name__ == "__main__":
    main()
