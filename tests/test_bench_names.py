"""The benchmarks in bench/ use hiso's public names only: no ``from hiso.x import _private``, no
``module._private`` of a hiso module (what a benchmark needs is worth a public name)."""

import ast
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
_IMPORT = re.compile(r"^\s*from (hiso[\w.]*) import ([^\n]+)$", re.M)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(text: str, python: bool) -> list[str]:
    """Each private hiso name ``text`` reaches: imported, or read off a hiso module it imported."""
    out, modules = [], set()
    if python:
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hiso"):
                out += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
                modules |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                out += [a.name for a in node.names if a.name.startswith("hiso") and any(map(_private, a.name.split(".")))]
                modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("hiso")}
        out += [f"{ast.unparse(n.value)}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and _private(n.attr) and ast.unparse(n.value).split(".")[0] in modules]
        return out
    for module, names in _IMPORT.findall(text):  # a shell script's python
        names = [n.strip().split(" as ")[-1] for n in names.strip("()").split(",")]
        out += [f"{module}.{n}" for n in names if _private(n)]
        modules |= set(names)
    out += [m.group(0) for m in re.finditer(r"\b(\w+)\.(_\w+)", text) if m.group(1) in modules | {"hiso"}
            and _private(m.group(2))]
    return out


@pytest.mark.parametrize("path", sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")),
                         ids=lambda p: str(p.relative_to(BENCH)))
def test_a_benchmark_uses_public_names(path):
    assert private_uses(path.read_text(), path.suffix == ".py") == []


def test_the_check_sees_a_private_name():
    assert private_uses("from hiso.runners.protocol import _Blob\n", True) == ["hiso.runners.protocol._Blob"]
    assert private_uses("from hiso.tasks import lm_pack\nlm_pack._write(1)\n", True) == ["lm_pack._write"]
    assert private_uses("def f():\n    self._x = 1\n", True) == []
    assert private_uses("from hiso.tasks import lm, lm_pack\nlm_pack._write(src)\n", False) == ["lm_pack._write"]
