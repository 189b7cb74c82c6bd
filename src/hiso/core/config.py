"""The numbers that define a scalar-only ZO algorithm: the run's, and its method (HiSo's H, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .method import Method, check_method


@dataclass(frozen=True)
class ZOConfig:
    """lr eta, smoothing mu, P perturbations, tau local steps; ``method=None`` is DeComFL
    (HiSo: ``method=hiso.methods.HiSo()``, whose stage keeps H)."""

    lr: float
    mu: float = 1e-3
    perturbations: int = 5
    local_steps: int = 1
    difference: Literal["forward", "central"] = "forward"
    directions: str = "philox-rademacher"  # the direction family (see hiso.core.directions.FAMILIES)
    scalar_dtype: str = "float32"  # the scalars' number format on the wire and in the log (float16, bfloat16, int8)
    momentum: Any = None  # the fold's step stage instead of SGD (hiso.methods.momentum); None: none
    lr_decay: float | None = None  # inverse-time decay horizon T (rounds): round r steps with lr / (1 + r / T)
    dp: Any = None  # client-level differential privacy of the scalars (hiso.methods.privacy.DPConfig); None: none
    method: Method | None = None  # a method's own hooks and stages (hiso.core.method); None: DeComFL's
    step_norm: Any = None  # a step-size stage of the fold (hiso.methods.stepnorm); None: none

    def __post_init__(self) -> None:
        if self.method is not None:
            check_method(self.method)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.lr_decay is not None and not self.lr_decay > 0:
            raise ValueError(f"lr_decay must be > 0 rounds, got {self.lr_decay}")
        if not self.mu > 0:
            raise ValueError(f"mu must be > 0, got {self.mu}")
        if self.perturbations < 1:
            raise ValueError(f"perturbations must be >= 1, got {self.perturbations}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        from .directions import check_family
        check_family(self.directions)
        if self.step_norm is not None and self.local_steps > 1:
            raise ValueError("step_norm needs local_steps 1 (a local step cannot know its round's spread yet)")
        from .scalars import SCALAR_DTYPES
        if self.scalar_dtype not in SCALAR_DTYPES:
            raise ValueError(f"scalar_dtype must be one of {', '.join(SCALAR_DTYPES)}, got {self.scalar_dtype!r}")
        if self.difference not in ("forward", "central"):
            raise ValueError(f"difference must be 'forward' or 'central', got {self.difference!r}")

    def lr_at(self, round: int) -> float:
        """The step size of round ``round`` (its local steps and its global step).

        Constant ``lr`` by default; with ``lr_decay = T`` it is ``lr / (1 + round / T)``, the
        classical inverse-time (Robbins-Monro) schedule: half of lr at round T, no horizon to
        fix in advance (a run extended later keeps its earlier rounds' steps). A pure function
        of the round, computed in float64 the same way on every replica, so replays stay exact.
        """
        if self.lr_decay is None:
            return self.lr
        return self.lr / (1.0 + round / self.lr_decay)

    @property
    def uplink(self) -> Any:
        """The codec of the clients' answers on the wire (:mod:`hiso.core.uplink`: the method's)."""
        from .uplink import uplink_codec
        return uplink_codec(self.method)

    @property
    def precond(self):
        """H's configuration (:class:`~hiso.core.preconditioner.PreconditionerConfig`) where the
        method's stages precondition the directions (HiSo's), else None."""
        from .chain import preconditioner, stages_for
        pre = preconditioner(stages_for(self))
        return None if pre is None else pre.cfg

    @property
    def shape(self) -> tuple[int, int]:
        """(tau, P): the shape of a round's seeds and scalars."""
        return (self.local_steps, self.perturbations)

