"""ConMeZO (Behric et al., AISTATS 2026, "Adaptive descent-direction sampling for gradient-free
finetuning of large language models"; code LejsDeen/ConMeZO): directions in a cone around the
momentum of past updates, at no extra bytes.

Every replica keeps m, an exponential average of the replayed global update directions (one
float32 tensor per trainable tensor, 0 at round 0). Round r draws each direction of seed s as

    z = c m + b u(s),   c = cos(theta) sqrt(d) / |m_r|,   b = sin(theta)

(u the run's direction family, d the trainable values, |m_r| over all of them): about
sqrt(d) cos(theta) of it along m's unit vector and the rest random, |z|^2 ~ d as for u. With
m_r = 0 (round 0, or a round whose records were all zero) z = u: DeComFL's round. A client
evaluates its scalars along z (g_p = (f(x + mu z_p) - f(x)) / mu, or the central difference);
every replica steps along the same z and then updates m:

    ghat_r = sum_k (1/P) sum_p g_{r,k,p} z_{r,k,p},   x_{r+1} = x_r - lr ghat_r,
    m_{r+1} = beta m_r + (1 - beta) ghat_r.

m is fixed inside a round (a client's local steps cannot know the others' updates), so with
tau = 1 this is the paper's Algorithm 1 with the federated mean as its estimate. Defaults are
the authors' OPT script's (theta = 1.35, beta = 0.99); their LLM trainer also warms beta up from
0.1 over the first 2,000 steps and replaces |m| by a running estimate of its expected norm to
save a pass over m; here beta is fixed and |m| exact, so the rule is one function of the log.

Exactness: |m|^2 is summed in float64 from each tensor's float64 squares (exact) by numpy's
pairwise sum (the order of HiSo's blockwise H: independent of torch's threads); cos(theta) and
sin(theta) are rounded to float32 (:func:`trig`), and c is computed in Python float64 and rounded
to float32 once. A local step's direction is
fl(b U) + fl(fl(c S) m_i) with U = sum_p c_p u_p the run's replay (c_p = float32(g_p / P)) and
S = sum_p c_p in float64: every operation one rounding, the same bits on every replica.

With ``--step-norm std`` the round's lr is divided by the spread of its scalars before the step
(:mod:`hiso.methods.stepnorm`, the same stage and state as DeComFL's); m takes ghat_r unscaled.

Cost against DeComFL: a client holds one (forward) or two (central) extra d-vectors while it
answers (x + delta +- mu c m, the cone's axis, for its shifted forwards) and computes |m| once;
every replica keeps m (a d-vector, saved in model.pt and checkpoint.pt, sent in snapshots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..core import exact
from ..core.chain import Stage, check_record, round_lr
from ..core.estimator import LocalResult
from ..core.method import Method
from ..core.perturb import Shift
from ..core.work import Work

SLOT = "cone"  # m's name in the replica's state (model.pt, checkpoint.pt, snapshots)


@dataclass(frozen=True)
class ConeMomentum(Stage):
    """m, the replicated momentum of the replayed global directions (stepped by :meth:`ConMeZO.apply_`)."""

    name = SLOT

    def init(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]


def norm(m: list[torch.Tensor]) -> float:
    """|m| over every tensor: float64 squares (exact), numpy's pairwise sum, tensors in order."""
    total = 0.0
    for t in m:
        v = t.detach().reshape(-1).cpu().numpy().astype(np.float64)
        total += float(np.sum(v * v))
    return math.sqrt(total)


def trig(theta: float) -> tuple[float, float]:
    """cos(theta) and sin(theta) rounded to float32: the C library's values may differ in their last
    float64 bit between machines, the float32 ones only if they straddle a rounding boundary."""
    return float(np.float32(math.cos(theta))), float(np.float32(math.sin(theta)))


def axis_scale(m: list[torch.Tensor], theta: float) -> float | None:
    """c = cos(theta) sqrt(d) / |m| (float64), or None where m = 0 (plain directions)."""
    n = norm(m)
    if n == 0.0:
        return None
    d = sum(t.numel() for t in m)
    return trig(theta)[0] * math.sqrt(d) / n


def cone_combine(gen, i: int, p: torch.Tensor, seeds: np.ndarray, scalars: np.ndarray,
                 m_i: torch.Tensor, c: float | None, b: float) -> torch.Tensor:
    """One local step's (1/P) sum_p g_p z_p for tensor i (in ``gen``'s scratch: use it at once)."""
    u = gen.combine(i, p.shape, seeds, scalars, None, p.device)
    if c is None:
        return u
    P = len(seeds)
    s = sum(float(np.float32(float(g) / P)) for g in np.asarray(scalars, dtype=np.float32))
    u.mul_(float(np.float32(b)))
    return exact.axpy_(u, c * s, m_i)


