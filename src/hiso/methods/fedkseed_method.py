"""FedKSeed as a method class: its options (the pool's size K and how a step draws from it) are
its fields; its pool, replica, wire and log are :mod:`hiso.methods.fedkseed`'s, its rounds
:mod:`hiso.methods.fedkseed_rounds`'. The registry reads its family (``"seed-pool"``: its own
log, not the seed-and-scalar protocol's) from the class. Its fields are also top-level flags and
TOML keys (``--seed-pool 1024``, ``seed_pool = 1024``; ``flags`` below), as well as
``--method-opt seed_pool=1024`` and a ``[method]`` table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..core.method import Method
from .fedkseed import SAMPLING, check_pool


@dataclass(frozen=True)
class FedKSeed(Method):
    """A fixed pool of seeds, (index, scalar) pairs on the wire."""

    seed_pool: int = field(default=4096, metadata={"help": (
        "fedkseed: K, the candidate seeds fixed for the run (1..65536; default: 4096, the value of the paper's LLM "
        "runs, Qin et al. 2024)")})
    seed_sampling: Literal["weighted", "uniform"] = field(default="weighted", metadata={"help": (
        "fedkseed: how a local step picks its seed: weighted (FedKSeed-Pro: softmax of the min-max normalised mean "
        "|scalar| per seed) or uniform (plain FedKSeed)")})

    display: ClassVar[str] = "FedKSeed"
    gradient: ClassVar[str] = "zo"
    family: ClassVar[str] = "seed-pool"  # its own log and rounds (the registry's family)
    options: ClassVar[frozenset] = frozenset({"zo_estimate"})
    can: ClassVar[frozenset] = frozenset({"one-seed"})
    flags: ClassVar[str] = "fedkseed's"  # its fields are top-level flags too; whose they are
    flags_at: ClassVar[str] = "ferret_k"  # where they sit among the run's options (--help, docs/cli.md)

    def __post_init__(self) -> None:
        if isinstance(self.seed_pool, bool) or not isinstance(self.seed_pool, int):
            raise ValueError(f"seed_pool = {self.seed_pool!r}: expected an integer")
        check_pool(self.seed_pool)
        if self.seed_sampling not in SAMPLING:
            raise ValueError(f"seed_sampling must be one of {', '.join(SAMPLING)}, got {self.seed_sampling!r}")

    @classmethod
    def of(cls, cfg) -> "FedKSeed":
        """The method of the run ``cfg`` (a :class:`~hiso.config.RunConfig` of fedkseed: its ``method_opts``)."""
        return cls(**(cfg.method_opts or {}))
