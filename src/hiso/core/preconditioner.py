"""HiSo's diagonal preconditioner H: an EMA of the squared reconstructed global update.

H is one float32 tensor per trainable tensor, starting at 1. After the global model step of
round r (which used H_r), each tensor's H is updated from ``ghat``, the round's reconstructed
global update direction ``(1/P) sum_p g_{r,k,p} H_r^{-1/2} u_{r,k,p}`` (no learning rate):

    H <- (1 - nu) * H + nu * (ghat**2 + eps),   then clipped to [h_min, h_max]

``nu`` is the weight on the NEW value (the authors' code calls 1 - nu the smoothing s and uses
s = 0.95, i.e. nu = 0.05; the paper's MNIST ablation quotes the weight on the old value).
By default ``ghat`` is that of the last local step of the round (the authors' default);
``source="every"`` folds in every local step in order. H stays fixed inside a round: the
directions of round r always use H_r.

Defaults follow the authors' code (nu = 0.05, last step, no clipping) except ``eps = 1e-8``:
the paper adds eps so H stays strictly positive; without it a coordinate that never moves
decays like 0.95^r and underflows float32 after ~1,800 rounds.
DeComFL is the same protocol with no preconditioner (H == 1, nothing stored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class PreconditionerConfig:
    nu: float = 0.05
    eps: float = 1e-8
    h_min: float | None = None
    h_max: float | None = None
    source: Literal["last", "every"] = "last"

    def __post_init__(self) -> None:
        if not 0.0 <= self.nu <= 1.0:
            raise ValueError(f"nu must be in [0, 1], got {self.nu}")
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        if self.h_min is not None and self.h_min <= 0:
            raise ValueError(f"h_min must be > 0, got {self.h_min}")
        if self.h_min is not None and self.h_max is not None and self.h_max < self.h_min:
            raise ValueError(f"h_max ({self.h_max}) must be >= h_min ({self.h_min})")
        if self.source not in ("last", "every"):
            raise ValueError(f"source must be 'last' or 'every', got {self.source!r}")

    def updates_at(self, step: int, local_steps: int) -> bool:
        """Whether local step ``step``'s global direction feeds the H update."""
        return self.source == "every" or step == local_steps - 1


def init(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """H_0 = 1 for every coordinate (float32, on each parameter's device)."""
    return [torch.ones(p.shape, dtype=torch.float32, device=p.device) for p in params]


CHUNK = 1 << 20  # elements of H^{-1/2} materialised at a time


def scratch_shape(h: torch.Tensor) -> tuple[int]:
    """Shape of the scratch :func:`precondition_` needs for this H tensor."""
    return (min(CHUNK, h.numel()),)


def precondition_(u: torch.Tensor, h: torch.Tensor | None, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """u <- H^{-1/2} u in place (identity when there is no preconditioner).

    H^{-1/2} is formed CHUNK elements at a time in ``tmp`` (a float32 scratch of at least
    min(CHUNK, numel) elements), so HiSo's memory over DeComFL's is H itself, not H plus a
    tensor-sized temporary. Chunking does not change any value (the operations are elementwise).
    """
    if h is None:
        return u
    uf, hf = u.view(-1), h.view(-1)
    n = hf.numel()
    if tmp is None:
        tmp = torch.empty(min(CHUNK, n), dtype=torch.float32, device=h.device)
    for i in range(0, n, CHUNK):
        j = min(i + CHUNK, n)
        t = tmp.view(-1)[: j - i]
        torch.rsqrt(hf[i:j], out=t)
        uf[i:j].mul_(t)
    return u


def update_(h: torch.Tensor, ghat: torch.Tensor, cfg: PreconditionerConfig) -> None:
    """One EMA step of one tensor's H, in place."""
    h.mul_(1.0 - cfg.nu).addcmul_(ghat, ghat, value=cfg.nu)
    if cfg.eps:
        h.add_(cfg.nu * cfg.eps)
    if cfg.h_min is not None or cfg.h_max is not None:
        h.clamp_(min=cfg.h_min, max=cfg.h_max)
