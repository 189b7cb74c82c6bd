"""No import circles in ``src/hiso``: every import statement of a module is an edge, wherever it
stands (at the top, inside a function, under ``if TYPE_CHECKING:``: a type-only import is a
dependency too); a cycle of edges fails the test, named. Where a lower module needs a higher
one's type, the type moves down, or the lower module describes what it needs (a Protocol).

Two edges Python adds by itself are counted too: importing ``a.b.c`` from outside ``a.b`` runs
``a/b/__init__.py`` first (an edge to the package), and a name a package hands out lazily
(its ``_EXPORTS`` table, read by ``__getattr__`` on first use) is an edge to the module named."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "hiso"


def _modules(root: Path = SRC) -> dict[str, Path]:
    mods = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(tree: ast.AST):
    """Every import node of a module, at any depth (type-only ones included)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _lazy_exports(path: Path, package: str) -> dict[str, str]:
    """A package's ``_EXPORTS = {name: module}`` table (module absolute, or relative to the package)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            table = ast.literal_eval(node.value)
            return {k: v if v.startswith("hiso") else f"{package}.{v}" for k, v in table.items()}
    return {}


def _packages_entered(target: str, importer: str) -> set[str]:
    """The packages whose ``__init__`` runs when ``importer`` imports ``target``: its ancestors
    that do not hold the importer (those are already running)."""
    parts = target.split(".")
    out = set()
    for i in range(2, len(parts)):
        pkg = ".".join(parts[:i])
        if not (importer == pkg or importer.startswith(pkg + ".")):
            out.add(pkg)
    return out


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    mods = _modules(root)
    lazy = {name: _lazy_exports(path, name) for name, path in mods.items() if path.name == "__init__.py"}
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
                targets += [lazy[base][a.name] for a in node.names if a.name in lazy.get(base, {})]
            targets += [p for t in targets for p in _packages_entered(t, name)]
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "hiso.tasks.registry" in graph["hiso.config"]  # imported inside RunConfig's validator
    assert "hiso.core.scalars" in graph["hiso.core.history"]  # imported inside functions
    assert "hiso.core" in graph["hiso.methods.momentum"]  # hiso.core.exact: hiso/core/__init__.py runs first
    assert "hiso.core" not in graph["hiso.core.state"]  # its own package is already running
    assert "hiso.core.state" in graph["hiso.core"]  # which runs the package's own imports


def test_a_type_only_circle_is_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import High\n")
    (pkg / "high.py").write_text("def f():\n    from .low import g\n")
    assert cycles(import_graph(pkg)) == [["pkg.high", "pkg.low"]]
    (pkg / "low.py").write_text("")
    assert cycles(import_graph(pkg)) == []


def test_a_name_from_a_package_is_an_edge_to_the_package(tmp_path):
    for d in ("pkg", "pkg/core", "pkg/other"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "pkg/core/__init__.py").write_text("from .state import State\n")
    (tmp_path / "pkg/core/state.py").write_text("State = object\n")
    (tmp_path / "pkg/other/user.py").write_text("def f():\n    from ..core import State\n")
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.other.user"] == {"pkg.core"}  # the name is the package's: its __init__ runs
    assert graph["pkg.core"] == {"pkg.core.state"}


def test_no_import_circles_in_hiso():
    found = cycles(import_graph())
    assert not found, "import circles (move what both sides need to the lower module): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_core_imports_no_method_and_loads_nothing_lazily():
    """Methods plug into the core through hiso.core.method; the core never imports one (so it
    needs no lazy loader to break a circle with them)."""
    graph = import_graph()
    into_methods = {m: sorted(d for d in deps if d.startswith("hiso.methods"))
                    for m, deps in graph.items() if m == "hiso.core" or m.startswith("hiso.core.")}
    assert not {m: d for m, d in into_methods.items() if d}, into_methods
    assert {"hiso.core.state", "hiso.core.server"} <= graph["hiso.core"]  # the test sees the core's edges
    init = (SRC / "core" / "__init__.py").read_text()  # (hiso/__init__.py's keeps `import hiso` cheap)
    assert "_EXPORTS" not in init and "def __getattr__" not in init
