"""SQuAD v1.1 exact match and token F1, as the official ``evaluate-v1.1.py`` computes them.

Same behaviour as the official script (normalisation order; F1 = 0 when nothing overlaps,
even for two empty answers) so reported numbers compare with the papers'.
One deliberate difference in scale: :func:`squad_scores` returns fractions in [0, 1], like the
project's other accuracies; the official script prints percentages (x 100).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lower case, drop ASCII punctuation, drop articles a/an/the, collapse whitespace.

    The official order matters: punctuation goes before articles, so ``"the-end"`` becomes
    ``"theend"`` (no article left) while ``"the end"`` becomes ``"end"``.
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: str | Sequence[str]) -> tuple[str, ...]:
    """A lone string is one reference (not its characters); an empty list is an error."""
    out = (golds,) if isinstance(golds, str) else tuple(golds)
    if not out:
        raise ValueError("at least one reference answer is needed")
    return out


def _f1_one(pred_tokens: list[str], gold: str) -> float:
    gold_tokens = normalize_answer(gold).split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals some normalised reference, else 0.0."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def f1(pred: str, golds: str | Sequence[str]) -> float:
    """Token F1 (multiset overlap of normalised tokens), the max over the references."""
    pred_tokens = normalize_answer(pred).split()
    return max(_f1_one(pred_tokens, g) for g in _golds(golds))


def squad_scores(preds: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean ``exact_match`` and ``f1`` (in [0, 1]) of aligned predictions and reference lists."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predictions for {len(golds)} questions")
    if not preds:
        raise ValueError("no predictions to score")
    n = len(preds)
    return {
        "exact_match": sum(exact_match(p, g) for p, g in zip(preds, golds, strict=True)) / n,
        "f1": sum(f1(p, g) for p, g in zip(preds, golds, strict=True)) / n,
    }


__all__ = ["exact_match", "f1", "normalize_answer", "squad_scores"]
