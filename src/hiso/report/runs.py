"""Runs on disk, as ``hiso compare``'s table reads them: a run's configuration, metrics rows and
summary (:class:`RunResult`), and an arm's runs at its chosen lr (:class:`ArmResult`). A run can
also be read as it stood at an earlier round (``at_round``), finished or not: what
``hiso compare --table-only --at-round`` tabulates beside runs still going."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..compat import flat_task_options


@dataclass
class RunResult:
    """One run on disk: its configuration, metric rows and summary. ``cut``: read as it stood at
    round ``config["rounds"]`` (its rows up to there, a summary made from them), not as it ended."""

    dir: Path
    seed: int
    config: dict
    rows: list[dict]
    summary: dict
    cut: bool = False

    @property
    def clients(self) -> int:
        return int(self.config["clients"])

    def eval_keys(self) -> list[str]:
        keys: list[str] = []
        for r in self.rows:
            for k in r:
                if (k.startswith(("eval_", "val_")) or k == "gap") and k not in keys:
                    keys.append(k)
        return keys

    @property
    def peak_rss_mb(self) -> float | None:
        return self.summary.get("peak_rss_mb_run", self.summary.get("peak_rss_mb"))


@dataclass
class ArmResult:
    """An arm's runs at its chosen lr (one per seed), and the best values over its whole grid."""

    name: str
    algorithm: str
    lr: float
    runs: list[RunResult]
    grid: dict[float, list[float]] = field(default_factory=dict)  # lr -> per-seed best


def read_rows(run_dir: str | Path, going: bool = False) -> list[dict]:
    """The rows of a run directory's ``metrics.jsonl``, one dict per round (blank lines skipped).
    ``going``: the run may be writing its next row now, so a last line without its newline is
    not read (it is not whole yet)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    if going and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def last_round(run_dir: str | Path) -> int | None:
    """The last round a run directory's ``metrics.jsonl`` holds (None: no row, or no file)."""
    try:
        rows = read_rows(run_dir, going=True)
    except (OSError, ValueError):
        return None
    return max((int(r["round"]) for r in rows if "round" in r), default=None)


def load_run_result(run_dir: str | Path, seed: int | None = None, at_round: int | None = None) -> RunResult:
    """A finished run (``at_round`` None), or any run, finished or not, as it stood at round
    ``at_round``: its rows up to that round and a summary made from the row of that round
    (:func:`summary_at`); a run that had ended by then (at its last round, or diverged before) as
    it ended. Raises if a run still going has not logged ``at_round`` yet."""
    d = Path(run_dir)
    summary_path = d / "summary.json"
    if at_round is None and not summary_path.is_file():
        raise FileNotFoundError(f"{d}/summary.json not found: the run did not finish")
    config = flat_task_options(json.loads((d / "config.json").read_text()))  # (schema 5's task_opts flat)
    rows = read_rows(d, going=at_round is not None)
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    seed = config.get("seed", seed) if seed is None else seed
    if at_round is None:
        return RunResult(d, seed, config, rows, summary)
    as_of = {**config, "rounds": at_round, "planned_rounds": config.get("rounds")}
    if summary is not None and rows and int(rows[-1]["round"]) <= at_round:
        return RunResult(d, seed, as_of, rows, summary)  # ended by then (its last round, or diverged before)
    kept = [r for r in rows if int(r["round"]) <= at_round]
    if not kept or kept[-1]["round"] != at_round:
        last = rows[-1]["round"] if rows else None
        raise ValueError(f"{d} has not logged round {at_round} (its last: {last})")
    return RunResult(d, seed, as_of, kept, summary_at(d, config, kept, summary), cut=True)


def summary_at(run_dir: Path, config: dict, rows: list[dict], summary: dict | None) -> dict:
    """The summary fields the table reads, as of the last of ``rows``: communication per client
    from the cumulative bytes of that row (the mean over all clients, as the run's own summary
    gives it), seconds per round from its training time, the client's work per answer from its
    counts, epsilon spent by then. Peak memories come from the finished run's summary (None for
    a run still going): memory is a run's peak, not a quantity of a round."""
    row = rows[-1]
    rnd, clients = int(row["round"]), max(int(config.get("clients") or 1), 1)
    up, down = float(row.get("bytes_up") or 0), float(row.get("bytes_down") or 0)
    out: dict = {"rounds_done": rnd, "wall_s_train": row.get("wall_s"),
                 "communication_per_client": {"bytes_up_mean": up / clients, "bytes_down_mean": down / clients,
                                              "bytes_total_mean": (up + down) / clients},
                 "s_per_round": (row.get("wall_s") or 0.0) / rnd if rnd else None}
    done = summary or {}
    for k in ("peak_rss_mb", "peak_rss_mb_run"):
        if done.get(k) is not None:
            out[k] = done[k]
    n = int(row.get("client_answers") or 0)
    if n:
        mem = {k: (done.get("client") or {}).get(k) for k in ("resident_bytes", "transient_peak_bytes", "peak_bytes")}
        out["client"] = {"answers": n, "forwards_per_round": row.get("client_forwards", 0) / n,
                         "backwards_per_round": row.get("client_backwards", 0) / n,
                         "s_per_round": row["client_s"] / n if "client_s" in row else None, **mem}  # (none under DP)
    if config.get("dp_clip") is not None:
        from ..runners.runfiles import saved_config
        from ..runners.accounting import ledger_of_run
        cfg = saved_config(run_dir)[0]
        ledger = ledger_of_run(run_dir, cfg, rnd)  # participations of the rounds logged so far
        out["privacy"] = (ledger.summary() if ledger is not None else  # (an unreadable log: no epsilon)
                          {"mode": cfg.dp_mode, "clip": cfg.dp_clip, "noise_multiplier": cfg.dp_noise,
                           "delta": cfg.dp_delta, "epsilon_budget": cfg.dp_epsilon, "epsilon": None})
    return out
