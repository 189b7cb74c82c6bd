"""The units of a run's options: ``checkpoint_every`` (rounds or a time), sizes (``512M``) and the
simulated attackers' attacks (``scale,sign-flip``); a TOML file read, its values and the flags
merged (:func:`merge_options`: a method's flags, HiSo's ``nu``, into its ``method_opts``), and the
error a bad configuration is (re-exported by :mod:`hiso.config`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def parse_every(spec: str | int) -> tuple[str, float] | None:
    """``checkpoint_every`` as ("rounds", n) or ("seconds", s); None for never (0). Raises
    ValueError (one line) for anything else."""
    import re

    if isinstance(spec, bool):
        raise ValueError(f"checkpoint_every must be rounds (an integer) or a time such as 5m, got {spec!r}")
    text = str(spec).strip()
    if re.fullmatch(r"[0-9]+", text):
        n = int(text)
        return None if n == 0 else ("rounds", n)
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)\s*([smh])", text)
    if m is None:
        raise ValueError(f"checkpoint_every must be rounds (an integer, 0 for never) or a time such as 90s, 5m or "
                         f"1h, got {spec!r}")
    s = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
    return None if s == 0 else ("seconds", s)


def parse_size(text: str) -> int:
    """Bytes in a size like ``512M``, ``4G``, ``1.5GiB`` or ``1000`` (powers of 1024)."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)([iI]?[bB])?\s*", str(text))
    if m is None or (not m.group(2) and (m.group(3) or "").lower() == "ib"):
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 4G)")
    n = float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " ")
    if n < 1:
        raise ValueError(f"size must be at least one byte: {text!r}")
    return int(n)


ATTACKS = ("scale", "sign-flip", "random", "nan")  # what a simulated Byzantine client does (runners.faults)


def parse_attacks(spec: str) -> tuple[str, ...]:
    """``"scale,sign-flip"`` -> ("scale", "sign-flip"); one-line error on an unknown attack."""
    names = tuple(a.strip() for a in spec.split(",") if a.strip())
    if not names:
        raise ValueError("attack: give at least one of " + ", ".join(ATTACKS))
    for a in names:
        if a not in ATTACKS:
            raise ValueError(f"unknown attack {a!r} (choose from {', '.join(ATTACKS)})")
    return names


def nearest(word: str, known) -> str:
    """`` (did you mean X?)`` for the known name closest to ``word``, or "" if none is close."""
    import difflib
    close = difflib.get_close_matches(word, [k for k in known if k != word], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def kind(annotation) -> str:
    """A field's type in words, for messages: number, integer, text."""
    from typing import get_args
    kinds = {a for a in (annotation, *get_args(annotation)) if a in (int, float, str)}
    return "an integer" if kinds == {int} else "a number" if kinds & {int, float} else "a value"


class ConfigError(ValueError):
    """A bad configuration, reported to the user as one line."""


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """A TOML file's content ({} for no file); a missing or malformed file is a ConfigError."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None


def merge_options(values: dict, given: dict) -> dict:
    """A TOML file's values with the ``[method]`` table as ``method_opts``, then the flags
    ``given`` on top; ``--method-opt`` adds to the file's options key by key, and so does a
    method's flag (``--nu 0.1`` over the file's ``[method]`` nu, ``nu = ...`` under ``--method-opt``)."""
    from .methods.options import parse_pairs
    values = dict(values)
    if isinstance(values.get("method"), dict):
        values["method_opts"] = {**values.pop("method"), **(values.get("method_opts") or {})}
    algorithm = given.get("algorithm", values.get("algorithm"))
    values, given = route_flags(values, algorithm), route_flags(given, algorithm)
    if given.get("method_opts") is not None and values.get("method_opts"):
        given = {**given, "method_opts": {**parse_pairs(values["method_opts"]), **parse_pairs(given["method_opts"])}}
    return {**values, **given}


def route_flags(values: dict, algorithm: Any = None) -> dict:
    """``values`` with the flags that are the fields of the run's method (``nu = 0.1`` for hiso:
    :func:`hiso.methods.registry.flag_options`) moved into its ``method_opts``; a flag the method
    does not have stays where it is (RunConfig names it as unused). ``algorithm``: the run's (None:
    ``values``' own, else hiso)."""
    from .methods.options import cast_option, fields_of, parse_pairs
    from .methods.registry import flag_options, method_info
    flags = flag_options()
    if not any(k in flags for k in values):
        return values
    algorithm = values.get("algorithm", "hiso") if algorithm is None else algorithm
    try:
        own = fields_of(method_info(algorithm).option_class) if isinstance(algorithm, str) else {}
    except (ValueError, ImportError):  # an unknown algorithm: RunConfig says so
        return values
    mine = {k: v for k, v in values.items() if k in flags and k in own and v is not None}
    if not mine:
        return values
    opts = parse_pairs(values.get("method_opts"))
    for k, v in mine.items():
        if k in opts and cast_option(k, own[k], opts[k]) != cast_option(k, own[k], v):
            raise ValueError(f"{k} = {v!r} and method option {k} = {opts[k]!r}: give it once")
    return {**{k: v for k, v in values.items() if k not in mine}, "method_opts": {**opts, **mine}}


def split_flags(values: dict) -> tuple[dict, dict]:
    """RunConfig's values with ``method_opts`` as a dict (``--method-opt c=0.5`` gives a list), the
    run's method's flags in it (:func:`route_flags`), and apart the flags of another method's
    (``nu`` on decomfl: no field holds them): (values, those flags)."""
    from .methods.options import parse_pairs
    from .methods.registry import flag_options
    if "method_opts" in values and not isinstance(values["method_opts"], dict):
        values = {**values, "method_opts": parse_pairs(values["method_opts"])}
    values, flags = route_flags(values), flag_options()
    return {k: v for k, v in values.items() if k not in flags}, {k: v for k, v in values.items() if k in flags}


def route_task_options(values: dict, names) -> dict:
    """``values`` with the task options among ``names`` given by their own names (``dim = 500``, a
    flag) moved into ``task_opts``, over the values it holds."""
    mine = {k: v for k, v in values.items() if k in names}
    if not mine:
        return values
    opts = values.get("task_opts")
    if opts is not None and not isinstance(opts, dict):
        raise ValueError(f"task_opts must be a table of task options, got {opts!r}")
    return {**{k: v for k, v in values.items() if k not in mine}, "task_opts": {**(opts or {}), **mine}}
