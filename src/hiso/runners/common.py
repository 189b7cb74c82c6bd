"""Pieces shared by the in-process runners (ZO simulator, full-model baselines, Flower apps):
per-client byte counting and the rows of ``metrics.jsonl``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..core.round import Tally
from ..tasks.base import Task


@dataclass
class Comm:
    """Bytes of encoded messages per client, each direction."""

    up: np.ndarray
    down: np.ndarray

    @classmethod
    def zeros(cls, n: int) -> "Comm":
        return cls(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))

    def join(self, client: int, hello: bytes, welcome: bytes) -> None:
        """Count a client's join: its hello up, the server's welcome down."""
        self.up[client] += len(hello)
        self.down[client] += len(welcome)

    def summary(self) -> dict[str, float]:
        tot = self.up + self.down
        return {"bytes_up_mean": float(self.up.mean()), "bytes_up_max": int(self.up.max()),
                "bytes_down_mean": float(self.down.mean()), "bytes_down_max": int(self.down.max()),
                "bytes_total_mean": float(tot.mean()), "bytes_total_max": int(tot.max())}


class CommTally(Tally):
    """A round's tally (:class:`hiso.core.round.Tally`) into ``comm``; under local DP each
    answer the server received is a release in ``privacy`` (a ``PrivacyLedger``)."""

    def __init__(self, comm: Comm, privacy=None):
        self.comm, self.privacy = comm, privacy

    def down(self, client: int, n: int) -> None:
        self.comm.down[client] += n

    def up(self, client: int, n: int) -> None:
        self.comm.up[client] += n

    def released(self, plan, client: int) -> None:
        if self.privacy is not None:
            self.privacy.released(plan.round, plan.attempt, client)


def start_round(at: int, rounds: int, start: int | None = None) -> int:
    """Where a runner's ``run(rounds)`` starts: the round it stands at (``at``) unless ``start`` is
    given. ``rounds`` is the horizon, not a count, so a second ``run(8)`` after ``run(5)`` takes
    rounds 6..8 and numbers them so; a horizon behind the runner is refused."""
    start = at if start is None else start
    if rounds < start:
        raise ValueError(f"the federation is at round {start}: run(rounds) runs up to round `rounds` "
                         f"(a horizon, not a count), so give rounds >= {start}")
    return start


def metric_rows(task: Task, model, comm: Comm, step: Callable[[], float], rounds: int,
                eval_every: int, start: int = 0, wall: float = 0.0,
                extra: Callable[[], dict] | None = None, cost=None) -> Iterator[dict]:
    """The rows of ``metrics.jsonl`` for any runner whose ``step()`` returns the mean train loss.

    Row 0 is the initial evaluation; ``wall_s`` counts training time only (evaluation is not
    part of an algorithm's cost); evaluation every ``eval_every`` rounds and at the last.
    ``start`` > 0: a resumed run, rows from round ``start + 1`` on, ``wall_s`` from ``wall``.
    ``extra()``, if given, is merged into each round's row after its step; ``cost``
    (:class:`~hiso.runners.client_cost.ClientCost`), its clients' totals so far.
    """
    if start == 0:
        yield {"round": 0, "train_loss": None, "bytes_up": 0, "bytes_down": 0, "wall_s": 0.0, **task.evaluate(model)}
    for r in range(start + 1, rounds + 1):
        t0 = time.perf_counter()
        loss = step()
        wall += time.perf_counter() - t0
        row = {"round": r, "train_loss": loss, "bytes_up": int(comm.up.sum()),
               "bytes_down": int(comm.down.sum()), "wall_s": wall}
        if cost is not None:
            row.update(cost.row())
        if extra is not None:
            row.update(extra())
        if r % eval_every == 0 or r == rounds:
            row.update(task.evaluate(model))
        yield row


def finite(tensors) -> bool:
    """Whether every value of every tensor is finite (one reduction per tensor; a second pass
    only when a sum overflows or is NaN)."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in tensors)
