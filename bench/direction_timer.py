"""Time all direction work of a run: the outermost calls of the generator's ``fill``, ``shift``
(generate, scale by mu H^{-1/2}, add: one fused pass for the Philox families) and ``combine``
(sum_p g_p u_p, then H^{-1/2}). Shared by the round-cost benchmarks."""

from __future__ import annotations

import time
from contextlib import contextmanager

from hiso.core import directions


class DirectionTimer:
    """``total``: seconds of direction work; ``in_forward``: the part done while ``forward`` is
    True (hooks perturbation builds shifted tensors inside a model's forward). ``sync`` is called
    before and after each timed call (``torch.cuda.synchronize`` on a GPU: its launches return
    before the work is done)."""

    def __init__(self, sync=None) -> None:
        self.sync = sync or (lambda: None)
        self.total = self.in_forward = 0.0
        self.forward = False
        self._depth = 0

    def reset(self) -> None:
        self.total = self.in_forward = 0.0

    def _wrap(self, fn):
        def wrapper(gen, *a, **k):
            if self._depth:  # nested (torch-normal's shift calls fill): the outer call counts it
                return fn(gen, *a, **k)
            self._depth += 1
            self.sync()
            t = time.perf_counter()
            try:
                return fn(gen, *a, **k)
            finally:
                self.sync()
                self._depth -= 1
                dt = time.perf_counter() - t
                self.total += dt
                if self.forward:
                    self.in_forward += dt
        return wrapper

    @contextmanager
    def installed(self):
        G = directions.DirectionGenerator
        originals = {name: getattr(G, name) for name in ("fill", "shift", "combine")}
        for name, fn in originals.items():
            setattr(G, name, self._wrap(fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(G, name, fn)
