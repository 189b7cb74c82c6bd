"""How big hiso's code is, room by room, as docs/architecture.md reports it.

    python bench/code_size.py [--core]

Per room (a package of src/hiso, or a top-level module): its modules, their lines (``wc -l``)
and their code lines (neither blank, nor a comment, nor a docstring); ``--core`` adds the core's
modules one by one. One JSON object.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "hiso"


def code_lines(text: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    doc = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            doc |= set(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines |= set(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc)


def size(files: list[Path]) -> dict:
    texts = [f.read_text() for f in files]
    return {"modules": len(files), "lines": sum(len(t.splitlines()) for t in texts),
            "code_lines": sum(code_lines(t) for t in texts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", action="store_true", help="the core's modules one by one too")
    args = ap.parse_args(argv)
    rooms = {}
    for p in sorted(ROOT.iterdir()):
        if p.is_dir() and (p / "__init__.py").is_file():
            rooms[p.name + "/"] = size(sorted(p.rglob("*.py")))
        elif p.suffix == ".py":
            rooms[p.name] = size([p])
    out = {"total": size(sorted(ROOT.rglob("*.py"))), "rooms": rooms}
    if args.core:
        out["core"] = {f.stem: size([f]) for f in sorted((ROOT / "core").glob("*.py"))}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
