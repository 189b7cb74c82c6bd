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

Both build the same shifted tensors with :func:`shifted`, so they give identical losses.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Literal

import torch
from torch import nn

from .directions import DirectionGenerator

Mode = Literal["hooks", "swap"]


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

    def __init__(self, model: nn.Module, params: list[nn.Parameter], mode: Mode = "hooks"):
        if mode not in ("hooks", "swap"):
            raise ValueError(f"perturbation mode must be 'hooks' or 'swap', got {mode!r}")
        self.model, self.params, self.mode = model, params, mode
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
