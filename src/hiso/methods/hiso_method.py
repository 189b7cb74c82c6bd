"""HiSo on the methods contract: DeComFL's round with a diagonal preconditioner H (Hessian-informed)
kept by every replica, so the wire still carries seeds and scalars only.

H is a stage of the fold (:class:`hiso.core.chain.Precondition`, the EMA of
:mod:`hiso.core.preconditioner`): this class's fields are its options, its ``stages`` hook adds
it before the run's own stages, and the replica keeps H under the stage's name ``h`` (model.pt's
and checkpoint.pt's key). Its fields are also top-level flags and TOML keys (``--nu 0.1``,
``nu = 0.1``; ``flags`` below), as well as ``--method-opt nu=0.1`` and a ``[method]`` table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..core.chain import Precondition
from ..core.method import Method
from ..core.preconditioner import GRANULARITIES, STATS, PreconditionerConfig, scalar_power, update_block_

# every capability of the seed-and-scalar protocol, and H
CAN = frozenset({"dp", "secagg", "faults", "robust", "weighted", "int8", "lowbit", "lr_decay", "momentum",
                 "step_norm", "refresh", "structured", "preconditioner"})


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class HiSo(Method):
    """Seeds and scalars on the wire, directions through HiSo's Hessian-informed preconditioner H."""

    # nu weights the NEW value (the authors' code calls 1 - nu the smoothing s = 0.95)
    nu: float = field(default=0.05, metadata=_help("weight of the new value in H's moving average (HiSo)"))
    eps: float = field(default=1e-8, metadata=_help("added to ghat^2 in H's update, keeps H above zero (HiSo)"))
    h_min: float | None = field(default=None, metadata=_help("lower clip of H (HiSo; default: none)"))
    h_max: float | None = field(default=None, metadata=_help("upper clip of H (HiSo; default: none)"))
    h_source: Literal["last", "every"] = field(default="last", metadata=_help(
        "H's update from the global direction of the last local step or of every local step (HiSo)"))
    # variants at no extra bytes (derived in core/preconditioner.py): H's statistic, granularity, bias correction
    h_stat: Literal["ghat2", "floor", "denoised"] = field(default="ghat2", metadata=_help(
        "what H averages (HiSo): ghat2 (the paper's ghat^2), floor (the estimator's noise floor S/(P H) from the "
        "scalars alone), denoised (ghat^2 minus that floor, unbiased, floored at 0)"))
    h_granularity: Literal["coordinate", "tensor", "model"] = field(default="coordinate", metadata=_help(
        "H per coordinate (the paper's), one value per tensor, or one for the whole model (HiSo)"))
    h_bias_correction: bool = field(default=False, metadata=_help(
        "Adam-style bias correction of H's moving average (H_1 is the first statistic, not 0.95 + 0.05 x it) (HiSo)"))

    display: ClassVar[str] = "HiSo"
    gradient: ClassVar[str] = "zo"
    options: ClassVar[frozenset] = frozenset({"zo_estimate"})
    can: ClassVar[frozenset] = CAN
    flags: ClassVar[str] = "HiSo's preconditioner"  # its fields are top-level flags too; whose they are

    def __post_init__(self) -> None:
        for name in ("nu", "eps", "h_min", "h_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (value is None and name.startswith("h_")
                                               or isinstance(value, (int, float))):
                raise ValueError(f"{name} = {value!r}: expected a number")
        if not 0.0 <= self.nu <= 1.0:
            raise ValueError(f"nu must be in [0, 1], got {self.nu}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        for name in ("h_min", "h_max"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.h_min is not None and self.h_max is not None and self.h_max < self.h_min:
            raise ValueError(f"h_max ({self.h_max}) must be >= h_min ({self.h_min})")
        for name, choices in (("h_source", ("last", "every")), ("h_stat", STATS), ("h_granularity", GRANULARITIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if not isinstance(self.h_bias_correction, bool):
            raise ValueError(f"h_bias_correction = {self.h_bias_correction!r}: expected true or false")
        if self.h_bias_correction and self.nu == 0:
            raise ValueError("h_bias_correction needs nu > 0")

    @property
    def precond(self) -> PreconditionerConfig:
        """H's configuration, as :mod:`hiso.core.preconditioner` names it."""
        return PreconditionerConfig(nu=self.nu, eps=self.eps, h_min=self.h_min, h_max=self.h_max,
                                    source=self.h_source, stat=self.h_stat, granularity=self.h_granularity,
                                    bias_correction=self.h_bias_correction)

    @classmethod
    def of(cls, precond: PreconditionerConfig | None = None) -> "HiSo":
        """The method whose H is ``precond`` (None: the defaults)."""
        p = precond or PreconditionerConfig()
        return cls(nu=p.nu, eps=p.eps, h_min=p.h_min, h_max=p.h_max, h_source=p.source, h_stat=p.stat,
                   h_granularity=p.granularity, h_bias_correction=p.bias_correction)

    def stages(self, chain: list) -> list:
        """H (its stage ``h``), then the run's step-size and step stages."""
        return [Precondition(self.precond), *chain]


def floor_step_(level, step_scalars, inv_mean: float, precond: PreconditionerConfig, t: int) -> None:
    """One EMA step of H's noise-floor level (``hiso diagnose``): ``level`` (a one-element tensor)
    fed, as H's own average is, with S / P times the coordinate mean of 1 / H, S the local
    step's mean squared scalar (``step_scalars``: its P scalars)."""
    update_block_(level, scalar_power(step_scalars) / len(step_scalars) * inv_mean, precond, t)


def hiso(lr: float, precond: PreconditionerConfig | None = None, **kw):
    """A ZOConfig of HiSo with H's configuration ``precond`` (None: the defaults)."""
    from ..core.config import ZOConfig
    return ZOConfig(lr=lr, method=HiSo.of(precond), **kw)


from .decomfl import decomfl  # noqa: E402,F401 (its factory, beside hiso()'s as before)
