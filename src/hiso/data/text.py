"""Text datasets for the language-model tasks: GLUE SST-2 / QQP and SQuAD v1.1.

Two sources, giving identical examples:

* files in the original formats in a directory (``data_dir``): GLUE's ``train.tsv`` /
  ``dev.tsv`` and SQuAD's ``train-v1.1.json`` / ``dev-v1.1.json`` (or subsets of them named
  ``train-v1.1-*.json`` etc.) -- for machines without the internet;
* ``data_dir=None``: Hugging Face ``datasets`` (``glue/sst2``, ``glue/qqp``, ``squad``), imported
  only then so the package does not depend on it (``pip install -e '.[hf]' in hiso's clone``).

The eval split is GLUE's / SQuAD's dev set (``validation`` on the Hub), the split papers
report as "test" because GLUE's test labels are hidden. Text is returned exactly as stored
(SST-2 sentences keep their tokenised spacing and trailing space, as on the Hub); the language
tasks strip each field before the template (``strip_text``, docs/llm.md), as the authors' code does.
"""

from __future__ import annotations

import csv
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hiso.data import DataError

TASKS = ("sst2", "qqp", "squad")
GLUE_TASKS = ("sst2", "qqp")
SPLITS = ("train", "eval")

# Header columns (text_a, text_b or None, label) of the GLUE TSVs.
GLUE_COLUMNS: dict[str, tuple[str, str | None, str]] = {
    "sst2": ("sentence", None, "label"),
    "qqp": ("question1", "question2", "is_duplicate"),
}
GLUE_FILES = {"train": "train.tsv", "eval": "dev.tsv"}
SQUAD_PREFIX = {"train": "train-v1.1", "eval": "dev-v1.1"}

# Hugging Face `datasets` names and the split each of ours maps to.
HF_NAMES: dict[str, tuple[str, ...]] = {
    "sst2": ("glue", "sst2"),
    "qqp": ("glue", "qqp"),
    "squad": ("squad",),
}
HF_SPLITS = {"train": "train", "eval": "validation"}


@dataclass(frozen=True)
class ClassificationExample:
    """One SST-2 sentence (``text_b`` None) or QQP question pair; ``label`` is 0 or 1."""

    text_a: str
    text_b: str | None
    label: int


@dataclass(frozen=True)
class QAExample:
    """One SQuAD question; ``answers`` are the distinct reference texts in file order."""

    id: str
    question: str
    context: str
    answers: tuple[str, ...]


def how_to_get(task: str) -> str:
    """The sentence appended to every DataError: where the files for ``task`` come from."""
    if task == "squad":
        files = "train-v1.1.json and dev-v1.1.json"
        source = "the SQuAD site (https://rajpurkar.github.io/SQuAD-explorer/, SQuAD v1.1)"
    else:
        files = "train.tsv and dev.tsv"
        source = f"GLUE (https://gluebenchmark.com/tasks; the {task.upper()} archive)"
    return (
        f"Download {files} from {source} into --data-dir, or install the optional Hugging Face "
        "extra (`pip install -e '.[hf]' in hiso's clone`) and omit --data-dir to load it from the Hub."
    )


def _check_task(task: str, allowed: tuple[str, ...] = TASKS) -> None:
    if task not in allowed:
        raise ValueError(f"unknown text task {task!r}; choose one of {', '.join(allowed)}")


def _label(value: Any, where: str, task: str) -> int:
    """0/1 from ``"0"``/``"1"`` or an int; anything else (GLUE test's missing or -1) is an error."""
    text = str(value).strip()
    if text not in ("0", "1"):
        raise DataError(
            f"{where}: label {value!r}, expected 0 or 1 (labels are required; GLUE test files "
            f"have none, use dev.tsv). {how_to_get(task)}"
        )
    return int(text)


def _is_wrapped(field: str) -> bool:
    """``field`` is one csv-quoted value: ``"..."`` with every inner quote doubled."""
    inner = field[1:-1]
    return len(field) >= 2 and field[0] == field[-1] == '"' and '"' not in inner.replace('""', "")


def _csv_quoted(fields: Any) -> bool:
    """Whether a TSV was written with csv quoting: some field holds a ``"`` and all such are
    wrapped. GLUE's unquoted files fail this at their first ``say "hi"``-style field."""
    seen = False
    for field in fields:
        if '"' in field:
            if not _is_wrapped(field):
                return False
            seen = True
    return seen


def _unquote(field: str) -> str:
    """The value of a csv-quoted field (fields without quotes are returned as they are)."""
    return field[1:-1].replace('""', '"') if _is_wrapped(field) else field


