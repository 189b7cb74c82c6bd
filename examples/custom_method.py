"""A method that is not in hiso, plugged in from this one file: FZOO's normalised one-sided step.

FZOO (ICLR 2026) estimates the gradient from one unperturbed and P perturbed losses, like
DeComFL's forward difference, and divides the step by the spread of the perturbed losses:

    x <- x - eta (1/P) sum_p (f(x + mu u_p) - f(x)) / sigma  u_p,   sigma = std_p f(x + mu u_p)

Since f(x + mu u_p) - f(x) = mu g_p with DeComFL's scalar g_p, and the spread of the f_p is mu
times the spread of the g_p, FZOO's scalar is g_p / std_p(g_p): a client keeps its forward
differences normalised by their own spread (one hook, ``step_scalars``); the server averages
them and every replica folds the mean with DeComFL's chain, exactly as for the built-in methods.
So the step's length is set by eta alone, whatever the loss's scale (a normalised-gradient step).

Run it with every front end, nothing in hiso edited (the name is ``module:Class`` from the
repository's root, or ``path/to/custom_method.py:FZOO`` from anywhere):

    hiso run --algorithm examples.custom_method:FZOO --perturbations 4 --rounds 30 --out runs/fzoo
    hiso rebuild runs/fzoo                          # the model from x_0 and the log, bit for bit
    hiso run --resume runs/fzoo --rounds 60         # continued as if started with 60 rounds
    hiso compare --algorithms decomfl,examples.custom_method:FZOO --rounds 30 --out runs/cmp
    hiso flower --nodes 2 --clients 4 --algorithm examples/custom_method.py:FZOO --out runs/ffz

or from Python: ``hiso.run(task, DIR, algorithm="examples.custom_method:FZOO", ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hiso.core.method import Method


@dataclass(frozen=True)
class FZOO(Method):
    """FZOO's sigma-normalised one-sided ZO step (the forward differences over their spread)."""

    floor: float = 1e-12  # the spread's floor: P equal scalars (a flat loss) give zeros, not 0 / 0

    # what hiso's registry reads (hiso.methods.registry): the name in tables, the lr family a
    # task's default_lr keys it by, the options it reads and what it can be combined with
    display = "FZOO"
    gradient = "zo"
    options = frozenset({"zo_estimate"})
    can = frozenset({"faults", "robust", "weighted", "lr_decay", "int8"})

    @classmethod
    def from_config(cls, cfg) -> "FZOO":
        """The method for a run (``cfg`` is the run's RunConfig): one spread needs P >= 2
        forward differences (central ones are two-sided, not FZOO's estimate)."""
        if cfg.perturbations < 2 or cfg.difference != "forward":
            raise ValueError("FZOO normalises P >= 2 forward differences by their spread: give --perturbations 2 "
                             "or more and --difference forward")
        return cls()

    def step_scalars(self, g: np.ndarray) -> np.ndarray:
        """g_p / std_p(g) in float64, rounded to float32 once: the same numbers on every client."""
        g64 = np.asarray(g, dtype=np.float64)
        sigma = max(float(np.std(g64)), self.floor)
        return (g64 / sigma).astype(np.float32)


if __name__ == "__main__":
    import sys
    import tempfile

    import hiso

    with tempfile.TemporaryDirectory() as out:
        spec = f"{__file__}:FZOO"
        run = hiso.run("quadratic", out, algorithm=spec, perturbations=4, rounds=30, lr=0.05)
        print(f"{spec}: gap {run.summary['final'].get('gap', float('nan')):.4g} after 30 rounds")
        sys.exit(0)
