"""The replica's fold as an ordered chain of named stages: the rule that keeps replicas exact.

Every replica (server, clients catching up, ``hiso rebuild``) advances its state by a logged
record with the same chain, so the same float32 numbers meet the same operations in the same
order. The order is fixed, whatever stages a run has:

1. ``lr``: the round's step size, ``lr_at(r)`` (the schedule, float64);
2. ``step_norm``: divides it by the spread of the record's scalars (:mod:`hiso.methods.stepnorm`);
3. tensor by tensor (protocol order), local step by local step: ghat_k = the record's
   directions combined with its scalars, through H_r (``h``: the :class:`Precondition` stage a
   method adds, HiSo's); ghat_k is taken by the step stage (``sgd``: x <- x - lr ghat_k; or
   ``momentum``: m <- m + (1-beta) ghat_k after m <- beta m at the tensor's start,
   :mod:`hiso.methods.momentum`), then observed by ``h``; at the tensor's end ``momentum`` steps x <- x - lr m and ``h`` updates that
   tensor's H (H_r stays fixed inside the round);
4. at the round's end ``h`` closes blockwise statistics (tensor or model granularity).

A stage is an object with a ``name`` (its key in the replica's ``state_dict``; None for a
stateless one) and any of the hooks below; the state it keeps is ``init(params)``'s value,
held by the replica under its name. The step stage and the step-size stages are supplied by
the run's configuration (:class:`~hiso.core.config.ZOConfig`), and a method adds its own in its
``stages`` hook (:mod:`hiso.core.method`), so the core imports no method. A stage with
``preconditions`` set (:class:`Precondition`, at most one) keeps H: the directions are drawn
through its H^{-1/2}, and the fold updates H by its configuration (step 3, 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import exact
from . import preconditioner as pc


class Stage:
    """No-op hooks; a stage overrides those it needs (see the module's docstring for the order)."""

    name: str | None = None
    preconditions = False  # its state is H, the directions' preconditioner (Precondition)

    def init(self, params: list[torch.Tensor]):
        return None

    def scale_lr(self, slot, lr: float, record) -> float:
        return lr

    def begin_tensor(self, slot, i: int) -> None:
        pass

    def take(self, slot, i: int, p: torch.Tensor, lr: float, ghat: torch.Tensor) -> None:
        pass

    def end_tensor(self, slot, i: int, p: torch.Tensor, lr: float) -> None:
        pass


@dataclass(frozen=True)
class Sgd(Stage):
    """x <- x - lr ghat_k for each local step's global direction (no state)."""

    def take(self, slot, i, p, lr, ghat):
        exact.axpy_(p, -lr, ghat)


SGD = Sgd()


@dataclass(frozen=True)
class Precondition(Stage):
    """H, a diagonal preconditioner (:mod:`hiso.core.preconditioner`): one float32 tensor per
    trainable tensor, starting at 1; the round's directions are drawn through H_r^{-1/2} and H is
    updated from the round's ghat as ``cfg`` says (HiSo's stage, :class:`hiso.methods.HiSo`)."""

    cfg: pc.PreconditionerConfig = pc.PreconditionerConfig()
    name = "h"  # model.pt's and checkpoint.pt's key of H
    preconditions = True

    def init(self, params):
        return pc.init(params)


def stages_of(cfg) -> list[Stage]:
    """The configuration's stages in chain order: step-size stages, then the step stage (a
    method adds its own: :func:`stages_for`)."""
    out = [s for s in (cfg.step_norm,) if s is not None]
    out.append(cfg.momentum if cfg.momentum is not None else SGD)
    return out


def stages_for(cfg) -> list[Stage]:
    """The fold's stages of a run of ``cfg`` (a ZOConfig): :func:`stages_of` through its method's
    ``stages`` hook."""
    chain = stages_of(cfg)
    return chain if cfg.method is None else list(cfg.method.stages(list(chain)))


def preconditioner(stages) -> Stage | None:
    """The stage among ``stages`` that keeps H (None: the directions are not preconditioned);
    ValueError if more than one does."""
    found = [st for st in stages if st.preconditions]
    if len(found) > 1:
        names = ", ".join(str(st.name) for st in found)
        raise ValueError(f"the fold has {len(found)} preconditioner stages ({names}): at most one")
    return found[0] if found else None


def check_record(state, record, what: str = "(tau, P)") -> None:
    """Refuse a record that is not the replica's next round or not of the run's shape (``what``
    names the shape in the message), before anything changes."""
    if record.round != state.round:
        raise ValueError(f"replica is at round {state.round}, cannot apply record of round {record.round}")
    shape = state.cfg.shape
    if record.seeds.shape != shape or record.scalars.shape != shape:
        raise ValueError(f"record of shape {record.seeds.shape} does not match {what} = {shape}")


def round_lr(state, record) -> float:
    """The round's step size: ``lr_at(r)`` through the step-size stages (every stage but the last,
    the step stage), which fold ``record`` into their state; call once per record, after checking it."""
    lr = state.cfg.lr_at(state.round)
    for st in state.stages[:-1]:
        lr = st.scale_lr(state.slots.get(st.name), lr, record)
    return lr


@torch.no_grad()
def fold(state, record) -> None:
    """Apply ``record`` (round r) to ``state`` (at round r) with the chain; see the module's docstring."""
    check_record(state, record)
    cfg = state.cfg
    tau, P = cfg.shape
    slots = state.slots
    lr = round_lr(state, record)  # checked above, so a refused record leaves their state as it was
    step = state.stages[-1]
    slot = slots.get(step.name)
    precond = state.precond
    if GROUPED and _fold_grouped(state, record, lr, step, precond, tau):
        state.round += 1
        return
    hstep = HStep(precond, record, state.round, tau) if precond is not None else None
    for i, p in enumerate(state.params):
        h = state.h_of(i)
        step.begin_tensor(slot, i)
        for k in range(tau):
            ghat = state.gen.combine(i, p.shape, record.seeds[k], record.scalars[k], h, p.device)
            step.take(slot, i, p, lr, ghat)
            if hstep is not None and precond.updates_at(k, tau):
                hstep.observe(state.gen, i, k, h, ghat)
        step.end_tensor(slot, i, p, lr)
        if hstep is not None:
            hstep.close_tensor(i, h)
    if hstep is not None:
        hstep.close_round(state.h)
    state.round += 1


GROUPED = True  # the one-launch fold where it applies (bench/fold_grouped.py turns it off to compare)


def _fold_grouped(state, record, lr: float, step: Stage, precond, tau: int) -> bool:
    """The chain for SGD (after the step-size stages) and no H or HiSo's coordinate-wise ghat**2
    H, as one launch per local step over every tensor (CUDA, Triton): the same element
    arithmetic in the same order as the loop in :func:`fold`, so the same bits. False (nothing
    changed) where it does not apply."""
    if type(step) is not Sgd:
        return False
    hs = state.h
    if precond is not None and (precond.blockwise or precond.stat != "ghat2"
                                or (precond.source == "every" and tau > 1)):
        return False
    if hs is not None and precond is None:
        return False
    for k in range(tau):
        upd = None
        if precond is not None and precond.updates_at(k, tau):  # source "last": H_r is fixed until the last step
            a, b = precond.weights(state.round)  # one update a round in the cases taken here
            upd = (a, b, precond.eps, precond.h_min, precond.h_max)
        if not state.gen.fold_all(state.params, hs, record.seeds[k], record.scalars[k], lr, upd):
            if k == 0:
                return False
            raise RuntimeError("grouped fold stopped after its first local step")  # cannot happen: same tensors
    return True


class HStep:
    """H's update for one round: per coordinate as each tensor's ghat is built, or, for a
    blockwise H, block sums of the statistic gathered over the tensors and applied at the end."""

    def __init__(self, cfg: pc.PreconditionerConfig, record, round: int, tau: int):
        self.cfg, self.tau = cfg, tau
        self.steps = list(range(tau)) if cfg.source == "every" else [tau - 1]
        self.t0 = round * len(self.steps)  # updates done before this round (bias correction)
        self.P = record.scalars.shape[1]
        self.s = [pc.scalar_power(record.scalars[k]) for k in range(tau)] if cfg.stat != "ghat2" else None
        self.h_next = None
        self.sums: dict[tuple[int, int], float] = {}  # (tensor, step) -> block sum of the statistic

    def t(self, k: int) -> int:
        return self.t0 + self.steps.index(k)

    def observe(self, gen, i: int, k: int, h: torch.Tensor, ghat: torch.Tensor) -> None:
        cfg = self.cfg
        x = None
        if cfg.stat != "ghat2" or cfg.blockwise:
            x = pc.statistic(ghat, h, self.s[k] if self.s else 0.0, self.P, cfg, gen.scratch("hstat", h.shape, h.device))
        if cfg.blockwise:
            self.sums[(i, k)] = pc.block_sum(x)
            return
        if self.h_next is None:
            # only 'every' with tau > 1 needs H_r intact while later steps are built
            self.h_next = (gen.scratch("h_next", h.shape, h.device).copy_(h)
                           if self.tau > 1 and cfg.source == "every" else h)
        pc.update_(self.h_next, ghat, cfg, self.t(k), x)

    def close_tensor(self, i: int, h: torch.Tensor) -> None:
        if self.h_next is not None and self.h_next is not h:
            h.copy_(self.h_next)
        self.h_next = None

    def close_round(self, hs: list[torch.Tensor]) -> None:
        if not self.cfg.blockwise:
            return
        n = [h.numel() for h in hs]
        for k in self.steps:
            if self.cfg.granularity == "tensor":
                for i, h in enumerate(hs):
                    pc.update_block_(h, self.sums[(i, k)] / n[i], self.cfg, self.t(k))
            else:
                mean = sum(self.sums[(i, k)] for i in range(len(hs))) / sum(n)
                for h in hs:
                    pc.update_block_(h, mean, self.cfg, self.t(k))
