"""The layer rules of docs/architecture.md hold for every import in src/hiso (those inside
functions included): a module imports only from its own layer or below, and no module is bigger
than the size the project keeps to."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC / "hiso"
# each room (a package, or a top-level module) and its layer, as docs/architecture.md draws them
LAYERS = {
    "kernels": 0, "compat": 0, "atomic": 0, "patience": 0, "hardware": 0, "heap": 0, "__version__": 0,
    "core": 1,
    "methods": 2, "plugins": 2,
    "tasks": 3, "data": 3, "baselines": 3, "config": 3, "config_methods": 3, "config_parse": 3,
    "runners": 4, "flower": 4, "procs": 4,
    "report": 5, "experiments": 5,
    "cli": 6, "cli_commands": 6, "cli_flags": 6, "cli_flower": 6, "api": 6, "docgen": 6, "__init__": 6, "__main__": 6,
}
MAX_LINES = 460


def _module(path: Path) -> tuple[str, str]:
    """(dotted module name, the package its relative imports start from)."""
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path):
    """(imported hiso module, line) for every import statement of ``path``."""
    module, package = _module(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names] if node.module is None else [target]
            else:
                names = [node.module or ""]
            yield from ((n, node.lineno) for n in names if n == "hiso" or n.startswith("hiso."))
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.startswith("hiso"))


def violations() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module(path)[0]
        here = _room(module)
        for target, line in imports(path):
            there = _room(target)
            if there == here:
                continue
            if here not in LAYERS or there not in LAYERS:
                out.append(f"{path.relative_to(SRC)}:{line}: {here if here not in LAYERS else there} has no layer")
            elif LAYERS[there] > LAYERS[here]:
                out.append(f"{path.relative_to(SRC)}:{line}: {here} (layer {LAYERS[here]}) imports {target} "
                           f"(layer {LAYERS[there]})")
    return out


def test_every_import_goes_down_or_sideways():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    monkeypatch.setitem(LAYERS, "core", 9)  # as if core sat above everything: its imports are fine...
    monkeypatch.setitem(LAYERS, "kernels", 10)  # ...and every import of kernels goes up
    assert any("imports hiso.kernels" in v for v in violations())


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_bigger_than_the_project_keeps_to(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
