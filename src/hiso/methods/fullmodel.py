"""The full-model baselines as method classes: FedZO, FedAvg, FedAdam, FedYogi and FedAdagrad,
their options their fields (the server step, the adaptive optimisers' moments and adaptivity, the
messages' number format).

These methods send the model (d values each way) and keep no log to rebuild from (family
``"full-model"``): their rounds are run by :mod:`hiso.runners.fullmodel` and, over Flower, by
:mod:`hiso.flower.fullmodel`; their local steps and server optimisers are
:mod:`hiso.baselines`' (``server_opt`` below names the optimiser). The contract's hooks are never
called for them. Their fields are also top-level flags and TOML keys (``--server-lr 0.1``,
``server_lr = 0.1``), as well as ``--method-opt server_lr=0.1`` and a ``[method]`` table.

``server_lr`` left unset (None) is the class's ``default_server_lr``: config.json records that
it was not given, as it did when it was a run's field, so a run's configuration hash is the one
it had then.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from ..core.method import Method

WIRE_DTYPES = ("float32", "float16", "bfloat16")
SERVER_STEP = "the full-model baselines' and ferret's server step"  # whose --server-lr is, for notes


def server_lr_field():
    """The server step's field: None is the class's ``default_server_lr``."""
    return field(default=None, metadata={"help": (
        "server learning rate of full-model baselines (default: 1.0 for fedavg and fedzo, 0.01 for fedadam, "
        "fedyogi, fedadagrad)"), "whose": SERVER_STEP})


def _wire_dtype():
    return field(default="float32", metadata={"help": "number format of full-model baselines' messages",
                                              "whose": "the full-model baselines' messages"})


def _beta(default: float, which: str):
    return field(default=default, metadata={"help": f"server {which}-moment decay (fedadam, fedyogi)",
                                            "whose": "fedadam's and fedyogi's server moments", "range": (0, 1)})


def _tau():
    return field(default=1e-3, metadata={"help": "adaptivity (epsilon) of fedadam, fedyogi, fedadagrad",
                                         "whose": "the adaptive server optimisers'", "range": (0, None)})


def check_server_lr(value) -> None:
    """A server step's value: None (the method's default) or a number > 0 (one-line ValueError)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"server_lr = {value!r}: expected a number")
    if not value > 0:
        raise ValueError(f"server_lr must be > 0, got {value!r}")


def _number(name: str, value, low: float, high: float | None) -> None:
    """``value`` a number with low <= value < high (high None: low < value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} = {value!r}: expected a number")
    if high is None and not value > low:
        raise ValueError(f"{name} must be > {low:g}, got {value!r}")
    if high is not None and not low <= value < high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}), got {value!r}")


@dataclass(frozen=True)
class FullModel(Method):
    """What every full-model baseline has: the server step and the messages' number format."""

    gradient: ClassVar[str] = "first-order"
    family: ClassVar[str] = "full-model"  # the model on the wire, no log (the registry's family)
    options: ClassVar[frozenset] = frozenset()
    can: ClassVar[frozenset] = frozenset({"weighted"})
    default_server_lr: ClassVar[float] = 1.0
    server_opt: ClassVar[str] = "avg"  # the server optimiser (hiso.baselines.server_opt)
    flags: ClassVar[str] = "the full-model baselines'"  # its fields are top-level flags too; whose they are
    flags_at: ClassVar[str] = "threads"  # where they sit among the run's options (--help, docs/cli.md)

    def __post_init__(self) -> None:
        check_server_lr(self.server_lr)
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        for f in fields(self):  # a subclass's moments and adaptivity: their range in their field
            if "range" in f.metadata:
                _number(f.name, getattr(self, f.name), *f.metadata["range"])

    @property
    def resolved_server_lr(self) -> float:
        """The server step this run takes: ``server_lr``, or the class's default."""
        return self.default_server_lr if self.server_lr is None else self.server_lr


@dataclass(frozen=True)
class FedZO(FullModel):
    """ZO local steps, the model on the wire."""

    server_lr: float | None = server_lr_field()
    wire_dtype: Literal["float32", "float16", "bfloat16"] = _wire_dtype()

    display: ClassVar[str] = "FedZO"
    gradient: ClassVar[str] = "zo"
    options: ClassVar[frozenset] = frozenset({"zo_estimate"})


@dataclass(frozen=True)
class FedAvg(FullModel):
    """Local SGD, the model on the wire, the mean update times the server step."""

    server_lr: float | None = server_lr_field()
    wire_dtype: Literal["float32", "float16", "bfloat16"] = _wire_dtype()

    display: ClassVar[str] = "FedAvg"


@dataclass(frozen=True)
class FedAdam(FullModel):
    """Local SGD, the model on the wire, Adam on the server (Reddi et al. 2021)."""

    server_lr: float | None = server_lr_field()
    beta1: float = _beta(0.9, "first")
    beta2: float = _beta(0.99, "second")
    server_tau: float = _tau()
    wire_dtype: Literal["float32", "float16", "bfloat16"] = _wire_dtype()

    display: ClassVar[str] = "FedAdam"
    default_server_lr: ClassVar[float] = 0.01
    server_opt: ClassVar[str] = "adam"


@dataclass(frozen=True)
class FedYogi(FedAdam):
    """Local SGD, the model on the wire, Yogi on the server (Reddi et al. 2021)."""

    display: ClassVar[str] = "FedYogi"
    server_opt: ClassVar[str] = "yogi"


@dataclass(frozen=True)
class FedAdagrad(FullModel):
    """Local SGD, the model on the wire, Adagrad on the server (Reddi et al. 2021)."""

    server_lr: float | None = server_lr_field()
    server_tau: float = _tau()
    wire_dtype: Literal["float32", "float16", "bfloat16"] = _wire_dtype()

    display: ClassVar[str] = "FedAdagrad"
    default_server_lr: ClassVar[float] = 0.01
    server_opt: ClassVar[str] = "adagrad"


def method_of(cfg) -> FullModel:
    """The method of the run ``cfg`` (a :class:`~hiso.config.RunConfig` of a full-model baseline)."""
    method = cfg.method.build(cfg)
    if not isinstance(method, FullModel):
        raise ValueError(f"{cfg.algorithm!r} is not a full-model algorithm")
    return method
