"""A method with an option of its own, from this one file: each client clips its scalars to [-c, c].

A client's forward difference g_p = (f(x + mu u_p) - f(x)) / mu is unbounded: one client whose
batch sits on a steep part of the loss can move the mean (and so every replica) by as much as it
likes. Clipping each scalar at c bounds one client's say in a round by c, at no extra bytes; the
server averages the clipped scalars and every replica folds the mean with DeComFL's chain.

The option is a dataclass field: ``c``. Give it on the command line, in a TOML ``[method]`` table,
per arm in ``hiso compare`` (``[compare.variants]``), or as an instance from Python:

    hiso run --algorithm examples/clip_method.py:ScalarClip --method-opt c=0.5 --rounds 30 --out runs/clip
    hiso rebuild runs/clip --out clip.pt          # bit for bit, with c = 0.5 read from config.json
    hiso run --resume runs/clip --rounds 60       # continued as if started with 60 rounds
    hiso flower --nodes 2 --clients 4 --algorithm examples/clip_method.py:ScalarClip --method-opt c=0.5 --out runs/fclip

    import hiso
    from clip_method import ScalarClip
    hiso.run("quadratic", "runs/clip", algorithm=ScalarClip(c=0.5), rounds=30)

and in a comparison (one arm per value of c):

    [compare.variants]
    clip05 = { algorithm = "examples/clip_method.py:ScalarClip", method_opts = { c = 0.5 } }
    clip2 = { algorithm = "examples/clip_method.py:ScalarClip", method_opts = { c = 2.0 } }
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hiso.core.method import Method


@dataclass(frozen=True)
class ScalarClip(Method):
    """DeComFL with each client's scalars clipped to [-c, c]."""

    c: float = 1.0  # the clip: --method-opt c=0.5

    display = "ScalarClip"
    gradient = "zo"
    options = frozenset({"zo_estimate"})  # it reads P, mu and the difference like DeComFL
    can = frozenset({"faults", "robust", "weighted", "lr_decay", "int8"})

    def __post_init__(self) -> None:
        if not self.c > 0:
            raise ValueError(f"ScalarClip: c must be > 0, got {self.c}")

    def step_scalars(self, g: np.ndarray) -> np.ndarray:
        """The step's scalars clipped to [-c, c] (float32 in, float32 out: the same on every client)."""
        c = np.float32(self.c)
        return np.clip(np.asarray(g, dtype=np.float32), -c, c)


if __name__ == "__main__":
    import tempfile

    import hiso

    with tempfile.TemporaryDirectory() as out:
        run = hiso.run("quadratic", out, algorithm=ScalarClip(c=0.5), rounds=30, lr=0.05)
        print(f"ScalarClip(c=0.5): gap {run.summary['final'].get('gap', float('nan')):.4g} after 30 rounds")
