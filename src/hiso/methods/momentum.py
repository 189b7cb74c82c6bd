"""Server-side momentum on the replayed global update: free of communication.

Every replica already reconstructs the round's global update ghat_r = sum_k ghat_{r,k} (the
preconditioned one for HiSo). With momentum each replica also keeps a buffer m (one float32
tensor per trainable tensor, starting at 0) and steps along it instead:

    m_{r+1} = beta m_r + (1 - beta) ghat_r,      x_{r+1} = x_r - eta m_{r+1}

This is the EMA ("dampened") form: at a fixed direction the step tends to eta ghat, so the
same lr means the same long-run step length as without momentum and the lr grids stay
comparable (heavy-ball momentum with lr eta' is this form with eta = eta' / (1 - beta)).
What it changes is the noise: a ZO estimate's noise is independent across rounds, so m
averages about (1 + beta) / (1 - beta) rounds of it (its variance is (1 - beta) / (1 + beta)
that of one round's ghat), at the price of a lag of about beta / (1 - beta) rounds in the
signal. The clients' local steps (tau > 1) are unchanged: momentum acts only on the server's
(and every replica's) global step. H, when present, is updated from the round's ghat as usual
(not from m). The buffer is part of the replicated state (``ModelState.state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import exact
from ..core.chain import Stage


@dataclass(frozen=True)
class MomentumConfig(Stage):
    """The fold's step stage ``momentum`` (:mod:`hiso.core.chain`): its state is the buffer m."""

    beta: float = 0.9
    name = "momentum"

    def __post_init__(self) -> None:
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"momentum beta must be in (0, 1), got {self.beta}")

    def init(self, params):
        return init(params)

    def begin_tensor(self, m, i):
        decay_(m[i], self)

    def take(self, m, i, p, lr, ghat):
        add_(m[i], ghat, self)

    def end_tensor(self, m, i, p, lr):
        exact.axpy_(p, -lr, m[i])


def init(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """m_0 = 0 (float32, on each parameter's device)."""
    return [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]


def decay_(m: torch.Tensor, cfg: MomentumConfig) -> torch.Tensor:
    """m <- beta m (first half of a round's update; the steps' ghat are then :func:`add_`-ed)."""
    return m.mul_(cfg.beta)


def add_(m: torch.Tensor, ghat: torch.Tensor, cfg: MomentumConfig) -> torch.Tensor:
    """m <- m + (1 - beta) ghat for one local step's global direction."""
    return exact.axpy_(m, 1.0 - cfg.beta, ghat)
