"""A user's method's own options: the fields of its :class:`~hiso.core.method.Method` dataclass.

``--method-opt c=0.5`` (repeatable), a ``[method]`` table in a TOML file, ``method_opts = {c =
0.5}`` in a ``[compare.variants]`` arm and ``hiso.run(..., method_opts={"c": 0.5})`` all set
``RunConfig.method_opts``; each value is checked against the field's type and stored typed in
config.json, so a run names its options and rebuilds with them. A method validates its options'
values in ``__post_init__`` (it runs for every instance hiso builds).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Any

_CASTS = {int: int, float: float, str: str}

# a method field's metadata marking it the run's value the method carries (Ferret's local steps,
# server step and clip, set by its ``from_config``), not one of its options
RUN = {"run": True}
# a built-in method field's metadata marking it an option whose flag another built-in class
# declares (Ferret's server_lr is --server-lr, the full-model baselines'): the flag reaches it
# when the run is its method's, the help and place of the flag are the other class's
SHARED = {"shared": True}


def parse_pairs(items) -> dict[str, str]:
    """``["c=0.5", "name=x"]`` (the command line's --method-opt) as a dict; a dict passes through."""
    if items is None or isinstance(items, dict):
        return items or {}
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise ValueError(f"method options {items!r}: expected a table or a list of KEY=VALUE")
    out = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        if not eq or not key.strip():
            raise ValueError(f"method option {item!r}: expected KEY=VALUE (e.g. --method-opt c=0.5)")
        out[key.strip()] = value.strip()
    return out


def fields_of(cls: type) -> dict[str, Any]:
    """The options a method class declares: its dataclass fields (name -> type), but those that
    carry the run's values (metadata :data:`RUN`)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    return dict(_fields_of(cls))


@functools.lru_cache(maxsize=256)
def _fields_of(cls: type) -> tuple[tuple[str, Any], ...]:
    # typing.get_type_hints evaluates every annotation anew (ms a class): the command line asks
    # it once per flag when it builds its parser; a class edited and reloaded is another key
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints.get(f.name, Any)) for f in dataclasses.fields(cls)
                 if f.init and not f.metadata.get("run"))


def cast_option(name: str, kind: Any, value: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if value is None and type(None) in typing.get_args(kind):
        return None
    kind = args[0] if len(args) == 1 else kind
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes", "on"):
            return True
        if str(value).lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"method option {name} = {value!r}: expected true or false")
    cast = _CASTS.get(kind)
    if cast is None:
        return value
    if isinstance(value, bool) or (cast is int and isinstance(value, float)):
        raise ValueError(f"method option {name} = {value!r}: expected {'an integer' if cast is int else 'a number'}")
    try:
        return cast(value)
    except (TypeError, ValueError):
        what = {int: "an integer", float: "a number", str: "text"}[cast]
        raise ValueError(f"method option {name} = {value!r}: expected {what}") from None


def check_options(cls: type, opts: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """``opts`` typed by ``cls``'s fields (one-line ValueError for an unknown name or a bad value)."""
    fields = fields_of(cls)
    for name in opts:
        if name not in fields:
            known = ", ".join(fields) or "none: declare them as dataclass fields of the Method subclass"
            raise ValueError(f"method option {name!r}: {algorithm} has no such option (its options: {known})")
    return {name: cast_option(name, fields[name], value) for name, value in opts.items()}


def build_user_method(cls: type, cfg) -> Any:
    """The method a run uses: ``cls.from_config(cfg)`` (default ``cls()``) with the run's
    ``method_opts`` set (``dataclasses.replace``, so ``__post_init__`` checks them)."""
    from_config = getattr(cls, "from_config", None)
    method = from_config(cfg) if from_config is not None else cls()
    opts = getattr(cfg, "method_opts", None) or {}
    return dataclasses.replace(method, **opts) if opts else method


def method_spec(method: Any) -> tuple[str, dict[str, Any]]:
    """``(algorithm, method_opts)`` for a method given as a name, a Method subclass or an instance
    (``hiso.run(task, out, algorithm=Clip(c=0.5))``): a class defined in a file hiso loaded or in
    a module of the user's is named by its file (found from anywhere later), one in an installed
    package as ``module:Class``; an
    instance's fields that differ from their defaults become its options."""
    import sys

    from ..core.method import Method
    if isinstance(method, str):
        return method, {}
    cls = method if isinstance(method, type) else type(method)
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"algorithm: a method's name, a hiso.core.method.Method subclass or an instance of one, "
                        f"not {type(method).__name__}")
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    installed = path is not None and any(part in ("site-packages", "dist-packages") for part in Path(path).parts)
    if not installed and (path is not None or cls.__module__ == "__main__"):  # a file of the user's: by its path
        if path is None:
            raise ValueError(f"algorithm: {cls.__qualname__} is defined interactively; put it in a file "
                             "and give path/to/file.py:Class")
        spec = f"{path}:{cls.__qualname__}"
    else:
        spec = f"{cls.__module__}:{cls.__qualname__}"
    opts = {}
    if not isinstance(method, type) and dataclasses.is_dataclass(method):
        options = fields_of(cls)
        for f in dataclasses.fields(method):
            value = getattr(method, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            if f.name in options and value != default:
                opts[f.name] = value
    return spec, opts
