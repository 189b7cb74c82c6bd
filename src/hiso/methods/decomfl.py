"""DeComFL (Li et al. 2024), the paper's baseline, on the methods contract: seeds and scalars on
the wire, the ZO estimate on the client, the (robust) mean on the server, the chain fold on
every replica. Every hook is the contract's default (:class:`hiso.core.method.Method`), so a
run built from this class computes what a run without a method does, bit for bit, and has the
same protocol fingerprint (:data:`hiso.compat.FINGERPRINT_LEGACY_KEY`: no ``method`` entry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.method import Method

# every capability of the seed-and-scalar protocol (HiSo's, without H)
CAN = frozenset({"dp", "secagg", "faults", "robust", "weighted", "int8", "lowbit", "lr_decay", "momentum",
                 "step_norm", "refresh", "structured"})


@dataclass(frozen=True)
class DeComFL(Method):
    """Seeds and scalars on the wire (the contract's default round)."""

    display: ClassVar[str] = "DeComFL"
    gradient: ClassVar[str] = "zo"
    options: ClassVar[frozenset] = frozenset({"zo_estimate"})
    can: ClassVar[frozenset] = CAN


def decomfl(lr: float, **kw):
    """A ZOConfig of DeComFL (its fingerprint is a ZOConfig's without a method)."""
    from ..core.config import ZOConfig
    return ZOConfig(lr=lr, method=DeComFL(), **kw)
