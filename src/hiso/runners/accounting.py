"""A DP run's privacy ledger: how many rounds each client took part in, the epsilon that holds
for the run's reader, the budget check, and what ``metrics.jsonl`` and ``summary.json`` say.

The reader of a hiso run may know who took part in each round (the sample follows from the run
seed every client is given; ``history.bin`` lists the participants), so the epsilon reported is
the one without amplification by sampling, of the client that took part in the most rounds
(``public-sample``: :mod:`hiso.methods.privacy`, "Threat models").

What counts as a release depends on where the noise is added. Central mode: a client counts for
a round when its answer entered the logged aggregate (the record's participants), the only thing
the noise covers; an answer lost or rejected released nothing that the reader sees. Local mode
holds against the server too, which reads every answer that reaches it: a client counts once for
each answer it sent that reached the server or was on its way when the run stopped (logged, late,
rejected, of an attempt planned again; a duplicate is the same release, counted once). Those the
log does not list are in their round's metrics row (``dp_unlogged``: client -> answers); those of
the round a run stopped in (its earlier plans' answers, when the budget refused a re-plan) are in
``summary.json``'s ``privacy.dp_unlogged``.

The runners (the simulator, the Flower ServerApp) call :meth:`PrivacyLedger.record` for every
record they log or replay, and :meth:`PrivacyLedger.refusal` with each planned round's sample
before anyone computes it; a run directory read back (a report, an export) is counted from its
``history.bin`` (:func:`ledger_of_run`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..methods.privacy import HOLDS_AGAINST

THREAT_MODEL = "public-sample"
TRAIN_LOSS_WITHHELD = ("withheld: under DP no client sends its training loss (it would leave the client neither "
                       "clipped, noised nor accounted for), so train_loss is null in every row")


class PrivacyLedger:
    """Participations per client of a DP run configured by ``cfg`` (a :class:`hiso.config.RunConfig`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.counts = np.zeros(cfg.clients, dtype=np.int64)
        self.local = cfg.dp_mode == "local"
        self._released: set[tuple[int, int, int]] = set()  # local: (round, attempt, client) counted, open rounds
        self._since: set[tuple[int, int, int]] = set()  # local: those counted since the last record
        self.unlogged: dict[int, int] = {}  # local: the last round's answers counted that its record does not list

    def released(self, round: int, attempt: int, client: int) -> None:
        """Local mode: client ``client``'s answer to ``(round, attempt)`` reached the server (or is on
        its way): counted once, however often it arrives. Central mode: nothing (the record counts)."""
        key = (int(round), int(attempt), int(client))
        if self.local and key not in self._released:
            self._released.add(key)
            self._since.add(key)
            self.counts[key[2]] += 1

    def record(self, rec) -> None:
        """Count a logged round (:class:`~hiso.core.history.RoundRecord`): its participants took part."""
        if not self.local:
            self.counts[list(rec.participants)] += 1
            return
        logged = {(int(rec.round), int(rec.attempt), int(c)) for c in rec.participants}
        for key in sorted(logged):
            self.released(*key)
        self.unlogged = {}
        for _, _, c in sorted(self._since - logged):
            self.unlogged[c] = self.unlogged.get(c, 0) + 1
        self._since = set()
        self._released = {k for k in self._released if k[0] >= rec.round}  # later answers are of later rounds

    def add_unlogged(self, row: dict) -> None:
        """Local mode: count a metrics row's ``dp_unlogged`` (a run read back from its files)."""
        if self.local:
            for c, n in (row.get("dp_unlogged") or {}).items():
                self.counts[int(c)] += int(n)

    def open_unlogged(self) -> dict[int, int]:
        """Local mode: the answers counted since the last record (of a round not logged yet), by client."""
        out: dict[int, int] = {}
        for _, _, c in sorted(self._since):
            out[c] = out.get(c, 0) + 1
        return out

    def worst(self) -> tuple[int | None, int]:
        """The client that took part in the most rounds so far (the lowest id of a tie; None
        before any round) and how many."""
        n = int(self.counts.max(initial=0))
        return (int(np.argmax(self.counts)) if n else None), n

    def epsilon(self) -> float | None:
        """The worst client's epsilon at dp_delta so far (None without a delta)."""
        return self.cfg.dp_spent(self.worst()[1])

    def row(self) -> dict:
        """The DP figures of an evaluated metrics row: the noise multiplier, the worst client's
        participations and (with a delta) its epsilon."""
        out = {"dp_noise_multiplier": self.cfg.dp_noise, "dp_participations_max": self.worst()[1]}
        if self.cfg.dp_delta is not None:
            out["dp_epsilon"] = self.epsilon()
        return out

    def refusal(self, participants) -> str | None:
        """Why the planned round of ``participants`` may not run under dp_epsilon (None: it may):
        one of them would pass the budget by taking part (the noise is solved for the run's own
        sample, so only a run whose rounds were planned again can get here)."""
        cfg = self.cfg
        if cfg.dp_epsilon is None or not len(participants):
            return None
        n = int(self.counts[list(participants)].max()) + 1
        spent = cfg.dp_spent(n)
        if spent <= cfg.dp_epsilon * (1 + 1e-9):
            return None
        who = next(int(c) for c in participants if self.counts[c] + 1 == n)
        return (f"privacy budget spent: the next round would take client {who} to {n} rounds, epsilon {spent:.3g} > "
                f"dp_epsilon {cfg.dp_epsilon:g} at delta {cfg.dp_delta:g} (the run stops with its state saved)")

    def summary(self, stopped: str | None = None) -> dict:
        """summary.json's ``privacy``: the settings, the threat model and what it holds against,
        the worst client's epsilon and participations, and what is withheld."""
        cfg = self.cfg
        client, n = self.worst()
        open_ = {"dp_unlogged": {str(c): k for c, k in self.open_unlogged().items()}} if self._since else {}
        return {"mode": cfg.dp_mode, "clip": cfg.dp_clip, "noise_multiplier": cfg.dp_noise, "delta": cfg.dp_delta,
                "epsilon_budget": cfg.dp_epsilon, "stopped": stopped, "threat_model": THREAT_MODEL,
                "holds_against": HOLDS_AGAINST[cfg.dp_mode], "epsilon": self.epsilon(),
                "participations_max": n, "worst_client": client, "train_loss": TRAIN_LOSS_WITHHELD, **open_}


def privacy_ledger(cfg) -> PrivacyLedger | None:
    """A run's ledger, None without DP."""
    return None if cfg.dp_clip is None else PrivacyLedger(cfg)


def ledger_of_run(run_dir: str | Path, cfg, rounds: int) -> PrivacyLedger | None:
    """The ledger of ``run_dir``'s first ``rounds`` logged rounds (its ``history.bin``), or None
    where the log cannot be read."""
    import json

    from .runfiles import read_run_history
    try:
        records = read_run_history(run_dir, cfg).records
    except (OSError, ValueError):
        return None
    ledger = PrivacyLedger(cfg)
    for rec in records[:rounds]:
        ledger.record(rec)
    if ledger.local:  # the answers the log does not list (late, rejected), from their rounds' rows
        try:
            lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            row = json.loads(line) if line.strip() else {}
            if 0 < row.get("round", 0) <= rounds:
                ledger.add_unlogged(row)
        try:  # the round the run stopped in: its answers released, no row to list them
            done = json.loads(Path(run_dir, "summary.json").read_text())
        except (OSError, ValueError):
            done = {}
        if done.get("rounds_done") == rounds:
            ledger.add_unlogged(done.get("privacy") or {})
    return ledger
