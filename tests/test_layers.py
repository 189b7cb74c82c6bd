"""The layer rules of docs/architecture.md hold for every import in src/hiso (those inside
functions and under ``if TYPE_CHECKING:`` included): the layers are read from the doc itself, every
room of the code has exactly one, a module imports only from its own layer or below, the lowest
layer imports nothing of hiso, every module is named in the doc, and no module is bigger than the
size the project keeps to."""

import ast
import re
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC / "hiso"
DOC = SRC.parent / "docs" / "architecture.md"
MAX_LINES = 460


def rooms() -> set[str]:
    """Each package of hiso and each of its top-level modules (``__init__``: hiso's own)."""
    return ({p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
            | {p.stem for p in ROOT.glob("*.py")})


def doc_layers(text: str) -> list[list[str]]:
    """The layers, lowest first, as the doc's "Layers" section draws them: backticked rooms
    (``core/``, ``api.py``, ``config*.py``) in groups joined by ``<-``, up to the sentence
    that states the rule."""
    section = text.split("## Layers", 1)[1]
    chain = section.split(": a module imports only", 1)[0]
    code = rooms()
    layers = []
    for group in chain.split("<-"):
        names = []
        for token in re.findall(r"`([^`]+)`", group):
            stem = token.rstrip("/").removesuffix(".py")
            names += sorted(r for r in code if re.fullmatch(stem.replace("*", ".*"), r)) if "*" in stem else [stem]
        layers.append(names)
    return layers


def _layers() -> tuple[dict[str, int], set[str]]:
    """(room -> its layer from the doc, the rooms of the lowest layer when the doc says they import nothing of hiso)."""
    text = DOC.read_text()
    layers = doc_layers(text)
    lowest = " ".join(text.split("## Layers", 1)[1].split("<-", 1)[0].split())
    return ({name: i for i, names in enumerate(layers) for name in names},
            set(layers[0]) if "(no hiso imports)" in lowest else set())


LAYERS, NO_IMPORTS = _layers()


def _module(path: Path) -> tuple[str, str]:
    """(dotted module name, the package its relative imports start from)."""
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path):
    """(imported hiso module, line) for every import statement of ``path``: ``from X import n``
    is X's module ``n`` where there is one, else X."""
    module, package = _module(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names]
            yield from ((n, node.lineno) for n in names if n == "hiso" or n.startswith("hiso."))
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name == "hiso" or a.name.startswith("hiso."))


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
            elif here in NO_IMPORTS:
                out.append(f"{path.relative_to(SRC)}:{line}: {here} imports {target}, and the lowest layer imports "
                           "nothing of hiso")
            elif LAYERS[there] > LAYERS[here]:
                out.append(f"{path.relative_to(SRC)}:{line}: {here} (layer {LAYERS[here]}) imports {target} "
                           f"(layer {LAYERS[there]})")
    return out


def test_every_room_has_one_layer_in_the_doc():
    named = [name for names in doc_layers(DOC.read_text()) for name in names]
    assert len(named) == len(set(named)), f"named in two layers: {sorted({n for n in named if named.count(n) > 1})}"
    assert set(named) == rooms(), (f"rooms with no layer in docs/architecture.md: {sorted(rooms() - set(named))}; "
                                   f"layers naming no room: {sorted(set(named) - rooms())}")
    assert LAYERS["kernels"] == 0 < LAYERS["core"] < LAYERS["methods"] < LAYERS["cli"]  # the doc was read
    assert {"kernels", "compat", "_version"} <= NO_IMPORTS


def test_every_import_goes_down_or_sideways():
    assert violations() == []


def test_the_check_sees_an_upward_import(monkeypatch):
    monkeypatch.setitem(LAYERS, "core", 9)  # as if core sat above everything: its imports are fine...
    monkeypatch.setitem(LAYERS, "kernels", 10)  # ...and every import of kernels goes up
    monkeypatch.setattr(sys.modules[__name__], "NO_IMPORTS", set())
    assert any("imports hiso.kernels" in v for v in violations())


def test_the_check_sees_an_import_from_the_lowest_layer(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "NO_IMPORTS", NO_IMPORTS | {"core"})  # as if the core were at the bottom
    assert any(v.startswith("hiso/core/") and "lowest layer" in v for v in violations())


def test_every_module_is_named_in_the_doc():
    text = DOC.read_text()
    unnamed = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
               if (p.name != "__init__.py" or p.parent == ROOT) and f"`{p.name}`" not in text and f"/{p.name}`" not in text]
    assert not unnamed, f"modules docs/architecture.md does not name (its room table says what each holds): {unnamed}"


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_bigger_than_the_project_keeps_to(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
