"""The comparison table as data: one :class:`TableRow` per arm and the :class:`Table` of them
(built, rendered and defined in :mod:`hiso.report.table`; the footer reads it too)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tasks.registry import higher_is_better
from .reach import Reach


@dataclass
class TableRow:
    name: str
    algorithm: str
    lr: float
    best_mean: float
    best_std: float | None
    seeds: int
    reach: Reach
    rounds: float | None  # rounds to reach T (for the reference: to its own best)
    speedup: float | None
    seconds: float | None  # training seconds to reach T (for the reference: to its own best)
    lr_grid: tuple[float, ...]  # the lrs tried (empty: unknown)
    is_reference: bool
    bytes_up: float
    bytes_down: float
    s_per_round: float | None
    peak_rss_mb: float | None
    bytes_to_reach: float | None = None  # per client, up + down, at the reaching round (mean over seeds)
    client_forwards: float | None = None  # per client-round (summary.json "client"; mean over seeds)
    client_backwards: float | None = None
    client_s: float | None = None  # a client's compute seconds per round it is sampled in
    client_peak_bytes: float | None = None  # resident + transient peak of one answer (max over seeds)
    last_mean: float | None = None  # metric at each run's last evaluation, mean over seeds
    # share of the gain from round 0 to the reported value still held at the end, of the means over
    # seeds (the numbers the warning prints; a seed that never gained counts too)
    kept: float | None = None
    first_mean: float | None = None  # metric at round 0, mean over seeds
    privacy: dict | None = None  # summary.json's "privacy" of a DP arm: mode, clip, noise multiplier, epsilon
    reliability: str = ""  # its aggregation rule, attackers and injected faults, when any differs from none

    @property
    def bytes_total(self) -> float:
        return self.bytes_up + self.bytes_down


@dataclass
class Table:
    rows: list[TableRow]
    metric: str
    reference: str
    threshold: float  # T: the reference's mean best of ``select``
    context: dict  # facts for the footer: seeds, rounds, eval_every, n_eval, n_val, clients, task
    select: str = ""  # the metric lr, round and "rounds to reach" go by ("" = metric: selected on test)
    select_note: str = ""  # why selection is on the reported examples (shown in the footer)

    def __post_init__(self):
        self.select = self.select or self.metric

    @property
    def on_test(self) -> bool:
        """Whether lr and round were selected on the very examples (metric) reported."""
        return self.select == self.metric

    @property
    def higher(self) -> bool:
        return higher_is_better(self.metric, self.context.get("task"))
