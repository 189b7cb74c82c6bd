"""Your own data from local files (tasks ``text`` and ``instruct``), read with Hugging Face ``datasets``.

A directory (``--data-dir``) holds one training file and one held-out file:

* ``train.EXT``, and the first of ``dev.EXT``, ``validation.EXT``, ``test.EXT`` that exists;
* EXT: ``csv``, ``tsv`` (tab-separated, header line first), ``jsonl`` / ``json`` (one object a
  line, or a JSON array of objects) or ``parquet``; the two files may differ in format.

``datasets.load_dataset("csv" | "json" | "parquet", data_files=...)`` reads them, offline (it needs
no hub for local files), into a throw-away cache. CSV and TSV cells are read as written (an empty
cell is empty, ``NA`` is the text ``NA``). A file that cannot be read, or a row that lacks what
the task needs, is one :class:`~hiso.data.DataError` naming the file, the row and the column;
rows are counted from 1, the header line not counted (row 1 of a CSV is its second line).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import DataError

EXTENSIONS = {"csv": ("csv", {"keep_default_na": False}), "tsv": ("csv", {"keep_default_na": False, "sep": "\t"}),
              "jsonl": ("json", {}), "json": ("json", {}), "parquet": ("parquet", {})}
SPLIT_NAMES = {"train": ("train",), "eval": ("dev", "validation", "test")}
CLIENT_COLUMN = "client"  # a column of this name in the training file: the federation's own split


@dataclass(frozen=True)
class TextExample:
    """One row of a ``text`` file: its text, its label's index in the label set, its client (or None)."""

    text_a: str
    label: int
    client: str | None = None
    text_b: None = None


@dataclass(frozen=True)
class InstructExample:
    """One row of an ``instruct`` file: the prompt and the one reference response."""

    question: str
    answers: tuple[str, ...]
    client: str | None = None


def _expected(which: str) -> str:
    return " or ".join(f"{n}.{{{','.join(EXTENSIONS)}}}" for n in SPLIT_NAMES[which])


def split_files(data_dir: str | Path | None, task: str) -> dict[str, Path]:
    """``{"train": path, "eval": path}`` of ``data_dir`` (see the module docstring)."""
    if data_dir is None:
        raise DataError(f"task {task} reads your files: give --data-dir DIR holding {_expected('train')} and "
                        f"{_expected('eval')} (docs/llm.md, \"Your own data\")")
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise DataError(f"{d}: data directory not found (task {task} wants {_expected('train')} and "
                        f"{_expected('eval')} in it)")
    out = {}
    for which, names in SPLIT_NAMES.items():
        for name in names:
            found = sorted(p for p in d.iterdir() if p.name.startswith(name + ".")
                           and p.name[len(name) + 1:].lower() in EXTENSIONS and p.is_file())
            if len(found) > 1:
                raise DataError(f"{d}: {', '.join(p.name for p in found)} are all {name} files; keep one")
            if found:
                out[which] = found[0]
                break
        else:
            raise DataError(f"{d}: no {'training' if which == 'train' else 'held-out'} file ({_expected(which)})")
    return out


@contextmanager
def _quiet():
    """datasets' own logging (a failed read is logged before it is raised) kept off the terminal."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def read_rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(column names, rows) of one file, read by ``datasets``; a file it cannot read is one DataError."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(f"{path}: reading your own files needs Hugging Face datasets: pip install -e '.[llm]' in "
                        "hiso's clone") from None
    builder, kw = EXTENSIONS[path.suffix[1:].lower()]
    with _quiet() as datasets, tempfile.TemporaryDirectory(prefix="hiso-data-") as cache:
        try:
            ds = datasets.load_dataset(builder, data_files={"rows": str(path)}, split="rows", cache_dir=cache,
                                       keep_in_memory=True, **kw)
        except Exception as e:  # noqa: BLE001  (pandas', pyarrow's and datasets' errors alike)
            why = e.__cause__ or e
            text = " ".join(str(why).split()) or type(why).__name__
            raise DataError(f"{path}: not a readable {path.suffix[1:]} file ({type(why).__name__}: {text})") from None
        return list(ds.column_names), ds.to_list()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cell(path: Path, i: int, row: dict, column: str, what: str) -> str:
    """Row ``i``'s non-empty text in ``column`` (numbers as written: 3 -> "3")."""
    value = row.get(column)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{path}, row {i + 1}, column {column!r}: empty {what}")
    if isinstance(value, (dict, list)):
        raise DataError(f"{path}, row {i + 1}, column {column!r}: {what} is {type(value).__name__}, not text")
    return str(value)


def need_columns(path: Path, columns: list[str], present: list[str], flags: dict[str, str]) -> None:
    for c in columns:
        if c not in present:
            raise DataError(f"{path}, row 1, column {c!r}: no such column (its columns: {', '.join(present) or 'none'}); "
                            f"name yours with {flags[c]}")


def label_order(values) -> list[str]:
    """The label set of a file's labels: numbers in numeric order, other labels alphabetically."""
    distinct = set(values)
    try:
        return sorted(distinct, key=lambda v: (float(v), v))
    except ValueError:
        return sorted(distinct)


def read_text(path: Path, text_col: str, label_col: str, labels: list[str] | None, where: str, train: bool
              ) -> tuple[list[str], list[TextExample]]:
    """(label set, examples) of a ``text`` file. ``labels`` None: the set is this file's labels
    (:func:`label_order`); else a label outside it is an error (``where`` says whose set it is).
    The training file's ``client`` column is kept (``train``), the held-out file's ignored."""
    present, rows = read_rows(path)
    need_columns(path, [text_col, label_col], present, {text_col: "--text-column", label_col: "--label-column"})
    has_client = train and CLIENT_COLUMN in present
    raw = [(_cell(path, i, r, text_col, "text"), _cell(path, i, r, label_col, "label").strip(),
            _cell(path, i, r, CLIENT_COLUMN, "client").strip() if has_client else None) for i, r in enumerate(rows)]
    if labels is None:
        labels = label_order(label for _, label, _ in raw)
    index = {label: k for k, label in enumerate(labels)}
    out = []
    for i, (text, label, client) in enumerate(raw):
        if label not in index:
            raise DataError(f"{path}, row {i + 1}, column {label_col!r}: {label!r} is not a label "
                            f"(labels {', '.join(map(repr, labels))}, {where})")
        out.append(TextExample(text, index[label], client))
    return labels, out


def read_instruct(path: Path, prompt_col: str, response_col: str, train: bool) -> list[InstructExample]:
    """The examples of an ``instruct`` file (the training file's ``client`` column kept)."""
    present, rows = read_rows(path)
    need_columns(path, [prompt_col, response_col], present,
                 {prompt_col: "--prompt-column", response_col: "--response-column"})
    has_client = train and CLIENT_COLUMN in present
    return [InstructExample(_cell(path, i, r, prompt_col, "prompt"), (_cell(path, i, r, response_col, "response"),),
                            _cell(path, i, r, CLIENT_COLUMN, "client").strip() if has_client else None)
            for i, r in enumerate(rows)]
