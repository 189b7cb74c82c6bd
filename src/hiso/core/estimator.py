"""A client's local update: tau ZO steps with P perturbations each; returns the scalars.

Step k on minibatch B_k, with z_p = H_r^{-1/2} u(s_{r,k,p}):

    forward:  g_p = (f(x_k + mu z_p; B_k) - f(x_k; B_k)) / mu      (one f(x_k) shared by all p)
    central:  g_p = (f(x_k + mu z_p; B_k) - f(x_k - mu z_p; B_k)) / (2 mu)
    x_{k+1} = x_k - eta (1/P) sum_p g_p z_p

The model's parameters are never written: x_k = x_r + delta_k is evaluated through
:class:`~hiso.core.perturb.Perturber`, and delta (one float32 d-vector) exists only when
tau > 1. After the call the model is bit-identical to x_r, so no reset copy is needed.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from . import exact
from .perturb import Perturber, Shift
from .state import ModelState, step_direction
from .work import Work

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class LocalResult(NamedTuple):
    """What :func:`local_update` returns."""

    scalars: np.ndarray  # (tau, P) float32: what the client uploads
    loss: float  # the mean loss at the local iterates
    delta: list[torch.Tensor] | None = None  # x_{r,tau} - x_r (float32), only with return_delta
    work: Work = Work()  # the forwards it ran (tau (P + 1) forward differences, 2 tau P central)


@torch.no_grad()
def local_update(state: ModelState, perturber: Perturber, loss_fn: LossFn,
                 batches: list[Any], seeds: np.ndarray, return_delta: bool = False) -> LocalResult:
    """Run the local steps on ``batches`` (one per step) with this round's ``seeds`` (tau, P).

    Returns a :class:`LocalResult`: the (tau, P) float32 scalars, the mean loss at the local
    iterates and, with ``return_delta``, x_{r,tau} - x_r (float32 tensors), which FedZO
    uploads (None without).
    """
    cfg = state.cfg
    tau, P = cfg.shape
    if seeds.shape != (tau, P) or len(batches) != tau:
        raise ValueError(f"need {tau} batches and ({tau}, {P}) seeds, got {len(batches)} and {seeds.shape}")
    gen, h, model = state.gen, state.h, state.model
    was_training = model.training
    model.eval()  # f must be a function of x alone: no dropout, no batch-norm statistics updates
    try:
        need_delta = tau > 1 or return_delta
        delta = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in state.params] if need_delta else None
        scalars = np.empty((tau, P), dtype=np.float32)
        losses = []
        forwards = 0
        lr = cfg.lr_at(state.round)

        for k in range(tau):
            batch = batches[k]
            if cfg.difference == "forward":  # f(x_k), then f(x_k + mu z_p) for each p
                shifts = [Shift(gen, None, 0.0, h, delta)] + [Shift(gen, int(s), cfg.mu, h, delta) for s in seeds[k]]
            else:  # f(x_k + mu z_p), f(x_k - mu z_p) for each p
                shifts = [Shift(gen, int(s), sign * cfg.mu, h, delta) for s in seeds[k] for sign in (1.0, -1.0)]
            vals = perturber.losses(loss_fn, batch, shifts)
            forwards += len(vals)
            if cfg.difference == "forward":
                f0 = vals[0]
                for p in range(P):
                    scalars[k, p] = (vals[1 + p] - f0) / cfg.mu
                losses.append(f0)
            else:
                for p in range(P):
                    fp, fm = vals[2 * p], vals[2 * p + 1]
                    scalars[k, p] = (fp - fm) / (2 * cfg.mu)
                    losses.append(0.5 * (fp + fm))
            if not np.all(np.isfinite(scalars[k])):
                raise FloatingPointError(f"non-finite ZO scalar at local step {k} (loss diverged: lower lr or mu)")
            if cfg.method is not None:  # what the method keeps of them (FeedSign: the signs)
                scalars[k] = cfg.method.step_scalars(scalars[k])
            if delta is not None and (k < tau - 1 or return_delta):
                for i, prm in enumerate(state.params):
                    ghat = step_direction(gen, i, prm, seeds[k], scalars[k], state.h_of(i))
                    exact.axpy_(delta[i], -lr, ghat)
    finally:  # also when a forward raises
        model.train(was_training)
    return LocalResult(scalars, float(np.mean(losses)), delta if return_delta else None, Work(forwards))
