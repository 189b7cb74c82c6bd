"""A global step normalised by the spread of the round's scalars (``--step-norm std``).

FZOO (ICLR 2026) divides the ZO step by the standard deviation of the perturbation losses; for
forward differences those are mu times the scalars g_p, whose spread across p estimates the
gradient's norm (for Rademacher u, Var(grad . u) = |grad|^2). Dividing by it makes the step a
normalised-gradient step: large while the gradient is small, small where it is steep. Here the
spread is estimated from the *logged aggregated scalars alone*, so every replica (server,
clients catching up, ``hiso rebuild``) computes the same step from the history it replays.

The estimator, exactly (float64 throughout, every operation one IEEE-754 rounding):

* the round's mean square ``s_r = fsum(g_{r,k,p}^2) / (tau P)`` over its aggregated float32
  scalars (each square exact in float64, ``math.fsum`` correctly rounded, so independent of
  order); the root mean square, not the deviation about the mean: with P = 5 the sample mean
  eats a fifth of the variance and the scalars' mean is itself noise of that size;
* two moving averages, both starting at 0: ``v_{r+1} = beta v_r + (1 - beta) s_r`` and
  ``w_{r+1} = beta w_r + (1 - beta)`` (w is 1 - beta^(r+1) without a ``pow``, which libms round
  differently), so ``v / w`` is the bias-corrected average (round 0: s_0 itself; beta = 0: the
  round's own spread, as FZOO does);
* ``sigma_r = max(sqrt(v_{r+1} / w_{r+1}), FLOOR)`` (``math.sqrt`` is correctly rounded);
* round r's global step uses ``lr_at(r) / sigma_r`` in place of ``lr_at(r)`` (rounded to
  float32 once, where the step is applied; see :func:`hiso.core.exact.axpy_`).

sigma_r includes round r's own scalars: the replicas know them when they apply the round. It
multiplies whatever the round's step is: H's preconditioned ghat, the momentum buffer, the
decayed lr. The local steps of a client (tau > 1) would need sigma before their round's scalars
exist, so the normalisation is refused with tau > 1 (``ZOConfig``). (v, w) are part of the
replicated state: a snapshot and ``model.pt`` carry them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..core.chain import Stage

FLOOR = 1e-12  # sigma's floor: only keeps 0 / 0 away (all scalars 0 means ghat = 0 anyway)


@dataclass(frozen=True)
class StepNormConfig(Stage):
    """The fold's step-size stage ``step_norm`` (:mod:`hiso.core.chain`): its state is (v, w)."""

    kind: Literal["std"] = "std"
    beta: float = 0.9  # weight of the old value in the moving average of the scalars' mean square
    name = "step_norm"

    def init(self, params):
        return init()

    def scale_lr(self, vw, lr, record):
        return lr / update_(vw, record.scalars, self)

    def __post_init__(self) -> None:
        if self.kind != "std":
            raise ValueError(f"step_norm must be 'std', got {self.kind!r}")
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"step_norm_beta must be in [0, 1), got {self.beta}")


def init() -> torch.Tensor:
    """(v, w) = (0, 0): float64 on the CPU (two numbers; the replicas' state, not a model's)."""
    return torch.zeros(2, dtype=torch.float64)


def mean_square(scalars: np.ndarray) -> float:
    """fsum(g^2) / n over a round's float32 scalars, in float64 (squares exact, sum correctly rounded)."""
    g = np.asarray(scalars, dtype=np.float32).astype(np.float64).reshape(-1)
    return math.fsum((g * g).tolist()) / g.size


def update_(state: torch.Tensor, scalars: np.ndarray, cfg: StepNormConfig) -> float:
    """Fold round's scalars into (v, w) in place; return sigma_r (see the module docstring)."""
    v, w = (float(x) for x in state.tolist())
    b = cfg.beta
    v = b * v + (1.0 - b) * mean_square(scalars)
    w = b * w + (1.0 - b)
    state[0], state[1] = v, w
    return sigma(state)


def sigma(state: torch.Tensor) -> float:
    v, w = (float(x) for x in state.tolist())
    if w <= 0.0:
        return 1.0
    return max(math.sqrt(v / w), FLOOR)
