"""The replicated state (x_r, H_r) and the one function that advances it by a round.

Server, clients and ``hiso rebuild`` all advance their state with :func:`apply_round`, so
replaying a history is folding ``apply_round`` over it and they cannot drift apart: the same
float32 scalars go through the same operations in the same order, tensor by tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import preconditioner as pc
from .config import ZOConfig
from .directions import DirectionGenerator
from .history import RoundRecord


def trainable_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The tensors a direction covers, in protocol order (see :mod:`hiso.core.directions`)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def step_direction(
    gen: DirectionGenerator,
    index: int,
    param: torch.Tensor,
    seeds: np.ndarray,
    scalars: np.ndarray,
    h: torch.Tensor | None,
) -> torch.Tensor:
    """ghat_i = H_i^{-1/2} (1/P) sum_p g_p u_p for one tensor and one local step (float32).

    ``seeds`` and ``scalars`` are one local step's P values. The sum runs over p in order, and
    each direction element is produced where it is summed (:meth:`DirectionGenerator.combine`).
    The result lives in ``gen``'s scratch space: use it before the next call.
    """
    return gen.combine(index, param.shape, seeds, scalars, h, param.device)


class ModelState:
    """A replica of the protocol state: the model (x_r), H_r (HiSo only) and r.

    ``round`` is the round whose starting point the replica holds: a replica with
    ``round == r`` holds x_r and H_r and needs history records r, r+1, ... to move on.
    """

    def __init__(self, model: nn.Module, cfg: ZOConfig, round: int = 0):
        self.model = model
        self.cfg = cfg
        self.named = trainable_params(model)
        self.params = [p for _, p in self.named]
        self.h = pc.init(self.params) if cfg.precond is not None else None
        self.round = round
        self.gen = DirectionGenerator(cfg.directions)

    def h_of(self, i: int) -> torch.Tensor | None:
        return None if self.h is None else self.h[i]

    @torch.no_grad()
    def apply(self, record: RoundRecord) -> None:
        """x_{r+1} = x_r - eta sum_k ghat_k, then H_{r+1} from ghat (H_r fixed in the round)."""
        if record.round != self.round:
            raise ValueError(f"replica is at round {self.round}, cannot apply record of round {record.round}")
        tau, P = self.cfg.shape
        if record.seeds.shape != (tau, P) or record.scalars.shape != (tau, P):
            raise ValueError(f"record of shape {record.seeds.shape} does not match (tau, P) = {(tau, P)}")
        lr, precond = self.cfg.lr, self.cfg.precond
        for i, p in enumerate(self.params):
            h = self.h_of(i)
            h_next = None
            for k in range(tau):
                ghat = step_direction(self.gen, i, p, record.seeds[k], record.scalars[k], h)
                p.add_(ghat.to(p.dtype), alpha=-lr)
                if precond is not None and precond.updates_at(k, tau):
                    if h_next is None:
                        # only 'every' with tau > 1 needs H_r intact while later steps are built
                        h_next = (self.gen.scratch("h_next", h.shape, h.device).copy_(h)
                                  if tau > 1 and precond.source == "every" else h)
                    pc.update_(h_next, ghat, precond)
            if h_next is not None and h_next is not h:
                h.copy_(h_next)
        self.round += 1

    def replay(self, records) -> None:
        """Fold :meth:`apply` over consecutive records (a client's catch-up, or a rebuild)."""
        for rec in records:
            self.apply(rec)

    def state_dict(self) -> dict:
        """round, model and H. A model with frozen parameters (LoRA over a base) saves only its
        trainable tensors: the frozen ones are the run's base model, named by the runner."""
        if len(self.params) == sum(1 for _ in self.model.parameters()):
            model = self.model.state_dict()
        else:
            model = {n: p.detach() for n, p in self.named}
        out = {"round": self.round, "model": model}
        if self.h is not None:
            out["h"] = {n: h for (n, _), h in zip(self.named, self.h)}
        return out
