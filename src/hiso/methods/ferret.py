"""Ferret (Shu et al., ICML 2025, arXiv 2409.06277): first-order local steps, the local update
projected onto K seeded random directions per parameter block, K numbers per block uploaded.

Round r, client i, from x_r:

1. ``steps`` SGD steps with backpropagation on its minibatches (client lr eta):
   Delta_i = x_r - x_{r,steps} (float32 tensors; x_r is restored exactly afterwards).
2. The trainable tensors (protocol order) form B contiguous blocks of about equal size
   (:func:`blocks_of`; some may be empty, see Blocks below). Block b gets K directions v_{b,k}
   (k < K): tensor t of block b takes ``DirectionGenerator.fill(s_{r,b,k}, t)``, the direction
   kernels every algorithm uses, with the seeds s_{r,b,k} derived from the run seed like every
   round's seeds (the record's (tau, P) shape is (B, K)). The client uploads
   s_{i,b,k} = <Delta_i restricted to b, v_{b,k}>.
3. The server averages the (B, K) numbers over its clients (any rule of
   :mod:`hiso.core.aggregate`) and logs them; every replica applies, tensor by tensor,
   x <- x - server_lr * (1/K) sum_k sbar_{b,k} v_{b,k} (one ``combine`` per tensor).

With Rademacher (or Gaussian) directions E[v v^T] = I, so (1/K) sum_k <Delta, v_k> v_k is an
unbiased reconstruction of Delta: with server_lr = 1 the global step is FedAvg's in expectation.
(Ferret's code, client ``projection``/``update``: per block of d values it draws v_k from a
normal truncated to +-1/sqrt(d), i.e. close to uniform there, E[v v^T] ~ I / (3 d), sends
c_k = (d / n) <Delta, v_k> for its n <= K seeds (fewer for a block with a small update) and
rebuilds sum_k c_k v_k: by our reading Delta / 3 in expectation, a constant its server lr
absorbs. We use the run's direction family (E[v v^T] = I) and always send K numbers, so bytes
are fixed and server_lr = 1 is FedAvg's step in expectation.)

Blocks: the paper's code groups consecutive tensors up to 0.9 x the median tensor size (a
model-dependent count); here B is a configuration value (the record's shape must be known
before the model is), and tensors are grouped contiguously by size. A tensor is never split, so
a block no tensor starts in stays empty and its K numbers are always 0, yet sent (the record's
shape is fixed): with few or very unequal tensors part of the uplink carries nothing (the MNIST
CNN's 6 tensors at B = 8 fill blocks 0, 3 and 7 only: 600 of its 1,600 numbers a round are
informative, and a 12,800-number tensor shares block 0's K directions with two small ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from ..core.method import Method
from ..core.work import Work
from .fullmodel import check_server_lr
from .options import RUN, SHARED

DEFAULT_K = 200  # the authors' script (scripts/ferret.sh: --K 200)
DEFAULT_BLOCKS = 8


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class Ferret(Method):
    """First-order local steps, K projections per block on the wire. Its options are ``ferret_k``
    (K), ``ferret_blocks`` (B: the record's (tau, P) is (B, K)) and ``server_lr`` (the global
    step's scale, ``--server-lr``; None: ``default_server_lr``); ``steps`` and ``grad_clip`` are
    the run's local steps and gradient clip (``RUN`` fields, set by :meth:`from_config`, not
    options)."""

    ferret_k: int = field(default=DEFAULT_K, metadata=_help(
        "ferret, sketch, fedkrso: K, the random directions per parameter block the local update is projected on "
        "(fedkrso: its local steps are restricted to their span) (default: 200, the authors' script; ferret_k x "
        "ferret_blocks <= 65536)"))
    ferret_blocks: int = field(default=DEFAULT_BLOCKS, metadata=_help(
        "ferret, sketch, fedkrso: B, contiguous blocks of trainable tensors of about equal size, each with its own K "
        "directions (a tensor is never split: with fewer or very unequal tensors some blocks stay empty and send K "
        "zeros)"))
    steps: int = field(default=1, metadata=RUN)  # local SGD steps (the run's local_steps)
    server_lr: float | None = field(default=None, metadata=SHARED)  # the global step's scale (--server-lr)
    grad_clip: float | None = field(default=None, metadata=RUN)  # each local step's gradient norm clip (None: none)

    display: ClassVar[str] = "Ferret"
    gradient: ClassVar[str] = "first-order"
    options: ClassVar[frozenset] = frozenset()
    can: ClassVar[frozenset] = frozenset({"faults", "robust", "weighted", "backprop", "lr_decay", "grad_clip"})
    default_server_lr: ClassVar[float] = 1.0
    flags: ClassVar[str] = "ferret's, sketch's and fedkrso's"  # its fields are top-level flags too; whose they are
    flags_at: ClassVar[str] = "step_norm"  # where they sit among the run's options (--help, docs/cli.md)

    def __post_init__(self) -> None:
        from ..core.seeds import MAX_PER_ROUND
        for name in ("ferret_k", "ferret_blocks", "steps"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected an integer")
        if self.ferret_k < 1 or self.ferret_blocks < 1:
            raise ValueError(f"ferret needs ferret_k >= 1 and ferret_blocks >= 1, got {self.ferret_k} and "
                             f"{self.ferret_blocks}")
        if self.steps < 1:
            raise ValueError(f"ferret needs steps >= 1, got {self.steps}")
        if self.ferret_k * self.ferret_blocks > MAX_PER_ROUND:
            raise ValueError(f"ferret_k x ferret_blocks = {self.ferret_k * self.ferret_blocks} seeds a round, more "
                             f"than the format allows ({MAX_PER_ROUND})")
        check_server_lr(self.server_lr)
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip!r}")

    @classmethod
    def from_config(cls, cfg) -> "Ferret":
        """The method of a run (a :class:`~hiso.config.RunConfig`): its local steps and clip (its
        own options are set after, from ``method_opts``)."""
        return cls(steps=cfg.local_steps, grad_clip=cfg.grad_clip)

    @property
    def resolved_server_lr(self) -> float:
        """The global step's scale this run takes: ``server_lr``, or the class's default."""
        return self.default_server_lr if self.server_lr is None else self.server_lr

    def record_shape(self) -> tuple[int, int]:
        """(B, K): a round's seeds and scalars are K per block."""
        return (self.ferret_blocks, self.ferret_k)

    def batches(self, cfg) -> int:
        return self.steps

    def local_update(self, state, perturber, loss_fn, batches, seeds):
        return local_update(state, loss_fn, batches, seeds)

    def apply_(self, state, record):
        apply_(state, record)
        return True


