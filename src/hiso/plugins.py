"""Loading a user's plugin (a task or a method) named ``module:Class`` or ``path/to/file.py:Class``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def import_object(spec: str, kind: str = "task") -> Any:
    """The object ``module:Class`` or ``path/to/file.py:Class`` names (one-line ValueError if none)."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ValueError(f"{kind} {spec!r}: expected module:Class or path/to/file.py:Class")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{kind} {spec!r}: file {path} not found")
        # one module per file content: a changed file is imported again, an unchanged one is reused
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        modname = f"hiso_user_{kind}_{path.stem}_{digest}"
        module = sys.modules.get(modname)
        if module is None:
            ispec = importlib.util.spec_from_file_location(modname, path)
            module = importlib.util.module_from_spec(ispec)
            sys.modules[modname] = module  # dataclasses and pickling look modules up here
            try:
                ispec.loader.exec_module(module)
            except BaseException:
                del sys.modules[modname]
                raise
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name != where.split(".")[0] or os.getcwd() in sys.path:
                raise ValueError(f"{kind} {spec!r}: cannot import {where} ({e})") from None
            sys.path.append(os.getcwd())  # `hiso` run from the module's directory
            try:
                module = importlib.import_module(where)
            except ModuleNotFoundError as e2:
                raise ValueError(f"{kind} {spec!r}: cannot import {where} ({e2}; put its directory on "
                                 "PYTHONPATH or give path/to/file.py:Class)") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{kind} {spec!r}: {where} has no {attr!r}") from None
