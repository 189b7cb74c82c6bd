"""Your own model and data, federated with HiSo: a runnable example of hiso's Python API.

    python examples/custom_task.py --out runs/blobs        # about 10 seconds on a laptop CPU

A small classifier (a user-defined nn.Module) on synthetic Gaussian blobs split across 8
clients with label skew; HiSo trains it for a few rounds exchanging only seeds and scalars;
then the final model is rebuilt from x_0 and the run's (seed, scalar) log alone, bit for bit.

The same class works on the command line, without editing hiso:

    hiso run --task examples/custom_task.py:Blobs --algorithm decomfl --rounds 30 --out runs/b2
    hiso compare --task examples/custom_task.py:Blobs --rounds 30 --lr-grid hiso=0.01,0.03 \\
        --lr-grid decomfl=0.01,0.03 --out runs/bc
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hiso


class SmallNet(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.body(x)


class Blobs(hiso.Task):
    """Three Gaussian blobs in 8 dimensions; each client holds mostly one class."""

    metrics = {"eval_acc": "max", "eval_loss": "min"}  # what evaluate() returns; the first is compared
    default_lr = {"zo": 0.03, "first-order": 0.3}      # the lr of a run without --lr

    def __init__(self, num_clients: int = 8, seed: int = 0, per_client: int = 64):
        super().__init__(num_clients, seed)
        rng = np.random.default_rng(seed)
        centres = rng.normal(0, 1, size=(3, 8))
        self.x, self.y = [], []
        for c in range(num_clients):  # label skew: 70% of a client's examples are one class
            labels = np.where(rng.random(per_client) < 0.7, c % 3, rng.integers(0, 3, per_client))
            self.x.append(torch.tensor(centres[labels] + rng.normal(size=(per_client, 8)), dtype=torch.float32))
            self.y.append(torch.tensor(labels))
        test = rng.integers(0, 3, 600)
        self.x_test = torch.tensor(centres[test] + rng.normal(size=(600, 8)), dtype=torch.float32)
        self.y_test = torch.tensor(test)

    def build_model(self) -> nn.Module:  # the same x_0 on every call: a function of the seed
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return SmallNet()

    def batch(self, client, round, step, batch_size):  # a function of (seed, client, round, step)
        rng = np.random.default_rng([self.seed, client, round, step])
        idx = torch.as_tensor(rng.choice(len(self.y[client]), size=batch_size, replace=False))
        return self.x[client][idx], self.y[client][idx]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        logits = model(self.x_test)
        return {"eval_acc": float((logits.argmax(1) == self.y_test).float().mean()),
                "eval_loss": float(F.cross_entropy(logits, self.y_test))}

    def client_sizes(self):
        return [len(y) for y in self.y]


def main(out: str, rounds: int = 40) -> None:
    task = Blobs(num_clients=8, seed=0)
    run = hiso.run(task, out, algorithm="hiso", rounds=rounds, sampled=4, perturbations=5,
                   batch_size=32, eval_every=10)
    first, last = run.metrics[0], run.metrics[-1]
    print(f"eval_acc {first['eval_acc']:.3f} -> {last['eval_acc']:.3f} in {rounds} rounds; "
          f"{run.summary['communication_per_client']['bytes_total_mean']:.0f} bytes per client")

    rebuilt = hiso.rebuild(out, task)  # x_0 + history.bin replayed
    saved = run.checkpoint()
    same = all(torch.equal(rebuilt.model.state_dict()[k], v) for k, v in saved["model"].items())
    same = same and all(torch.equal(rebuilt.h[i], h) for i, h in enumerate(saved["h"].values()))
    print("rebuilt from the log: " + ("bit-identical to the server's model and H" if same else "DIFFERENT"))
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="run directory (default: a temporary one)")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    if args.out:
        main(args.out, args.rounds)
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d, args.rounds)
