"""The units of a run's options: ``checkpoint_every`` (rounds or a time), sizes (``512M``) and the
simulated attackers' attacks (``scale,sign-flip``); a TOML file read, and the error a bad
configuration is (both re-exported by :mod:`hiso.config`)."""

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
