"""The replicated state (x_r, the fold's stage states, r) and the one method that advances it.

Server, clients and ``hiso rebuild`` all advance their state with :meth:`ModelState.apply`
(the chain of :mod:`hiso.core.chain`, or the method's own fold), so replaying a history is
folding it over the records and they cannot drift apart: the same float32 scalars go through
the same operations in the same order, tensor by tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .chain import fold, preconditioner, stages_for
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
    """A replica of the protocol state: the model (x_r), the fold's stage states (H_r for
    HiSo, a momentum buffer, ...) and r.

    ``round`` is the round whose starting point the replica holds: a replica with
    ``round == r`` holds x_r and H_r and needs history records r, r+1, ... to move on.
    ``run_seed``: the run's seed, for a direction family that needs it (lowrank refresh; a
    client learns it at the join, :meth:`hiso.core.client.Client.join`).
    """

    def __init__(self, model: nn.Module, cfg: ZOConfig, round: int = 0, run_seed: int | None = None):
        self.model = model
        self.cfg = cfg
        self.named = trainable_params(model)
        self.params = [p for _, p in self.named]
        self.stages = stages_for(cfg)  # the fold's chain (hiso.core.chain), the method's stages included
        names = [st.name for st in self.stages if st.name is not None]
        if len(set(names)) != len(names) or "round" in names or "model" in names:
            raise ValueError(f"the fold's stages need distinct names other than round and model, got {names}")
        pre = preconditioner(self.stages)  # the stage keeping H (HiSo's), or None
        if pre is not None and pre.name is None:
            raise ValueError("a preconditioner stage needs a name (its H is the replica's state)")
        self._h = None if pre is None else pre.name
        self.precond = None if pre is None else pre.cfg  # H's configuration (hiso.core.preconditioner)
        named = {st.name: st for st in self.stages if st.name is not None}
        self.slots: dict = {}
        for name in sorted(named, key=lambda n: (n != self._h, n != "momentum", n)):  # model.pt's order: h, momentum, step_norm
            self.slots[name] = named[name].init(self.params)
        self.round = round
        # a family may need the run's seed (lowrank refresh) or x_0 (sparse mask): bound here
        if round != 0 and "mask=" in cfg.directions:
            raise ValueError("a replica of a masked direction family must be built from x_0 (round 0)")
        self.gen = DirectionGenerator(cfg.directions).bind(run_seed, self.params)

    # the stage states by their historical names (snapshots, Flower's replica, diagnose); h: H, the preconditioner's
    h = property(lambda self: self.slots.get(self._h), lambda self, v: self.slots.__setitem__(self._h or "h", v))
    m = property(lambda self: self.slots.get("momentum"), lambda self, v: self.slots.__setitem__("momentum", v))
    sn = property(lambda self: self.slots.get("step_norm"), lambda self, v: self.slots.__setitem__("step_norm", v))

    def h_of(self, i: int) -> torch.Tensor | None:
        h = self.slots.get(self._h)
        return None if h is None else h[i]

    @torch.no_grad()
    def apply(self, record: RoundRecord) -> None:
        """Advance the replica by one logged round: the method's own fold, or the chain
        (:func:`hiso.core.chain.fold`: x_{r+1} = x_r - eta sum_k ghat_k through H_r, momentum,
        step normalisation, then H_{r+1})."""
        method = self.cfg.method
        if method is None or method.apply_(self, record) is None:
            fold(self, record)

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
        for name, slot in self.slots.items():  # each stage's state under its name: per tensor, or one value
            out[name] = ({n: t for (n, _), t in zip(self.named, slot)} if isinstance(slot, list)
                         else {"vw" if name == "step_norm" else "value": slot})
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore exactly what :meth:`state_dict` saved (e.g. ``model.pt``) into this replica,
        built from the same task and config: round, model tensors, H and the momentum buffer,
        each copied in place, bit for bit. Everything is checked (keys, shapes, dtypes) before
        anything is written, so a mismatch raises ValueError and leaves the replica as it was."""
        want = self.state_dict()
        extra = sorted(set(state) - set(want) - {"base"})  # "base": model.pt's name of a LoRA base
        if extra:
            raise ValueError(f"state has {', '.join(map(repr, extra))}, which this replica does not keep"
                             + (" (its config has no preconditioner/momentum/step_norm)"
                                if {"h", "momentum", "step_norm"} & set(extra) else ""))
        missing = sorted(set(want) - set(state))
        if missing:
            raise ValueError(f"state lacks {', '.join(map(repr, missing))}, which this replica keeps")
        rnd = state["round"]
        if isinstance(rnd, bool) or not isinstance(rnd, (int, np.integer)) or rnd < 0:
            raise ValueError(f"state's round must be an integer >= 0, got {rnd!r}")
        pairs = []
        for part, ours in want.items():
            if part == "round":
                continue
            theirs = state[part]
            if set(theirs) != set(ours):
                gone, new = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
                raise ValueError(f"state[{part!r}] does not match this replica: missing {gone[:5]}, "
                                 f"unexpected {new[:5]}")
            for name, dst in ours.items():
                src = theirs[name]
                if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
                    got = (tuple(src.shape), src.dtype) if isinstance(src, torch.Tensor) else type(src).__name__
                    raise ValueError(f"state[{part!r}][{name!r}] is {got}, this replica has "
                                     f"{(tuple(dst.shape), dst.dtype)}")
                pairs.append((dst, src))
        for dst, src in pairs:
            if dst is not src:
                dst.copy_(src)
        self.round = int(rnd)
