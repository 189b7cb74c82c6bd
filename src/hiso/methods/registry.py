"""Method names -> what hiso knows of each method: the one table the rest asks.

Configuration (``--algorithm`` choices, which options a method reads, what it can be combined
with), ``hiso compare``, the reports, the runners, rebuild, export, resume and the Flower apps ask
:func:`method_info` about a run's ``algorithm`` and never compare its name. A method declares:

* ``family``: ``"scalar"`` (seeds and scalars on the wire, one log every replica folds:
  rebuild, resume, snapshots, the Flower scalar apps), ``"seed-pool"`` (FedKSeed: a fixed pool
  of seeds, its own log) or ``"full-model"`` (d values each way; no log to rebuild from);
* ``gradient``: ``"zo"`` or ``"first-order"`` (the family a task's ``default_lr`` is keyed by);
* ``options``: the method-specific options it reads (:data:`METHOD_OPTIONS`); one it does not
  read, set to another value than its default, is refused or reported as unused;
* ``can``: its capabilities (:data:`CAPABILITIES`); an option that needs one it lacks is refused;
* ``build(cfg)``: the :class:`~hiso.core.method.Method` whose hooks the core calls;
* ``cls``: its Method class (every built-in is one: HiSo, DeComFL, FeedSign, Ferret, FedKSeed,
  the full-model baselines, sketch, FedKRSO, greedy, ConMeZO): its dataclass fields are its
  options (``--method-opt KEY=VALUE``, as a user's method's; a field marked :data:`hiso.methods.options.RUN` carries a
  run's value instead), and it is built as a user's method is (``from_config``, then the
  options). A built-in class with a ``flags`` attribute (HiSo's: ``"HiSo's preconditioner"``,
  whose they are) also has its fields as top-level flags and TOML keys (``--nu``, ``nu = 0.1``;
  :func:`flag_options`), listed before the option its ``flags_at`` names (default ``momentum``).

Such a class declares its entry in class attributes (:func:`contract_method`): ``display``,
``gradient``, ``can``, ``options``, ``default_server_lr`` (``server_lr`` above), and a built-in's
``family`` (FedKSeed's ``"seed-pool"``, the full-model baselines' ``"full-model"``) and
``server_opt`` too (:func:`class_info`). A user's method needs no registration: ``--algorithm module:Class`` (or ``path/to/file.py:Class``) names
a :class:`hiso.core.method.Method` subclass whose attributes are read the same way (family
``scalar``), and ``from_config(cfg)`` builds it (default: ``Class()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# what a method may declare it supports
CAPABILITIES = frozenset({
    "preconditioner",  # H, a stage that preconditions the directions (HiSo's)
    "dp",  # client-level differential privacy of the scalars
    "secagg",  # secure aggregation (the server learns the sum only)
    "faults",  # simulated drops, late, duplicate and damaged answers, Byzantine clients
    "robust",  # aggregate median / trimmed-mean
    "weighted",  # clients weighted by their data size
    "int8",  # scalar_dtype int8
    "lowbit",  # scalar_dtype int4, int2 and sign (the log and downlink in 4, 2 or 1 bits a scalar)
    "lr_decay", "momentum", "step_norm",  # stages of the fold
    "refresh",  # direction_refresh (lowrank V from the round)
    "structured",  # sparse and lowrank direction families
    "one-seed",  # one seed per step: P = 1 and central differences by default
    "backprop",  # its clients backpropagate (a task without gradients cannot run it)
    "grad_clip",  # its clients' local SGD clips each step's gradient norm
})

# options that only some methods read (the rest of RunConfig is every method's)
METHOD_OPTIONS = {
    "zo_estimate": ("perturbations", "mu", "difference"),
}
_WHOSE = {"zo_estimate": "the zeroth-order estimate's"}


@dataclass(frozen=True)
class MethodInfo:
    """What hiso knows about a method before running it (see the module's docstring)."""

    name: str
    display: str
    family: str = "scalar"
    gradient: str = "zo"
    options: frozenset[str] = frozenset({"zo_estimate"})
    can: frozenset[str] = frozenset()
    build: Callable[[Any], Any] = field(default=lambda cfg: None, compare=False)
    server_lr: float | None = None  # the server step's default (full-model baselines, ferret)
    server_opt: str | None = None  # the full-model server optimiser (hiso.baselines.server_opt)
    doc: str = ""
    cls: type | None = field(default=None, compare=False)  # a Method class whose fields are its options

    def __post_init__(self) -> None:
        if self.family not in ("scalar", "seed-pool", "full-model"):
            raise ValueError(f"method {self.name}: family must be scalar, seed-pool or full-model, got {self.family!r}")
        if self.gradient not in ("zo", "first-order"):
            raise ValueError(f"method {self.name}: gradient must be zo or first-order, got {self.gradient!r}")
        if bad := set(self.can) - CAPABILITIES:
            raise ValueError(f"method {self.name}: unknown capabilities {sorted(bad)} (see {__name__}.CAPABILITIES)")
        if bad := set(self.options) - set(METHOD_OPTIONS):
            raise ValueError(f"method {self.name}: unknown option groups {sorted(bad)} (see {__name__}.METHOD_OPTIONS)")

    @property
    def option_class(self) -> type | None:
        """The Method class whose dataclass fields are this method's ``method_opts`` (None: none)."""
        return self.cls

    def reads(self, option: str) -> bool:
        """Whether the method reads ``option``: one of its groups', or its class's own field."""
        from .options import fields_of
        return any(option in METHOD_OPTIONS[g] for g in self.options) or option in fields_of(self.cls)


_REGISTRY: dict[str, MethodInfo] = {}
_USER: dict[tuple[str, str | None], MethodInfo] = {}  # by spec and file digest


def register_method(info: MethodInfo) -> MethodInfo:
    if info.name in _REGISTRY and _REGISTRY[info.name] != info:
        raise ValueError(f"method {info.name!r} is registered twice")
    _REGISTRY[info.name] = info
    return info


def method_names() -> tuple[str, ...]:
    """The built-in methods' names, in the order --help and errors list them."""
    return tuple(_REGISTRY)


def is_user_method(name: str) -> bool:
    return ":" in name


def _file_digest(spec: str) -> str | None:
    """SHA-256 of the file a ``file.py:Class`` spec names (None for a module's, or no such file)."""
    import hashlib
    from pathlib import Path
    where = spec.rpartition(":")[0]
    if not where.endswith(".py"):
        return None
    try:
        return hashlib.sha256(Path(where).expanduser().read_bytes()).hexdigest()
    except OSError:
        return None


def method_info(name: str) -> MethodInfo:
    """The built-in method ``name``, or the user's method it names (``module:Class``, ``file.py:Class``)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if is_user_method(name):
        key = (name, _file_digest(name))  # an edited file is read again (what config.json records is what runs)
        if key not in _USER:
            _USER[key] = _user_method_info(name)
        return _USER[key]
    raise ValueError(f"unknown algorithm {name!r} (choose from {', '.join(_REGISTRY)}, or module:Class / "
                     "path/to/file.py:Class for your own)")


def user_method_class(spec: str) -> type:
    """The :class:`hiso.core.method.Method` subclass ``module:Class`` or ``file.py:Class`` names."""
    from ..core.method import Method
    from ..plugins import import_object

    obj = import_object(spec, "algorithm")
    if not (isinstance(obj, type) and issubclass(obj, Method)):
        raise ValueError(f"algorithm {spec!r}: {obj!r} is not a subclass of hiso.core.method.Method")
    return obj


def _user_method_info(spec: str) -> MethodInfo:
    # P, mu and the difference shape every scalar method's record and estimate: always read
    return class_info(spec, user_method_class(spec), frozenset({"zo_estimate"}), builtin=False)


def class_info(name: str, obj: type, read: frozenset = frozenset(), builtin: bool = True) -> MethodInfo:
    """The registry entry a Method class declares in its attributes: ``display`` (default: its
    name), ``gradient``, ``options`` (with ``read`` added), ``can`` and ``default_server_lr``,
    and for a built-in class the registry's other facts (``family``: FedKSeed's ``"seed-pool"``;
    ``server_opt``), which a user's method cannot declare; its fields are its options, and
    ``from_config`` then its options build it."""
    from .options import build_user_method

    family, server_opt = (getattr(obj, "family", "scalar"), getattr(obj, "server_opt", None)) if builtin else \
        ("scalar", None)
    return MethodInfo(name, getattr(obj, "display", obj.__name__), family, getattr(obj, "gradient", "zo"),
                      frozenset(getattr(obj, "options", ())) | read, frozenset(getattr(obj, "can", ())),
                      lambda cfg: build_user_method(obj, cfg), server_lr=getattr(obj, "default_server_lr", None),
                      server_opt=server_opt, doc=(obj.__doc__ or "").strip().split("\n")[0], cls=obj)


def contract_method(name: str, module: str, cls_name: str) -> MethodInfo:
    """A built-in method written on the contract as a user's would be: its class's attributes are
    its registry entry (:func:`class_info`), its fields its options."""
    import importlib

    return class_info(name, getattr(importlib.import_module(module), cls_name))


REFERENCE = "decomfl"  # the paper's baseline: a comparison's default reference arm


def default_reference(arms) -> str:
    """A comparison's reference arm when none is named: the paper's baseline if it is an arm,
    else the first arm."""
    arms = list(arms)
    return REFERENCE if REFERENCE in arms else arms[0]


def with_capability(cap: str) -> list[str]:
    """The built-in methods that declare ``cap`` (for a refusal that says where it belongs)."""
    return [n for n, info in _REGISTRY.items() if cap in info.can]


def builtin_name(cls: type) -> str | None:
    """The name of the built-in method whose class is ``cls`` (HiSo: ``hiso``), or None."""
    return next((name for name, info in _REGISTRY.items() if info.cls is cls), None)


def flag_options() -> dict[str, tuple[type, str]]:
    """The built-in methods' own options that are also top-level flags and TOML keys (HiSo's
    ``nu``, ...): name -> (the Method class whose field it is, whose they are, for notes: the
    field's ``whose`` metadata, else its class's ``flags``). A field several classes share (the
    full-model baselines' ``server_lr``) is the first class's flag; a field marked
    :data:`hiso.methods.options.SHARED` is another class's flag (Ferret's ``server_lr`` is
    ``--server-lr``, the full-model baselines'). Flags keep each class's field order (FedAdam's
    ``beta1`` sits between ``server_lr`` and ``wire_dtype``, which FedZO has too)."""
    import dataclasses

    from .options import fields_of
    order: list[str] = []
    out: dict[str, tuple[type, str]] = {}
    for info in _REGISTRY.values():
        whose = getattr(info.cls, "flags", None) if info.cls is not None else None
        if not whose:
            continue
        meta = {f.name: f.metadata for f in dataclasses.fields(info.cls)}
        names = [n for n in fields_of(info.cls) if not meta[n].get("shared")]
        for i, name in enumerate(names):
            if name in out:
                continue
            out[name] = (info.cls, meta[name].get("whose", whose))
            later = next((order.index(n) for n in names[i + 1:] if n in order), len(order))
            order.insert(later, name)
    return {name: out[name] for name in order}


def in_words(names) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def option_groups() -> list[tuple[tuple[str, ...], tuple[str, ...], str]]:
    """(option names, the methods that read them, whose they are), for unused-option reports."""
    return [(names, tuple(n for n, info in _REGISTRY.items() if group in info.options), _WHOSE[group])
            for group, names in METHOD_OPTIONS.items()]


# the built-in methods, in the order --help and errors list them
register_method(contract_method("hiso", "hiso.methods.hiso_method", "HiSo"))
register_method(contract_method("decomfl", "hiso.methods.decomfl", "DeComFL"))
register_method(contract_method("feedsign", "hiso.methods.feedsign", "FeedSign"))
register_method(contract_method("ferret", "hiso.methods.ferret", "Ferret"))
register_method(contract_method("fedkseed", "hiso.methods.fedkseed_method", "FedKSeed"))
register_method(contract_method("fedzo", "hiso.methods.fullmodel", "FedZO"))
register_method(contract_method("fedavg", "hiso.methods.fullmodel", "FedAvg"))
register_method(contract_method("fedadam", "hiso.methods.fullmodel", "FedAdam"))
register_method(contract_method("fedyogi", "hiso.methods.fullmodel", "FedYogi"))
register_method(contract_method("fedadagrad", "hiso.methods.fullmodel", "FedAdagrad"))
# methods added since the table above was fixed (its order is --help's)
register_method(contract_method("sketch", "hiso.methods.sketch", "Sketch"))
register_method(contract_method("fedkrso", "hiso.methods.fedkrso", "FedKRSO"))
register_method(contract_method("greedy", "hiso.methods.greedy", "Greedy"))
register_method(contract_method("conmezo", "hiso.methods.conmezo", "ConMeZO"))
