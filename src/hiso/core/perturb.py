"""Evaluate a model at a shifted point x + delta + scale * H^{-1/2} u without changing x.

Adding a perturbation in place and subtracting it again does not give x back bit for bit in
floating point, and keeping a copy of x doubles memory. Instead the shifted value of a tensor
is built only while it is needed and x itself is never written:

* ``mode="hooks"`` (default, lean): forward hooks swap each module's own parameters for their
  shifted values just before the module runs and put the originals back right after, so the
  extra memory is one layer's worth (plus tied parameters, e.g. an LM's embedding and output
  head: shifted once when first used and kept until the block ends). It requires parameters to be used through their own
  module's ``forward`` (true of torch and transformers layers; a parameter read as
  ``other_module.weight`` inside a different module would be missed: use ``"swap"``).
* ``mode="swap"``: every parameter is swapped for the whole forward (one extra model copy),
  for models that read parameters outside their module's forward.
* ``mode="batched"``: the points of a local step (the base point and its P perturbed points)
  are evaluated as one forward over a stacked group axis (``torch.func.vmap`` of
  ``torch.func.functional_call``): each group gets its own shifted copy of the trainable
  tensors, the frozen ones are shared. Under LoRA the base weights' products become one large
  matrix product over all groups and the adapters one batched product per layer; with full
  parameters every group carries a model copy, so the groups are evaluated in chunks whose
  shifted tensors fit ``batch_memory`` bytes. Few large forwards instead of many small ones is
  what a GPU needs (small forwards are launch-bound there); on a CPU it is measured in
  ``bench/llm_round.py``. The loss must be batchable by ``vmap`` (no ``.item()`` or
  data-dependent branches on values that depend on the parameters).

All modes build the same shifted tensors with :meth:`Shift.shifted`, so hooks and swap give
identical losses, and batched gives them up to the rounding of a differently shaped product.
"""

from __future__ import annotations

import contextlib
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

from .directions import DirectionGenerator

Mode = Literal["hooks", "swap", "batched"]
MODES = ("hooks", "swap", "batched")
DEFAULT_BATCH_MEMORY = 2 << 30  # bytes of stacked shifted tensors per batched forward


