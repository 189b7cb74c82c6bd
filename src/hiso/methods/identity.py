"""A user's method's identity: the file that defines it, recorded in config.json by its sha256.

A run's model is its base model, its log and the code that folds the log: a method file edited
after a run gives another model from the same log. So config.json's ``method_source`` records
the file (``{"file": ..., "sha256": ...}``), and reading a run back (rebuild, resume, eval,
export) refuses, in one line naming the file, when the file now holds other bytes; the
``--accept-method-change`` flag (:data:`ACCEPT`) reads it anyway, and a resumed run records the
change (``method_source["accepted"]``: each earlier digest and the round it was accepted at).
Only the file that defines the class is hashed, not what it imports.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
from pathlib import Path

ACCEPT = contextvars.ContextVar("accept_method_change", default=False)


class MethodChanged(ValueError):
    """A run's method file holds other bytes than when the run was made."""


def source_of(algorithm: str) -> dict | None:
    """``{"file", "sha256"}`` of the file defining a user's method (None for a built-in one)."""
    from .registry import is_user_method, user_method_class
    if not is_user_method(algorithm):
        return None
    try:
        path = Path(inspect.getsourcefile(user_method_class(algorithm)) or "")
    except (TypeError, OSError):
        return None
    if not path.is_file():
        return None
    return {"file": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def check_source(recorded: dict | None, algorithm: str, run_dir) -> dict | None:
    """The method's source now; :class:`MethodChanged` if it differs from ``recorded`` (unless
    :data:`ACCEPT`). A run made before digests were recorded is not checked."""
    if not isinstance(recorded, dict) or "sha256" not in recorded:
        return None
    now = source_of(algorithm)
    if now is None or now["sha256"] == recorded["sha256"] or ACCEPT.get():
        return now
    raise MethodChanged(f"{now['file']} changed since {run_dir} was made (sha256 {recorded['sha256'][:12]} then, "
                        f"{now['sha256'][:12]} now): its log would give another model; restore the file, or pass "
                        "--accept-method-change to use it anyway")


def record(cfg, old: dict | None, round: int | None = None) -> dict:
    """config.json's ``method_source`` for ``cfg`` ({} for a built-in method); a changed file
    accepted on resume keeps each earlier digest with the round it was accepted at."""
    now = source_of(cfg.algorithm)
    if now is None:
        return {}
    accepted = list((old or {}).get("accepted", []))
    if old and old.get("sha256") not in (None, now["sha256"]):
        accepted.append({"sha256": old["sha256"], "until_round": round})
    return {"method_source": {**now, **({"accepted": accepted} if accepted else {})}}