@dataclass(frozen=True)
class ConMeZO(Method):
    """Directions in a cone around the replicated momentum m (theta: the cone's half-angle in
    radians, beta: m's EMA weight on its old value); see the module's docstring."""

    theta: float = 1.35
    beta: float = 0.99

    display = "ConMeZO"
    gradient = "zo"
    options = frozenset({"zo_estimate"})
    can = frozenset({"faults", "robust", "weighted", "lr_decay", "int8", "lowbit", "step_norm"})

    def __post_init__(self) -> None:
        if not 0.0 < self.theta <= math.pi / 2:
            raise ValueError(f"conmezo: theta must be in (0, pi/2] radians, got {self.theta}")
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"conmezo: beta must be in [0, 1), got {self.beta}")

    def stages(self, chain: list) -> list:
        """The run's step-size stage (``step_norm``), if any, then m: the fold is :meth:`apply_`,
        which asks the step-size stages for the round's lr; the chain's step stage does not run
        (a run's server momentum would be dropped, and hiso.methods.honour refuses it by name)."""
        return [st for st in chain if st.name == "step_norm"] + [ConeMomentum()]

    def _cone(self, state) -> tuple[float | None, float]:
        c = axis_scale(state.slots[SLOT], self.theta)
        return c, (1.0 if c is None else trig(self.theta)[1])

    @torch.no_grad()
    def local_update(self, state, perturber, loss_fn, batches, seeds):
        """The ZO estimate of :mod:`hiso.core.estimator` along the cone's directions."""
        cfg, gen, params = state.cfg, state.gen, state.params
        tau, P = cfg.shape
        if seeds.shape != (tau, P) or len(batches) != tau:
            raise ValueError(f"need {tau} batches and ({tau}, {P}) seeds, got {len(batches)} and {seeds.shape}")
        m = state.slots[SLOT]
        c, b = self._cone(state)
        mu, lr = cfg.mu, cfg.lr_at(state.round)
        delta = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params] if tau > 1 else None
        ax = None if c is None else float(np.float32(mu * c))
        plus = None if c is None else [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]
        minus = None if c is None or cfg.difference == "forward" else [torch.empty_like(t) for t in plus]
        scalars = np.empty((tau, P), dtype=np.float32)
        losses, forwards = [], 0
        model = state.model
        was_training = model.training
        model.eval()  # f must be a function of x alone, as in the estimator
        try:
            for k in range(tau):
                if c is not None:  # the cone's axis part of every shifted point: delta +- mu c m
                    for i in range(len(params)):
                        torch.mul(m[i], ax, out=plus[i])
                        if minus is not None:
                            torch.mul(m[i], -ax, out=minus[i])
                        if delta is not None:
                            plus[i].add_(delta[i])
                            if minus is not None:
                                minus[i].add_(delta[i])
                up = delta if c is None else plus
                down = delta if c is None else minus
                if cfg.difference == "forward":
                    shifts = [Shift(gen, None, 0.0, None, delta)]
                    shifts += [Shift(gen, int(s), mu * b, None, up) for s in seeds[k]]
                else:
                    shifts = [Shift(gen, int(s), sign * mu * b, None, up if sign > 0 else down)
                              for s in seeds[k] for sign in (1.0, -1.0)]
                vals = perturber.losses(loss_fn, batches[k], shifts)
                forwards += len(vals)
                if cfg.difference == "forward":
                    scalars[k] = [(v - vals[0]) / mu for v in vals[1:]]
                    losses.append(vals[0])
                else:
                    scalars[k] = [(vals[2 * j] - vals[2 * j + 1]) / (2 * mu) for j in range(P)]
                    losses.extend(0.5 * (vals[2 * j] + vals[2 * j + 1]) for j in range(P))
                if not np.all(np.isfinite(scalars[k])):
                    raise FloatingPointError(f"non-finite ZO scalar at local step {k} (loss diverged: lower lr or mu)")
                if delta is not None and k < tau - 1:
                    for i, p in enumerate(params):
                        exact.axpy_(delta[i], -lr, cone_combine(gen, i, p, seeds[k], scalars[k], m[i], c, b))
        finally:
            model.train(was_training)
        return LocalResult(scalars, float(np.mean(losses)), None, Work(forwards))

    @torch.no_grad()
    def apply_(self, state, record):
        """x_{r+1} = x_r - lr ghat_r along the cone's directions, then m_{r+1} = beta m_r + (1 - beta) ghat_r."""
        check_record(state, record)
        m = state.slots[SLOT]
        c, b = self._cone(state)  # from m_r, before any tensor's m moves
        lr = round_lr(state, record)  # through the step-size stages (step_norm: lr / sigma_r), as the chain's
        tau = record.seeds.shape[0]
        for i, p in enumerate(state.params):
            total = None if tau == 1 else state.gen.scratch("cone_total", p.shape, p.device).zero_()
            for k in range(tau):
                ghat = cone_combine(state.gen, i, p, record.seeds[k], record.scalars[k], m[i], c, b)
                exact.axpy_(p, -lr, ghat)
                if total is not None:
                    total.add_(ghat)
            m[i].mul_(float(np.float32(self.beta)))
            exact.axpy_(m[i], 1.0 - self.beta, ghat if total is None else total)
        state.round += 1
        return True