class Shift:
    """What to add to parameter i: ``delta[i] + scale * H_i^{-1/2} u_i(seed)`` (parts optional)."""

    def __init__(self, gen: DirectionGenerator, seed: int | None = None, scale: float = 0.0,
                 h: list[torch.Tensor] | None = None, delta: list[torch.Tensor] | None = None):
        self.gen, self.seed, self.scale, self.h, self.delta = gen, seed, scale, h, delta

    def shifted(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write parameter i's shifted value into ``out`` (x is left untouched).

        With a seed this is one fused pass of the direction generator (generate, scale by
        scale * H^{-1/2}, add; see :mod:`hiso.core.directions` for the arithmetic).
        """
        delta = None if self.delta is None else self.delta[i]
        if self.seed is not None:
            return self.gen.shift(out, x, self.seed, i, self.scale, None if self.h is None else self.h[i], delta)
        out.copy_(x)
        if delta is not None:
            out.add_(delta.to(x.dtype))
        return out


class Perturber:
    """Runs forwards of ``model`` at shifted points; see the module docstring."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], mode: Mode = "hooks",
                 batch_memory: int | None = None):
        if mode not in MODES:
            raise ValueError(f"perturbation mode must be one of {', '.join(MODES)}, got {mode!r}")
        if batch_memory is not None and batch_memory <= 0:
            raise ValueError(f"batch_memory must be positive, got {batch_memory}")
        self.model, self.params, self.mode = model, params, mode
        self.batch_memory = DEFAULT_BATCH_MEMORY if batch_memory is None else int(batch_memory)
        self._stacks: dict[tuple, torch.Tensor] = {}  # batched mode: stacked shifted tensors by (G, shape)
        self._free: dict[tuple, list[torch.Tensor]] = {}  # reusable buffers for shifted values
        index = {id(p): i for i, p in enumerate(params)}
        # each module's own trainable parameters, with their protocol index
        self._owned = []
        owners: dict[int, int] = {}
        for mod in model.modules():
            own = [(index[id(p)], p) for p in mod.parameters(recurse=False) if id(p) in index]
            if own:
                self._owned.append((mod, own))
                for i, _ in own:
                    owners[i] = owners.get(i, 0) + 1
        # parameters owned by several modules (tied embeddings): shifted once per forward and
        # kept until the block ends, instead of being rebuilt by every module that uses them
        self._shared = {i for i, n in owners.items() if n > 1}

    def _swap_in(self, shift: Shift, i: int, p: torch.Tensor) -> torch.Tensor:
        """Point p at a buffer holding its shifted value; return the original data."""
        x = p.data
        key = (x.shape, x.dtype, x.device)
        free = self._free.setdefault(key, [])
        buf = free.pop() if free else torch.empty_like(x)
        p.data = shift.shifted(i, x, buf)
        return x

    def _swap_out(self, p: torch.Tensor, x: torch.Tensor) -> None:
        buf, p.data = p.data, x
        self._free[(x.shape, x.dtype, x.device)].append(buf)

    @contextmanager
    def at(self, shift: Shift) -> Iterator[None]:
        """Inside the block, forwards of the model see the shifted parameters."""
        if self.mode == "swap":
            saved = {}
            try:
                for i, p in enumerate(self.params):
                    saved[i] = self._swap_in(shift, i, p)
                yield
            finally:
                for i, x in saved.items():
                    self._swap_out(self.params[i], x)
            return
        depth: dict[int, int] = {}
        saved: dict[int, torch.Tensor] = {}

        def enter(own):
            def pre(_mod, _args):
                for i, p in own:
                    if depth.get(i, 0) == 0 and i not in saved:
                        saved[i] = self._swap_in(shift, i, p)
                    depth[i] = depth.get(i, 0) + 1
            return pre

        def leave(own):
            def post(_mod, _args, _out):
                for i, p in own:
                    depth[i] -= 1
                    if depth[i] == 0 and i not in self._shared:
                        self._swap_out(p, saved.pop(i))
            return post

        handles = []
        try:
            for mod, own in self._owned:
                handles.append(mod.register_forward_pre_hook(enter(own)))
                handles.append(mod.register_forward_hook(leave(own), always_call=True))
            yield
        finally:
            for h in handles:
                h.remove()
            for i, x in saved.items():  # shared parameters, and any left by an exception
                self._swap_out(self.params[i], x)

    # ------------------------------------------------------------------ several points at once

    def losses(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
               shifts: list[Shift]) -> list[float]:
        """``loss_fn(model, batch)`` at each shifted point, in order.

        In hooks and swap mode one forward per point (a point with neither seed nor delta is the
        model itself, evaluated directly); in batched mode as few stacked forwards as
        ``batch_memory`` allows.
        """
        if self.mode != "batched":
            out = []
            for s in shifts:
                if s.seed is None and s.delta is None:
                    out.append(float(loss_fn(self.model, batch)))
                else:
                    with self.at(s):
                        out.append(float(loss_fn(self.model, batch)))
            return out
        per_point = sum(p.numel() * p.element_size() for p in self.params)
        chunk = max(1, min(len(shifts), self.batch_memory // max(per_point, 1)))
        out = []
        for a in range(0, len(shifts), chunk):
            out.extend(self._stacked_losses(loss_fn, batch, shifts[a:a + chunk]))
        return out

    def _names(self) -> list[str]:
        names = getattr(self, "_param_names", None)
        if names is None:
            by_id = {id(p): n for n, p in self.model.named_parameters()}
            missing = [i for i, p in enumerate(self.params) if id(p) not in by_id]
            if missing:
                raise ValueError(f"batched perturbation: trainable tensors {missing} are not parameters of the model")
            names = self._param_names = [by_id[id(p)] for p in self.params]
        return names

    def _stack(self, shifts: list[Shift]) -> list[torch.Tensor]:
        """Per trainable tensor, a (G, *shape) buffer whose g-th slice is point g's value.

        The seeded points of one scale are shifted by one :meth:`DirectionGenerator.shift_all`
        call (on a GPU one kernel launch for every tensor of every such point)."""
        G, stacks = len(shifts), []
        for i, p in enumerate(self.params):
            x = p.data
            key = (G, i, x.shape, x.dtype, x.device)
            buf = self._stacks.get(key)
            if buf is None:
                buf = self._stacks[key] = torch.empty((G, *x.shape), dtype=x.dtype, device=x.device)
            stacks.append(buf)
        n = len(self.params)
        groups: dict[tuple, list[int]] = {}
        for g, s in enumerate(shifts):
            if s.seed is None:
                for i, p in enumerate(self.params):
                    s.shifted(i, p.data, stacks[i][g])
            else:
                groups.setdefault((s.gen, s.scale, id(s.h), id(s.delta)), []).append(g)
        for members in groups.values():
            s = shifts[members[0]]
            outs = [stacks[i][g] for g in members for i in range(n)]
            xs = [p.data for _ in members for p in self.params]
            seeds = [int(shifts[g].seed) for g in members for _ in range(n)]
            s.gen.shift_all(outs, xs, seeds, list(range(n)) * len(members), s.scale,
                            None if s.h is None else list(s.h) * len(members),
                            None if s.delta is None else list(s.delta) * len(members))
        return stacks

    def _stacked_losses(self, loss_fn, batch, shifts: list[Shift]) -> list[float]:
        names = ["model." + n for n in self._names()]
        stacks = self._stack(shifts)
        wrapper = _LossOf(self.model, loss_fn)

        def one(*tensors):
            return torch.func.functional_call(wrapper, dict(zip(names, tensors)), (batch,), strict=False)

        with warnings.catch_warnings(), _vmap_attention(stacks[0].device if stacks else None):
            # attention kernels without a batching rule run group by group: slower, same numbers
            warnings.filterwarnings("ignore", message=".*performance drop because we have not yet implemented the batching rule")
            try:
                vals = torch.func.vmap(one)(*stacks)
            except (RuntimeError, ValueError) as e:
                if "vmap" not in str(e) and "Batching rule" not in str(e) and "batched" not in str(e):
                    raise
                raise RuntimeError(f"perturb mode 'batched' needs a loss torch.func.vmap can batch ({e}); "
                                   "use --perturb-mode hooks") from e
        if vals.shape != (len(shifts),):
            raise ValueError(f"batched perturbation: the loss must be a scalar per point, got shape {tuple(vals.shape[1:])}")
        return vals.detach().cpu().tolist()


def _vmap_attention(device: torch.device | None):
    """The attention kernel a stacked forward may use: on CUDA the math one.

    CUDA's fused kernels (memory-efficient attention, chosen when there is a mask) have vmap
    batching rules that fold the group axis into the query's batch but not into an attention
    mask without it, and stop with "attn_bias: wrong shape (batch dimension)" (torch 2.11 on an
    H100, transformers 5.17); the math kernel is matmuls and a softmax, which vmap batches.
    """
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


class _LossOf(nn.Module):
    """``loss_fn(model, batch)`` as a module, so functional_call can swap the model's tensors."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)
