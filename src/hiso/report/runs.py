"""Finished runs on disk, as ``hiso compare``'s table reads them: a run's configuration,
metrics rows and summary (:class:`RunResult`), and an arm's runs at its chosen lr (:class:`ArmResult`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    """One finished run on disk: its configuration, metric rows and summary."""

    dir: Path
    seed: int
    config: dict
    rows: list[dict]
    summary: dict

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


def read_rows(run_dir: str | Path) -> list[dict]:
    """The rows of a run directory's ``metrics.jsonl``, one dict per round (blank lines skipped)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_run_result(run_dir: str | Path, seed: int | None = None) -> RunResult:
    d = Path(run_dir)
    if not (d / "summary.json").is_file():
        raise FileNotFoundError(f"{d}/summary.json not found: the run did not finish")
    config = json.loads((d / "config.json").read_text())
    rows = read_rows(d)
    summary = json.loads((d / "summary.json").read_text())
    return RunResult(d, config.get("seed", seed) if seed is None else seed, config, rows, summary)
