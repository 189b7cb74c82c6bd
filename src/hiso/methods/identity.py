"""A user's method's identity: the file that defines it, recorded in config.json by its sha256.

A run's model is its base model, its log and the code that folds the log: a method file edited
after a run gives another model from the same log. So config.json's ``method_source`` records
the file (``{"file": ..., "sha256": ...}``), and reading a run back (rebuild, resume, eval,
export) refuses, in one line naming the file, when the file now holds other bytes; the
``--accept-method-change`` flag (:data:`ACCEPT`) reads it anyway, and a resumed run records the
change (``method_source["accepted"]``: each earlier digest and the round it was accepted at).
Only the file that defines the class is hashed, not what it imports.

The record also keeps a digest of each hook's source (``parts``: :data:`HOOKS`) and of the rest of
the file, so a refusal can say which part changed and whether the model can differ: the log
gives the same model after an edit of the client's or the server's side (a run made now would
compute other rounds), another one after an edit of the fold; an edit outside the hooks (a
helper, an import) or a run recorded without parts cannot be told apart, and may change either.
"""

from __future__ import annotations

import ast
import contextvars
import hashlib
import inspect
from pathlib import Path

ACCEPT = contextvars.ContextVar("accept_method_change", default=False)


class MethodChanged(ValueError):
    """A run's method file holds other bytes than when the run was made."""


# the hooks of hiso.core.method.Method by the part of a round that calls them
HOOKS = {"client": ("batches", "local_update", "step_scalars"), "server": ("combine",), "fold": ("apply_", "stages"),
         "wire": ("uplink",)}
_SAME_MODEL = ("the model its log gives is the same, but a run made now would compute other rounds")
_OTHER_MODEL = "the model its log gives can differ"


def _classes(tree) -> dict:
    """The class definitions of a module's syntax tree by qualified name."""
    out: dict = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                out[prefix + child.name] = child
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return out


def _defines(node, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _parts(cls: type, text: str) -> dict:
    """SHA-256 of each hook's source as ``cls`` resolves it, read from the file's ``text`` (a
    hook inherited from elsewhere: its owner's name), and of the text without them (``rest``)."""
    lines = text.splitlines(keepends=True)
    try:
        classes = _classes(ast.parse(text))
    except SyntaxError:
        classes = {}
    out, taken = {}, set()
    for name in (n for hooks in HOOKS.values() for n in hooks):
        src = ""
        for klass in cls.__mro__:
            if name not in vars(klass):
                continue
            node = None
            if klass.__module__ == cls.__module__ and klass.__qualname__ in classes:
                node = next((n for n in reversed(classes[klass.__qualname__].body) if _defines(n, name)), None)
            if node is None:
                src = f"{klass.__module__}.{klass.__qualname__}.{name}"
            else:
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
                span = range(first, node.end_lineno)
                src = "".join(lines[i] for i in span)
                taken.update(span)
            break
        out[name] = hashlib.sha256(src.encode()).hexdigest()
    rest = "".join(line for i, line in enumerate(lines) if i not in taken)
    out["rest"] = hashlib.sha256(rest.encode()).hexdigest()
    return out


def source_of(algorithm: str) -> dict | None:
    """``{"file", "sha256", "parts"}`` of the file defining a user's method (None for a built-in one)."""
    from .registry import is_user_method, user_method_class
    if not is_user_method(algorithm):
        return None
    where = algorithm.rpartition(":")[0]
    try:
        cls = user_method_class(algorithm)
        # the file named (a module loaded from a file of the same bytes elsewhere may be reused)
        path = Path(where).expanduser().resolve() if where.endswith(".py") else Path(inspect.getsourcefile(cls) or "")
    except (TypeError, OSError):
        return None
    if not path.is_file():
        return None
    data = path.read_bytes()
    return {"file": str(path.resolve()), "sha256": hashlib.sha256(data).hexdigest(),
            "parts": _parts(cls, data.decode("utf-8", errors="replace"))}


def what_changed(recorded: dict, now: dict) -> str:
    """Which part of a method file changed between ``recorded`` and ``now`` (``source_of``'s) and
    whether the model a run's log gives can differ, in words."""
    old, new = recorded.get("parts"), now.get("parts")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return f"which part cannot be told (the run recorded the file's digest only): {_OTHER_MODEL}"
    if old.get("rest") != new.get("rest"):
        return f"changed outside its hooks (a helper, an import, a field), so any part may have: {_OTHER_MODEL}"
    changed = [f"{part} ({', '.join(n for n in hooks if old.get(n) != new.get(n))})"
               for part, hooks in HOOKS.items() if any(old.get(n) != new.get(n) for n in hooks)]
    if not changed:
        return f"which part cannot be told: {_OTHER_MODEL}"
    fold = any(old.get(n) != new.get(n) for n in HOOKS["fold"])
    return f"changed: {' and '.join(changed)}: {_OTHER_MODEL if fold else _SAME_MODEL}"


def check_source(recorded: dict | None, algorithm: str, run_dir) -> dict | None:
    """The method's source now; :class:`MethodChanged` if it differs from ``recorded`` (unless
    :data:`ACCEPT`). A run made before digests were recorded is not checked."""
    if not isinstance(recorded, dict) or "sha256" not in recorded:
        return None
    now = source_of(algorithm)
    if now is None or now["sha256"] == recorded["sha256"] or ACCEPT.get():
        return now
    raise MethodChanged(f"{now['file']} changed since {run_dir} was made (sha256 {recorded['sha256'][:12]} then, "
                        f"{now['sha256'][:12]} now; {what_changed(recorded, now)}); restore the file, or pass "
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
