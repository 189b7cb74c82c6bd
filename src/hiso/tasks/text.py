"""Your own data on a causal LM: ``text`` (classification) and ``instruct`` (prompt -> response).

Both are :class:`~hiso.tasks.language.LanguageTask` with other files: the prompts, the scoring,
LoRA, packing, evaluation and rebuilds are the SST-2 and SQuAD tasks' own. Only where the
examples come from differs (:mod:`hiso.data.files`: ``train.*`` and ``dev.*`` / ``validation.*``
/ ``test.*`` in ``--data-dir``, CSV, TSV, JSON lines or Parquet, read by Hugging Face ``datasets``).

``text``: a text column (``--text-column``, default ``text``) fills ``{text}`` of the template
(default ``"{text}\\nAnswer:"``) and a label column (``--label-column``, default ``label``) names
the class. The label set is the training file's labels (numbers in numeric order, others
alphabetically), each scored by its label word: by default the label itself with a leading space
(labels ``negative`` / ``positive`` -> words ``" negative"`` / ``" positive"``); ``--label-words
" bad, good"`` gives the words in the label set's order, ``--label-words "neg= bad,pos= good"``
the label set itself, in that order, with a word for each. Metrics: ``eval_acc``, ``eval_loss``.

``instruct``: a prompt column (``--prompt-column``, default ``prompt``) fills ``{prompt}`` of the
template (default ``"{prompt}\\nAnswer:"``); the response column (``--response-column``, default
``response``) is the target. The loss is on the response tokens only (and the end-of-sequence
token), as SQuAD's; evaluation decodes greedily and scores the first line of the answer with
SQuAD's normalised exact match and token F1: ``eval_em``, ``eval_f1``, ``eval_loss``.

Clients: a Dirichlet label skew (``text``; ``--alpha``) or an iid split (``instruct``), as the
other tasks; a ``client`` column in the training file is the federation's own split instead
(its distinct values, in :func:`~hiso.data.files.label_order`, are clients 0, 1, ...; there must
be ``--clients`` of them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data import DataError
from ..data.files import CLIENT_COLUMN, label_order, read_instruct, read_text, split_files
from .language import _LM_LR, _LM_OPTIONS, LanguageTask, _builder
from .registry import register_task


class FileTask(LanguageTask):
    """Task ``text`` or ``instruct`` on the files of ``data_dir`` (see the module docstring)."""

    def __init__(self, name: str, num_clients: int, seed: int = 0, *, columns: tuple[str, str],
                 label_words: list[str] | None = None, partition: str | None = None, **kw):
        if name not in ("text", "instruct"):
            raise ValueError(f"unknown file task {name!r} (text or instruct)")
        self.columns = tuple(columns)
        self._partition_given = partition is not None
        super().__init__(name, num_clients, seed, partition=partition, **kw)
        self.labels: list[str] | None = None  # the label set, from --label-words KEY=WORD or the training file
        self._words: tuple[str, ...] | None = None
        if label_words and self.qa:
            raise ValueError("label_words are for classification; task instruct scores its responses")
        if label_words:
            pairs = [w.split("=", 1) for w in label_words]
            if all(len(p) == 2 for p in pairs):
                self.labels = [k.strip() for k, _ in pairs]
                if len(set(self.labels)) != len(self.labels) or "" in self.labels:
                    raise ValueError(f"label_words {','.join(label_words)!r}: each label once, none empty")
                words = [w for _, w in pairs]
            elif any(len(p) == 2 for p in pairs):
                raise ValueError(f"label_words {','.join(label_words)!r}: either every item LABEL=WORD or none")
            else:
                words = list(label_words)
            self._set_label_words(tuple(words))  # single tokens? said now, before any file is read
            self._words = self.label_words
        self.files: dict[str, Any] = {}
        self.client_names: list[str] | None = None

    def _load(self) -> tuple[list, list]:
        from ..data.files import file_sha256

        files = split_files(self.data_dir, self.name)
        self.files = {k: {"path": str(p), "sha256": file_sha256(p)} for k, p in files.items()}
        if self.qa:
            train = read_instruct(files["train"], *self.columns, train=True)
            ev = read_instruct(files["eval"], *self.columns, train=False)
        else:
            whose = "from --label-words" if self.labels else f"those of {files['train'].name}"
            self.labels, train = read_text(files["train"], *self.columns, self.labels, whose, train=True)
            if len(self.labels) < 2:
                raise DataError(f"{files['train']}, column {self.columns[1]!r}: labels {self.labels}; a classifier "
                                "needs two or more")
            _, ev = read_text(files["eval"], *self.columns, self.labels, whose, train=False)
            words = self._words or tuple(" " + label for label in self.labels)
            if len(words) != len(self.labels):
                raise DataError(f"{files['train']}: {len(self.labels)} labels ({', '.join(self.labels)}) but "
                                f"--label-words gives {len(words)} words; give one a label (or LABEL=WORD pairs)")
            self._set_label_words(words)
        for which, rows in (("train", train), ("eval", ev)):
            if not rows:
                raise DataError(f"{files[which]}: no rows")
        if train[0].client is not None:
            self.client_names = label_order(e.client for e in train)
            if len(self.client_names) != self.num_clients:
                shown = ", ".join(self.client_names[:6]) + (", ..." if len(self.client_names) > 6 else "")
                raise DataError(f"{files['train']}, column {CLIENT_COLUMN!r}: {len(self.client_names)} clients "
                                f"({shown}) but the run has --clients {self.num_clients}")
            if self._partition_given:
                raise DataError(f"{files['train']}, column {CLIENT_COLUMN!r}: the file splits its examples among "
                                "the clients; drop --partition (or the column)")
            self.partition = "client-column"
        return train, ev

    def _partition(self, train: list, labels: np.ndarray) -> list[np.ndarray]:
        if self.client_names is None:
            return super()._partition(train, labels)
        index = {c: k for k, c in enumerate(self.client_names)}
        which = np.array([index[e.client] for e in train])
        parts = [np.flatnonzero(which == k) for k in range(self.num_clients)]
        empty = [self.client_names[k] for k, p in enumerate(parts) if len(p) == 0]
        if empty:  # (train_max's subset left them none)
            raise DataError(f"client {empty[0]!r} of column {CLIENT_COLUMN!r} has no training examples left "
                            "(raise --train-max)")
        return parts

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        if info["partition"] == "client-column":
            info["alpha"] = None
        info.update(columns=list(self.columns), data_files=self.files, client_names=self.client_names)
        if not self.qa:
            info["labels"] = list(self.labels)
        return info


def _columns(cfg, *names: str) -> tuple[str, ...]:
    """The run's column names (its task options ``names``)."""
    opts = cfg.task_options
    return tuple(getattr(opts, name) for name in names)


register_task("text", metrics={"eval_acc": "max", "eval_loss": "min"}, default_lr=_LM_LR,
              default_partition="dirichlet", validation=True,
              doc="your own classification files (CSV, TSV, JSON lines, Parquet): a text and a label column",
              options=_LM_OPTIONS | {"label_words", "text_column", "label_column"})(
    _builder("text", FileTask, lambda cfg: {"columns": _columns(cfg, "text_column", "label_column")}))
register_task("instruct", metrics={"eval_f1": "max", "eval_em": "max", "eval_loss": "min"}, default_lr=_LM_LR,
              default_partition="iid", validation=True,
              doc="your own prompt/response files: loss on the response, greedy answers by exact match and F1",
              options=_LM_OPTIONS | {"max_new_tokens", "prompt_column", "response_column"})(
    _builder("instruct", FileTask, lambda cfg: {"columns": _columns(cfg, "prompt_column", "response_column")}))
