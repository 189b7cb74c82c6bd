"""What ``hiso flower`` prints while the federation runs: each round as the ServerApp logs it
(the run directory's ``metrics.jsonl``, read as it grows), with the figures ``hiso run``
shows (the training loss, the metrics of an evaluated round) and the bytes so far."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHOWN = ("eval_acc", "eval_loss", "eval_f1", "eval_em", "gap")  # an evaluated row's figures, in this order


def _bytes(n: float) -> str:
    return f"{n:.0f} B" if n < 10_000 else f"{n / 1e3:.1f} kB" if n < 10_000_000 else f"{n / 1e6:.1f} MB"


def round_line(row: dict, rounds: int) -> str:
    """One metrics row as a line: ``round 1/2: loss 0.7146, eval_acc 0.4375; 76 B up, 180 B down; 9.0 s``."""
    if row["round"] == 0:
        head = "round 0 (the start)"
    else:
        head = f"round {row['round']}/{rounds}"
    figs = [f"loss {row['train_loss']:.4g}"] if row.get("train_loss") is not None else []  # (None under DP)
    figs += [f"{k} {row[k]:.4g}" for k in SHOWN if isinstance(row.get(k), (int, float))]
    sent = f"{_bytes(row.get('bytes_up', 0))} up, {_bytes(row.get('bytes_down', 0))} down so far"
    return f"{head}: " + ", ".join(figs) + ("; " if figs else "") + f"{sent}; {row.get('wall_s', 0.0):.1f} s"


class MetricsFollower:
    """Prints every row a run directory's ``metrics.jsonl`` gains (the rows there before it
    started, a resumed run's, are not repeated); call :meth:`poll` now and then and once at the end."""

    def __init__(self, out: str | Path, rounds: int, stream=None):
        self.path, self.rounds, self.stream = Path(out) / "metrics.jsonl", rounds, stream
        try:
            self.pos = self.path.stat().st_size
        except OSError:
            self.pos = 0
        self.printed = 0

    def rows(self) -> list[dict]:
        """The complete rows written since the last call."""
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.pos:  # the file was started again
                    self.pos = 0
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        done = data[: data.rfind(b"\n") + 1]
        self.pos += len(done)
        out = []
        for line in done.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def poll(self, *_) -> None:
        for row in self.rows():
            print(round_line(row, self.rounds), file=self.stream or sys.stdout, flush=True)
            self.printed += 1
