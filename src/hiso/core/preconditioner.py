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

Variants (each a field of :class:`PreconditionerConfig`, all computed from the replayed global
update, so they cost no bytes; derived below):

* ``stat``: what the EMA averages. ``"ghat2"`` (HiSo): ghat**2. ``"floor"``: the part of
  E[ghat_i**2] that does not depend on the coordinate, S / (P H_i) with
  S = (1/P) sum_p G_p**2 the round's mean squared scalar (what ghat**2 averages to when
  d >> P, without the per-coordinate sampling noise). ``"denoised"``:
  max((P ghat**2 - S / H) / (P + 1), 0), an unbiased estimate of the squared preconditioned
  gradient with the noise floor removed (then floored at 0).
* ``granularity``: ``"coordinate"`` (HiSo), ``"tensor"`` (the statistic averaged over each
  tensor: one H value per tensor) or ``"model"`` (one H value for the whole model). H keeps its
  full shape (filled with the block's value), so everything that reads H is unchanged.
* ``bias_correction``: Adam's correction of the EMA: H_t = v_t / (1 - (1 - nu)^t) with
  v_0 = 0, i.e. H_1 is the first statistic itself rather than 0.95 + 0.05 x it. Only H is
  stored: H_{t+1} = ((1 - nu) c_t H_t + nu x) / c_{t+1}, c_t = 1 - (1 - nu)^t, t the number
  of updates so far (a function of the round, so it is exact on every replica).

Block sums (``tensor``, ``model``) are float64 numpy sums of the float32 statistic, rounded to
float32 once: numpy's pairwise sum does not depend on torch's thread count, so replicas agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from . import exact


STATS = ("ghat2", "floor", "denoised")
GRANULARITIES = ("coordinate", "tensor", "model")


@dataclass(frozen=True)
class PreconditionerConfig:
    nu: float = 0.05
    eps: float = 1e-8
    h_min: float | None = None
    h_max: float | None = None
    source: Literal["last", "every"] = "last"
    stat: Literal["ghat2", "floor", "denoised"] = "ghat2"
    granularity: Literal["coordinate", "tensor", "model"] = "coordinate"
    bias_correction: bool = False

    def __post_init__(self) -> None:
        if self.stat not in STATS:
            raise ValueError(f"stat must be one of {', '.join(STATS)}, got {self.stat!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.bias_correction and self.nu == 0:
            raise ValueError("bias_correction needs nu > 0")
        if not 0.0 <= self.nu <= 1.0:
            raise ValueError(f"nu must be in [0, 1], got {self.nu}")
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        if self.h_min is not None and self.h_min <= 0:
            raise ValueError(f"h_min must be > 0, got {self.h_min}")
        if self.h_max is not None and self.h_max <= 0:
            raise ValueError(f"h_max must be > 0, got {self.h_max}")
        if self.h_min is not None and self.h_max is not None and self.h_max < self.h_min:
            raise ValueError(f"h_max ({self.h_max}) must be >= h_min ({self.h_min})")
        if self.source not in ("last", "every"):
            raise ValueError(f"source must be 'last' or 'every', got {self.source!r}")

    def updates_at(self, step: int, local_steps: int) -> bool:
        """Whether local step ``step``'s global direction feeds the H update."""
        return self.source == "every" or step == local_steps - 1

    @property
    def blockwise(self) -> bool:
        """Whether H's update needs a reduction over a block (tensor or model)."""
        return self.granularity != "coordinate"

    def weights(self, t: int) -> tuple[float, float]:
        """(a, b) of the t-th update (t = 0, 1, ...): H <- a H + b (x + eps)."""
        if not self.bias_correction:
            return 1.0 - self.nu, self.nu
        keep = 1.0 - self.nu
        c_t, c_next = 1.0 - keep ** t, 1.0 - keep ** (t + 1)
        return keep * c_t / c_next, self.nu / c_next


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


def scalar_power(scalars) -> float:
    """S = (1/P) sum_p G_p**2 of one local step's P mean scalars (float64): E[S] = ||H^{-1/2} g||**2."""
    g = np.asarray(scalars, dtype=np.float64)
    return float(np.mean(g * g))


def statistic(ghat: torch.Tensor, h_round: torch.Tensor, s: float, P: int, cfg: PreconditionerConfig,
              out: torch.Tensor) -> torch.Tensor:
    """The per-coordinate value the EMA averages (``stat`` other than ghat2), in ``out``.

    ``h_round`` is H_r (the H the round's directions used), ``s`` the step's :func:`scalar_power`.
    """
    if cfg.stat == "floor":  # S / (P H_r)
        return torch.reciprocal(h_round, out=out).mul_(s / P)
    if cfg.stat == "denoised":  # max((P ghat^2 - S / H_r) / (P + 1), 0)
        torch.reciprocal(h_round, out=out).mul_(-s)
        return exact.add_scaled_square_(out, float(P), ghat).div_(P + 1).clamp_(min=0.0)
    torch.mul(ghat, ghat, out=out)
    return out


def block_sum(x: torch.Tensor) -> float:
    """sum(x) in float64, independent of torch's threads (numpy's pairwise sum)."""
    return float(np.sum(x.detach().reshape(-1).cpu().numpy(), dtype=np.float64))


def _finish_(h: torch.Tensor, cfg: PreconditionerConfig, b: float) -> None:
    if cfg.eps:
        h.add_(b * cfg.eps)
    if cfg.h_min is not None or cfg.h_max is not None:
        h.clamp_(min=cfg.h_min, max=cfg.h_max)


def update_(h: torch.Tensor, ghat: torch.Tensor, cfg: PreconditionerConfig, t: int = 0,
            x: torch.Tensor | None = None) -> None:
    """One EMA step of one tensor's H, in place, per coordinate: x = ghat**2 unless ``x`` (a
    :func:`statistic`) is given; ``t`` the update's index (bias correction)."""
    a, b = cfg.weights(t)
    if x is None:
        exact.add_scaled_square_(h.mul_(a), b, ghat)
    else:
        exact.axpy_(h.mul_(a), b, x)
    _finish_(h, cfg, b)


def update_block_(h: torch.Tensor, mean: float, cfg: PreconditionerConfig, t: int = 0) -> None:
    """One EMA step of a block's H (every element holds the block's value) with the block's mean
    statistic ``mean`` (float64, rounded to float32 once)."""
    a, b = cfg.weights(t)
    h.mul_(a).add_(float(np.float32(mean)) * b)
    _finish_(h, cfg, b)