def blocks_of(params, B: int) -> list[int]:
    """The block of each tensor: tensor i (protocol order) starting at element s_i of the
    concatenated d parameters goes to block floor(B s_i / d): contiguous, about d / B each."""
    sizes = [p.numel() for p in params]
    d, start, out = max(sum(sizes), 1), 0, []
    for n in sizes:
        out.append(min(B - 1, (B * start) // d))
        start += n
    return out


@torch.no_grad()
def apply_(state, record) -> None:
    """Round ``record.round``'s global step on the replica ``state`` (:class:`~hiso.core.state.ModelState`)."""
    from ..core import exact
    from ..core.chain import check_record
    check_record(state, record, "(blocks, K)")
    cfg = state.cfg
    for i, (p, b) in enumerate(zip(state.params, blocks_of(state.params, cfg.method.ferret_blocks))):
        ghat = state.gen.combine(i, p.shape, record.seeds[b], record.scalars[b], None, p.device)
        exact.axpy_(p, -cfg.method.resolved_server_lr, ghat)
    state.round += 1


class FerretResult:
    """The (B, K) projections, the mean local loss, and the work: one forward and one
    backpropagation per local step (the projection draws B K directions, no forward)."""

    def __init__(self, scalars: np.ndarray, loss: float, work: Work = Work()):
        self.scalars, self.loss, self.work = scalars, loss, work


def clip_grads(grads, max_norm: float) -> list:
    """The gradients scaled by max_norm / ||g|| where their joint L2 norm ||g|| is above max_norm
    (torch's ``clip_grad_norm_`` rule, the Hugging Face Trainer's ``max_grad_norm``, default 1.0);
    unchanged below it."""
    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    norm = math.sqrt(float(torch.stack([torch.sum(g.double() ** 2) for g in present]).sum()))  # one sync
    if not norm > max_norm:  # NaN included: the caller's finiteness check reports it
        return list(grads)
    scale = max_norm / norm
    return [None if g is None else g * scale for g in grads]


def local_update(state, loss_fn: Callable, batches: list[Any], seeds: np.ndarray) -> FerretResult:
    """The client's SGD steps from x_r, the projections of its update ((B, K) float32);
    the model holds x_r again, bit for bit, when it returns."""
    cfg, params, model = state.cfg, state.params, state.model
    if seeds.shape != cfg.shape or len(batches) != cfg.method.steps:
        raise ValueError(f"need {cfg.method.steps} batches and {cfg.shape} seeds, got {len(batches)} and {seeds.shape}")
    start = [p.detach().clone() for p in params]
    lr = cfg.lr_at(state.round)
    losses = []
    was_training = model.training
    model.eval()  # as the ZO clients: f is a function of x alone
    try:
        with torch.enable_grad():
            for batch in batches:
                loss = loss_fn(model, batch)
                if not loss.requires_grad:
                    raise ValueError("ferret needs a task whose loss has gradients (backpropagation)")
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                losses.append(float(loss.detach()))
                with torch.no_grad():
                    if cfg.method.grad_clip is not None:
                        grads = clip_grads(grads, cfg.method.grad_clip)
                    for p, g in zip(params, grads):
                        if g is not None:
                            p.add_(g.to(p.dtype), alpha=-lr)
        with torch.no_grad():
            delta = [(s.float() - p.detach().float()) for p, s in zip(params, start)]
            for p, s in zip(params, start):
                p.copy_(s)
    finally:
        model.train(was_training)
    if not (all(np.isfinite(losses)) and all(bool(torch.isfinite(t).all()) for t in delta)):
        raise FloatingPointError("non-finite local update (diverged: lower lr)")
    B, K = cfg.shape
    out = np.zeros((B, K), dtype=np.float64)
    for i, b in enumerate(blocks_of(params, B)):
        di = delta[i].reshape(-1).double()
        for k in range(K):
            u = state.gen.fill(int(seeds[b, k]), i, params[i].shape, params[i].device)
            out[b, k] += float(torch.dot(di, u.reshape(-1).double()))
    return FerretResult(out.astype(np.float32), float(np.mean(losses)), Work(len(losses), len(losses)))
