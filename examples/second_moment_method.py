"""A method with fold state of its own, from this one file: an Adam-style second moment on the
global direction, kept by every replica (the server, each client, ``hiso rebuild``).

DeComFL steps x <- x - lr ghat_r, ghat_r the round's reconstructed direction. This method keeps
v, an exponential average of ghat**2 per coordinate, and steps x <- x - lr ghat / (sqrt(v) + eps)
(RMSProp's step; Adam's without the first moment and bias correction). v is computed from the
log alone, so it costs no bytes: clients that missed rounds rebuild it by replaying the records.

The state is a stage of the fold (:mod:`hiso.core.chain`): ``init`` makes v (zeros, float32,
one tensor per trainable tensor), ``take`` updates v and x for each tensor. hiso saves it in
model.pt and checkpoint.pt under the stage's name, restores it on resume, sends it in snapshots
and rebuilds it. Every operation is one float32 operation rounded once (no ``alpha=``, no
``addcmul_``): the same bits on every CPU and GPU (docs/methods-api.md, "Exact arithmetic").

    hiso run --algorithm examples/second_moment_method.py:SecondMoment --method-opt beta2=0.9 --rounds 30 --out runs/sm
    hiso rebuild runs/sm --out sm.pt              # x and v, bit for bit
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hiso.core.chain import Stage
from hiso.core.method import Method


@dataclass(frozen=True)
class SecondMomentStep(Stage):
    """x <- x - lr ghat / (sqrt(v) + eps) after v <- beta2 v + (1 - beta2) ghat**2."""

    beta2: float
    eps: float
    name = "second_moment"  # the key of v in model.pt, checkpoint.pt and the replica's state

    def init(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]

    def take(self, slot, i: int, p: torch.Tensor, lr: float, ghat: torch.Tensor) -> None:
        v = slot[i]
        sq = torch.mul(ghat, ghat)
        v.mul_(self.beta2).add_(sq.mul_(1.0 - self.beta2))  # each product and sum rounded once
        denom = torch.sqrt(v).add_(self.eps)  # a correctly rounded square root
        p.sub_(torch.div(ghat, denom).mul_(lr))


@dataclass(frozen=True)
class SecondMoment(Method):
    """DeComFL's round with an RMSProp step on the replayed direction (v kept by every replica)."""

    beta2: float = 0.99
    eps: float = 1e-8

    display = "SecondMoment"
    gradient = "zo"
    options = frozenset({"zo_estimate"})
    can = frozenset({"faults", "robust", "weighted", "lr_decay", "int8"})

    def __post_init__(self) -> None:
        if not (0.0 <= self.beta2 < 1.0 and self.eps > 0):
            raise ValueError(f"SecondMoment: beta2 must be in [0, 1) and eps > 0, got {self.beta2}, {self.eps}")

    def stages(self, chain: list) -> list:
        """The run's step-size stages, then this step instead of SGD."""
        return [*chain[:-1], SecondMomentStep(self.beta2, self.eps)]


if __name__ == "__main__":
    import tempfile

    import hiso

    with tempfile.TemporaryDirectory() as out:
        run = hiso.run("quadratic", out, algorithm=SecondMoment(beta2=0.9), rounds=30, lr=0.01)
        print(f"SecondMoment(beta2=0.9): gap {run.summary['final'].get('gap', float('nan')):.4g} after 30 rounds")
