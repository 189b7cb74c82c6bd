"""Shared test setup: thread counts, and a tiny task with several parameter tensors (an MLP on
synthetic regression data)."""

from __future__ import annotations

import os

# One thread per test process unless the caller chose otherwise. Set here, before torch or numba
# is imported (they read these once, at import): the suite runs many short tests and subprocesses
# (hiso runs, Flower nodes) on small shared machines, and OpenMP/MKL/numba pools sized to every
# core made it stall on a busy 2-core machine (spinning threads of several processes fighting for
# the same cores). Subprocesses inherit the environment, so they get one thread too.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np
import pytest
import torch
from torch import nn

from hiso.tasks.base import Task


class TinyTask(Task):
    name = "tiny"

    def __init__(self, num_clients: int = 20, seed: int = 0, n_per_client: int = 32, d_in: int = 6):
        super().__init__(num_clients, seed)
        g = torch.Generator().manual_seed(seed)
        self.X = torch.randn(num_clients, n_per_client, d_in, generator=g)
        w = torch.randn(d_in, 1, generator=g)
        self.Y = torch.tanh(self.X @ w) + 0.1 * torch.randn(num_clients, n_per_client, 1, generator=g)
        self.d_in = d_in

    def build_model(self) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return nn.Sequential(nn.Linear(self.d_in, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 1))

    def batch(self, client, round, step, batch_size):
        rng = np.random.default_rng([self.seed, client, round, step])
        idx = torch.as_tensor(rng.choice(self.X.shape[1], size=min(batch_size, self.X.shape[1]), replace=False))
        return self.X[client, idx], self.Y[client, idx]

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def evaluate(self, model):
        with torch.no_grad():
            return {"eval_loss": float(((model(self.X.reshape(-1, self.d_in)) - self.Y.reshape(-1, 1)) ** 2).mean())}


@pytest.fixture
def tiny_task():
    return TinyTask()