def _glue_header(task: str) -> tuple[str, ...]:
    """The full header of GLUE's file, for error messages."""
    if task == "sst2":
        return ("sentence", "label")
    return ("id", "qid1", "qid2", "question1", "question2", "is_duplicate")


def load_glue_tsv(path: str | Path, task: str) -> list[ClassificationExample]:
    """Parse a labelled GLUE TSV of ``task`` ``"sst2"`` or ``"qqp"``; columns found by header name.

    Rows are split with ``QUOTE_NONE`` because GLUE's own files are not csv-quoted: a field may
    begin with ``"`` and the default dialect would then swallow tabs and newlines up to the
    next quote. Files re-saved with pandas / ``QUOTE_MINIMAL`` (the few-shot QQP splits) wrap
    every field holding a ``"`` in quotes, inner quotes doubled; when *every* such field of a
    file is wrapped that way the file is taken as csv-quoted and those fields are unquoted, so
    both kinds of file give the text the Hub gives (see :func:`_csv_quoted`).
    """
    _check_task(task, GLUE_TASKS)
    path = Path(path)
    col_a, col_b, col_label = GLUE_COLUMNS[task]
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, None)
            if header is None:
                raise DataError(
                    f"{path}: empty file, expected a {task} TSV header. {how_to_get(task)}"
                )
            wanted = [c for c in (col_a, col_b, col_label) if c is not None]
            missing = [c for c in wanted if c not in header]
            if missing:
                hint = (
                    " (no label column: a GLUE test file? labels are required, use dev.tsv)"
                    if missing == [col_label]
                    else ""
                )
                raise DataError(
                    f"{path}: header {header} lacks column(s) {missing}{hint}; a {task} TSV has "
                    f"the tab-separated header {' '.join(_glue_header(task))}. {how_to_get(task)}"
                )
            i_a, i_label = header.index(col_a), header.index(col_label)
            i_b = header.index(col_b) if col_b is not None else None
            rows: list[tuple[int, list[str]]] = []
            for row in reader:
                if not row:  # blank line, e.g. a trailing newline pair
                    continue
                if len(row) != len(header):
                    raise DataError(
                        f"{path}, line {reader.line_num}: {len(row)} tab-separated fields, the "
                        f"header has {len(header)}; the file is malformed or truncated. "
                        + how_to_get(task)
                    )
                rows.append((reader.line_num, row))
    except FileNotFoundError:
        raise DataError(f"{path}: file not found. {how_to_get(task)}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: cannot read as a UTF-8 TSV ({e}). {how_to_get(task)}") from e

    text_cols = [i_a] if i_b is None else [i_a, i_b]
    quoted = _csv_quoted(row[i] for _, row in rows for i in text_cols)
    text = _unquote if quoted else (lambda field: field)
    examples = [
        ClassificationExample(
            text_a=text(row[i_a]),
            text_b=text(row[i_b]) if i_b is not None else None,
            label=_label(row[i_label], f"{path}, line {line}", task),
        )
        for line, row in rows
    ]
    if not examples:
        raise DataError(f"{path}: header but no examples. {how_to_get(task)}")
    return examples


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, path: Path) -> Any:
    """``obj[key]`` checked to be a ``kind``; otherwise a DataError saying what was expected."""
    if not isinstance(obj, dict):
        raise DataError(
            f"{path}: {where} is a {type(obj).__name__}, expected an object with key {key!r} "
            f"(SQuAD v1.1 layout). {how_to_get('squad')}"
        )
    if key not in obj:
        raise DataError(
            f"{path}: {where} has no key {key!r} (SQuAD v1.1 layout: data[].paragraphs[]."
            f"{{context, qas[].{{id, question, answers[].text}}}}). {how_to_get('squad')}"
        )
    value = obj[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataError(
            f"{path}: {where}[{key!r}] is a {type(value).__name__}, expected a {names}. "
            + how_to_get("squad")
        )
    return value


def load_squad_json(path: str | Path) -> list[QAExample]:
    """Questions of a SQuAD v1.1 JSON file, in file order, answers deduplicated in order.

    A question without answers (SQuAD 2.0's unanswerable ones) is an error: the metrics and
    the tasks built on this assume every question has a reference answer.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found. {how_to_get('squad')}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path}: not valid JSON ({e}); truncated or not a SQuAD file. {how_to_get('squad')}"
        ) from e

    examples: list[QAExample] = []
    articles = _get(doc, "data", list, "the top level", path)
    for i, article in enumerate(articles):
        paragraphs = _get(article, "paragraphs", list, f"data[{i}]", path)
        for j, paragraph in enumerate(paragraphs):
            where_p = f"data[{i}].paragraphs[{j}]"
            context = _get(paragraph, "context", str, where_p, path)
            for k, qa in enumerate(_get(paragraph, "qas", list, where_p, path)):
                where_q = f"{where_p}.qas[{k}]"
                answers = _get(qa, "answers", list, where_q, path)
                texts = [
                    _get(a, "text", str, f"{where_q}.answers[{m}]", path)
                    for m, a in enumerate(answers)
                ]
                if not texts:
                    raise DataError(
                        f"{path}: {where_q} has no answers; SQuAD v1.1 expected (unanswerable "
                        f"SQuAD 2.0 questions are not supported). {how_to_get('squad')}"
                    )
                examples.append(
                    QAExample(
                        id=str(_get(qa, "id", (str, int), where_q, path)),
                        question=_get(qa, "question", str, where_q, path),
                        context=context,
                        answers=tuple(dict.fromkeys(texts)),
                    )
                )
    if not examples:
        raise DataError(f"{path}: no questions in data[]. {how_to_get('squad')}")
    return examples


def find_text_file(task: str, data_dir: str | Path, split: str) -> Path:
    """The file of ``split`` in ``data_dir``: GLUE ``train.tsv`` / ``dev.tsv``; SQuAD
    ``{train,dev}-v1.1.json``, else the single ``{train,dev}-v1.1*.json`` (a subset)."""
    _check_task(task)
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"{d}: directory not found (--data-dir for {task}). {how_to_get(task)}")
    if task in GLUE_TASKS:
        p = d / GLUE_FILES[split]
        if p.is_file():
            return p
        raise DataError(f"{p}: file not found (looked for {GLUE_FILES[split]}). {how_to_get(task)}")
    prefix = SQUAD_PREFIX[split]
    exact = d / f"{prefix}.json"
    if exact.is_file():
        return exact
    found = sorted(p for p in d.glob(f"{prefix}*.json") if p.is_file())
    if len(found) == 1:
        return found[0]
    if found:
        raise DataError(
            f"{d}: several {split} files match {prefix}*.json "
            f"({', '.join(p.name for p in found)}); keep one, or name it {prefix}.json."
        )
    raise DataError(
        f"{d}: no SQuAD {split} file (looked for {prefix}.json, then {prefix}*.json). "
        + how_to_get(task)
    )


def load_text_task(
    task: str, data_dir: str | Path | None, split: str
) -> list[ClassificationExample] | list[QAExample]:
    """Examples of ``task`` (``"sst2"``, ``"qqp"``, ``"squad"``) and ``split`` (``"train"`` or
    ``"eval"``) from files in ``data_dir``, or from Hugging Face ``datasets`` if it is None."""
    _check_task(task)
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if data_dir is None:
        return load_hf(task, split)
    path = find_text_file(task, data_dir, split)
    return load_squad_json(path) if task == "squad" else load_glue_tsv(path, task)


def load_hf(task: str, split: str) -> list[ClassificationExample] | list[QAExample]:
    """The same examples from the Hugging Face Hub (needs ``datasets`` and the internet)."""
    _check_task(task)
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise DataError(
            f"{task}: no --data-dir given and Hugging Face `datasets` is not installed; pass "
            f"--data-dir with the original files, or `pip install -e '.[hf]' in hiso's clone`. {how_to_get(task)}"
        ) from None
    name, hf_split = HF_NAMES[task], HF_SPLITS[split]
    source = f"Hugging Face datasets {'/'.join(name)} [{hf_split}]"
    try:
        rows = datasets.load_dataset(*name, split=hf_split)
    except Exception as e:  # network, hub or cache errors: all mean "pass --data-dir instead"
        raise DataError(
            f"{source}: cannot load ({type(e).__name__}: {e}). Pass --data-dir with the "
            f"original files instead. {how_to_get(task)}"
        ) from e
    try:
        if task == "squad":
            return [
                QAExample(
                    id=str(r["id"]),
                    question=r["question"],
                    context=r["context"],
                    answers=tuple(dict.fromkeys(r["answers"]["text"])),
                )
                for r in rows
            ]
        col_a, col_b, _ = GLUE_COLUMNS[task]
        return [
            ClassificationExample(
                text_a=r[col_a],
                text_b=r[col_b] if col_b is not None else None,
                label=_label(r["label"], f"{source}, row {n}", task),
            )
            for n, r in enumerate(rows)
        ]
    except (KeyError, TypeError) as e:
        raise DataError(f"{source}: unexpected row layout (missing {e}). {how_to_get(task)}") from e


__all__ = [
    "GLUE_TASKS",
    "SPLITS",
    "TASKS",
    "ClassificationExample",
    "QAExample",
    "find_text_file",
    "how_to_get",
    "load_glue_tsv",
    "load_hf",
    "load_squad_json",
    "load_text_task",
]
