"""Server optimisers of the full-model baselines, as small pure transitions (optax style).

Each optimiser is a pair ``init(params_like) -> state`` and
``update(state, pseudo_grad) -> (step, new_state)``: ``pseudo_grad`` is the round's mean
client update Delta = mean_i (x_i - x) (it points downhill) and the server applies
``x <- x + step``. Pure functions of tensors (inputs are never modified), so a test can drive
them by hand and a checkpoint is just the state tuple.

Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2, with m_{-1} = 0 and
v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2) and, as in the paper, no bias correction::

    m = beta1 m + (1 - beta1) Delta
    FedAdagrad  v = v + Delta^2
    FedAdam     v = beta2 v + (1 - beta2) Delta^2
    FedYogi     v = v - (1 - beta2) Delta^2 sign(v - Delta^2)
    x <- x + eta m / (sqrt(v) + tau)

FedAvg (and FedZO) is ``step = eta Delta``: eta = 1 is plain model averaging.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

Tensors = tuple[torch.Tensor, ...]


class AvgState(NamedTuple):
    """FedAvg keeps nothing between rounds."""


class AdaptiveState(NamedTuple):
    m: Tensors  # first moment, one tensor per parameter
    v: Tensors  # second moment (the adaptivity), one tensor per parameter


class ServerOpt(NamedTuple):
    init: Callable[[Sequence[torch.Tensor]], NamedTuple]
    update: Callable[[NamedTuple, Sequence[torch.Tensor]], tuple[Tensors, NamedTuple]]


def fedavg(lr: float = 1.0) -> ServerOpt:
    """x <- x + lr * Delta."""

    def init(params):
        return AvgState()

    def update(state, delta):
        return tuple(lr * g for g in delta), state

    return ServerOpt(init, update)


def _adaptive(second_moment: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              lr: float, beta1: float, tau: float) -> ServerOpt:
    def init(params):
        return AdaptiveState(m=tuple(torch.zeros_like(p, dtype=torch.float32) for p in params),
                             v=tuple(torch.full_like(p, tau * tau, dtype=torch.float32) for p in params))

    def update(state, delta):
        if len(delta) != len(state.m):
            raise ValueError(f"update has {len(delta)} tensors, the optimiser state {len(state.m)}")
        m = tuple(beta1 * m + (1 - beta1) * g for m, g in zip(state.m, delta))
        v = tuple(second_moment(v, g) for v, g in zip(state.v, delta))
        step = tuple(lr * mi / (vi.sqrt() + tau) for mi, vi in zip(m, v))
        return step, AdaptiveState(m, v)

    return ServerOpt(init, update)


def fedadagrad(lr: float = 0.01, beta1: float = 0.9, tau: float = 1e-3) -> ServerOpt:
    return _adaptive(lambda v, g: v + g * g, lr, beta1, tau)


def fedadam(lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> ServerOpt:
    return _adaptive(lambda v, g: beta2 * v + (1 - beta2) * (g * g), lr, beta1, tau)


def fedyogi(lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> ServerOpt:
    def yogi(v, g):
        g2 = g * g
        return v - (1 - beta2) * g2 * torch.sign(v - g2)
    return _adaptive(yogi, lr, beta1, tau)


def make_server_opt(cfg) -> ServerOpt:
    """The server optimiser a :class:`~hiso.config.RunConfig` asks for: its method's
    (:mod:`hiso.methods.fullmodel`: ``server_opt`` names it, its fields are its options)."""
    opt = cfg.method.server_opt  # the method's registry entry names it
    if opt is None:
        raise ValueError(f"{cfg.algorithm!r} has no server optimiser (not a full-model algorithm)")
    from ..methods.fullmodel import method_of
    method = method_of(cfg)
    lr = method.resolved_server_lr
    if opt == "avg":
        return fedavg(lr)
    if opt == "adagrad":  # (its first moment's decay is not an option: 0.9, the default of fedadam's beta1)
        return fedadagrad(lr, tau=method.server_tau)
    if opt == "adam":
        return fedadam(lr, method.beta1, method.beta2, method.server_tau)
    if opt == "yogi":
        return fedyogi(lr, method.beta1, method.beta2, method.server_tau)
    raise ValueError(f"{cfg.algorithm!r}: unknown server optimiser {opt!r}")
