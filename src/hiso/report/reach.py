"""The pure functions behind ``hiso compare``'s choices and columns: a run's best (or
selected) value, the first round that reaches a threshold, speed-ups, mean and spread over
seeds. The definitions they implement are in :mod:`hiso.report.table`'s docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import mean, stdev

REL_TOL = 1e-9


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def best_of(rows: list[dict], metric: str, higher: bool) -> float:
    """The best ``metric`` over the rows that have it (NaN ignored); NaN if there is none."""
    vals = [r[metric] for r in rows if _finite(r.get(metric))]
    if not vals:
        return math.nan
    return max(vals) if higher else min(vals)


def first_and_last(rows: list[dict], metric: str) -> tuple[float, float]:
    """``metric`` at a run's first and last evaluated rows (NaN ignored; NaN if none)."""
    vals = [r[metric] for r in rows if _finite(r.get(metric))]
    return (vals[0], vals[-1]) if vals else (math.nan, math.nan)


def kept_share(start: float, reported: float, last: float, higher: bool) -> float | None:
    """How much of its gain a run still holds at its last evaluation: (last - start) /
    (reported - start), signs turned so that "better" is positive (1: it ended where it was
    reported, 0: back where it started, below 0: worse than it started). None where the run
    gained nothing to keep or a value is missing."""
    if not all(math.isfinite(v) for v in (start, reported, last)):
        return None
    sign = 1.0 if higher else -1.0
    gain = sign * (reported - start)
    return None if gain <= 0 else sign * (last - start) / gain


def val_metric(metric: str) -> str:
    """The validation split's name of an eval metric: ``eval_acc`` -> ``val_acc``."""
    if not metric.startswith("eval_"):
        raise ValueError(f"metric {metric!r} has no validation counterpart (only eval_* metrics do)")
    return "val_" + metric.removeprefix("eval_")


def selected_row(rows: list[dict], metric: str, select: str, higher: bool) -> dict | None:
    """The row a run is reported at: the first evaluated row with the best ``select`` value
    among the rows that hold both ``select`` and ``metric`` (NaN ignored); None if none."""
    rows = [r for r in rows if _finite(r.get(select)) and _finite(r.get(metric))]
    if not rows:
        return None
    best = (max if higher else min)(r[select] for r in rows)
    return next(r for r in rows if r[select] == best)


def selected_value(rows: list[dict], metric: str, select: str, higher: bool) -> float:
    """A run's reported ``metric``: its best when selecting on ``metric`` itself (``select ==
    metric``), else its ``metric`` at :func:`selected_row` (the round best on validation); NaN if none."""
    if select == metric:
        return best_of(rows, metric, higher)
    r = selected_row(rows, metric, select, higher)
    return math.nan if r is None else float(r[metric])


def reaches(value: float, threshold: float, higher: bool) -> bool:
    """Whether ``value`` is at least as good as ``threshold`` (up to a relative 1e-9)."""
    if not _finite(value) or not _finite(threshold):
        return False
    tol = REL_TOL * max(1.0, abs(threshold)) if math.isfinite(threshold) else 0.0
    return value >= threshold - tol if higher else value <= threshold + tol


def first_reach_row(rows: list[dict], metric: str, threshold: float, higher: bool) -> dict | None:
    """The first row (rows in round order) whose ``metric`` reaches ``threshold``; None if never."""
    for r in rows:
        if metric in r and reaches(r[metric], threshold, higher):
            return r
    return None


def first_reach(rows: list[dict], metric: str, threshold: float, higher: bool) -> int | None:
    """The first round (rows in round order) whose ``metric`` reaches ``threshold``; None if never."""
    r = first_reach_row(rows, metric, threshold, higher)
    return None if r is None else int(r["round"])


def _reach_of(rows_per_seed: list[dict | None]) -> "Reach":
    return Reach(tuple(None if r is None else int(r["round"]) for r in rows_per_seed),
                 tuple(None if r is None or r.get("wall_s") is None else float(r["wall_s"]) for r in rows_per_seed))


@dataclass(frozen=True)
class Reach:
    per_seed: tuple[int | None, ...]
    seconds: tuple[float | None, ...] = ()  # per seed, the training time (wall_s) at that round

    @property
    def mean_seconds(self) -> float | None:
        """Mean training seconds to reach, defined only when every seed reached (and has wall_s)."""
        if not self.seconds or any(s is None for s in self.seconds) or self.reached < self.n:
            return None
        return mean(self.seconds)

    @property
    def reached(self) -> int:
        return sum(r is not None for r in self.per_seed)

    @property
    def n(self) -> int:
        return len(self.per_seed)

    @property
    def mean(self) -> float | None:
        """Mean over seeds, defined only when every seed reached."""
        if not self.per_seed or self.reached < self.n:
            return None
        return mean(self.per_seed)


def rounds_to_reach(runs_rows: list[list[dict]], metric: str, threshold: float, higher: bool) -> Reach:
    """Per seed, the first evaluated round reaching ``threshold`` (and its training time)."""
    return _reach_of([first_reach_row(rows, metric, threshold, higher) for rows in runs_rows])


def rounds_to_own_best(runs_rows: list[list[dict]], metric: str, higher: bool) -> Reach:
    """Per seed, the first evaluated round at which the run attains its own best (and its training time)."""
    return _reach_of([first_reach_row(rows, metric, best_of(rows, metric, higher), higher) for rows in runs_rows])


def speedup(reference_rounds: float | None, rounds: float | None) -> float | None:
    """reference's rounds / this arm's rounds; None if either is undefined or this is 0."""
    if reference_rounds is None or rounds is None or rounds <= 0:
        return None
    return reference_rounds / rounds


def mean_std(vals: list[float]) -> tuple[float, float | None]:
    """Mean and sample std (None for a single value); NaN if any value is NaN."""
    if any(not _finite(v) for v in vals):
        return math.nan, None
    return mean(vals), (stdev(vals) if len(vals) > 1 else None)
