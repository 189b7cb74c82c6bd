"""The comparison table (``DIR/table.md``, ``DIR/table.csv``) and the pure functions behind it.

One row per arm (algorithm or variant), at the lr chosen for it (see
:mod:`hiso.experiments.compare`), over its seeds. ``metric`` is the evaluation metric of the
comparison (``eval_acc`` for classifiers: higher is better; ``eval_loss`` or the quadratic's
``gap``: lower is better). ``select`` is the metric the choices go by: ``metric`` itself
(selection on test, the header says "selected on test") or its validation counterpart
(``eval_acc`` -> ``val_acc``, on examples held out apart from the reported ones). Definitions,
for selection on test:

* **best**: a run's best ``metric`` over its evaluated rounds (row 0, every ``eval_every``
  rounds, and the last); reported as mean +- sample standard deviation (ddof = 1) over seeds,
  in % for accuracies. A single seed shows no +-.
* **rounds to reach the reference's best**: let ``T`` be the reference arm's mean over seeds of
  its best. For each seed, the first evaluated round whose ``metric`` reaches ``T`` (``>= T``
  for accuracies, ``<= T`` otherwise; a relative tolerance of 1e-9 absorbs the rounding of the
  mean); the table shows the mean over seeds if every seed reaches ``T``, else ``—`` with how
  many seeds did. The resolution is ``eval_every`` rounds. For the reference itself the column
  holds its **rounds to its own best**: per seed the first evaluated round at which that seed's
  run attains its own best, mean over seeds (marked "own best").
* **time to reach the reference's best**: the same first evaluated round, counted in seconds of
  training instead of rounds: that round's ``wall_s`` (cumulative training time, evaluation
  excluded), mean over seeds if every seed reaches ``T``, else ``—``; for the reference, the time
  to its own best. Wall time depends on the machine and on what else ran beside it (``--jobs``).
* **bytes to reach the reference's best**: the same first evaluated round, counted in bytes:
  the federation's cumulative uplink + downlink bytes at that round (``bytes_up + bytes_down``
  of its metrics row) divided by the number of clients, i.e. per client as in the communication
  columns; mean over seeds if every seed reaches ``T``, else ``—``; for the reference, the bytes
  to its own best. This is the column that compares arms of different bytes per round (float16
  scalars, more perturbations) at equal communication.
* **speed-up**: the reference's rounds to its own best divided by this arm's rounds to reach
  ``T`` (1.00x for the reference; ``—`` when not reached or when reached at round 0).

Selecting on validation (``select = "val_acc"``), every choice is made on ``select`` and the
test ``metric`` is only reported: a run's **selected round** is its first evaluated round with
its best ``select``, and the table reports its ``metric`` at that round (mean +- std over
seeds; header "eval accuracy (%) at best validation accuracy round"); ``T`` is the reference's
mean best ``select``, and rounds and time to reach count until ``select`` reaches ``T``, so the
reference's own row holds its selected rounds (marked "selected round").
* **communication per client**: the bytes one client sent (uplink) and received (downlink)
  over the whole run, averaged over all clients (a round a client is not sampled in costs it
  nothing), then over seeds; total = up + down. Decimal units: 1 KB = 1000 B, 1 MB = 10^6 B.
* **s / round**: training wall time (evaluation excluded) divided by rounds, mean over seeds.
* **peak memory**: the peak resident memory of the process during the run (``peak_rss_mb_run``
  when compare measured it per run, else the run's ``peak_rss_mb``), the max over seeds, in MiB.
* **client fwd + bwd / round**, **client s / round**, **client peak memory**: one sampled
  client's forwards + backpropagations and compute seconds per round it answers (means over
  seeds), and its peak memory (max over seeds), from ``summary.json``'s ``client``
  (:mod:`hiso.runners.client_cost`); ``—`` for runs without it (older runs, Flower runs).

The footer under the table (:mod:`hiso.report.footer`) states the setup and each column's
definition, and warns where the table can mislead: an arm whose chosen lr is the smallest or
largest of a grid of two or more (the best lr may lie outside it), an arm with a one-point grid
("lr not tuned"), a single seed ("1 seed: no spread"), and an arm whose runs **ended below what
the table reports**: at their last evaluation they keep, on average over seeds, less than three
quarters of what they had gained from round 0 to the reported value (``kept_share``), so the
final model is not the one reported (a run that degrades after its best: lr too large for the
horizon). The CSV's ``last_<metric>_mean`` is the metric at each run's last evaluation, mean
over seeds.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from statistics import mean

from ..tasks.registry import higher_is_better  # the one rule (re-exported here)
# the footer, labels and units, in their own modules; re-exported so the names keep working here
from .footer import (KEPT_WARN, RISE_WARN, _privacy_of, _reliability_of,  # noqa: F401
                     ending_warnings, footer, loss_rise_note, lr_warnings, privacy_lines, reliability_lines,
                     run_ending_note, selection_lines)
from .labels import (METRIC_LABEL, _fmt_rounds, _fmt_threshold, display_name, human_bytes,  # noqa: F401
                     human_seconds, is_percent, metric_label)
# the runs read and the pure metrics, re-exported: ``from hiso.report.table import ...`` keeps working
from .reach import (REL_TOL, Reach, best_of, first_and_last, first_reach, first_reach_row,  # noqa: F401
                    kept_share, mean_std, reaches, rounds_to_own_best, rounds_to_reach, selected_row,
                    selected_value, speedup, val_metric)
from .runs import ArmResult, RunResult, load_run_result  # noqa: F401
from .table_data import Table, TableRow  # the table's data (the footer reads it too)


def bytes_per_client_at(rows: list[dict], round: int | None, clients: int | None) -> float | None:
    """Cumulative (uplink + downlink) bytes per client at ``round`` (None where unknown)."""
    if round is None or not clients:
        return None
    for r in rows:
        if r.get("round") == round and "bytes_up" in r and "bytes_down" in r:
            return (float(r["bytes_up"]) + float(r["bytes_down"])) / clients
    return None


def _mean_of(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return mean(vals) if vals else None


def build_table(arms: list[ArmResult], reference: str, metric: str, select: str | None = None,
                select_note: str = "") -> Table:
    """The table of ``metric``. ``select`` (default ``metric``): the metric each run's reported
    round, the threshold T and the rounds to reach it go by. ``select == metric`` (selection on
    test): a run reports its best ``metric``. A validation metric (``val_acc``): a run reports
    its ``metric`` at its round of best ``select``; T is the reference's mean best ``select``
    and "rounds to reach" counts rounds until ``select`` reaches it: every choice is made on
    validation, the test examples are only reported."""
    select = select or metric
    ref = next((a for a in arms if a.name == reference), None)
    if ref is None:
        raise ValueError(f"reference {reference!r} is not among the arms")
    higher = higher_is_better(metric, ref.runs[0].config.get("task"))
    threshold = mean_std([best_of(r.rows, select, higher) for r in ref.runs])[0]
    ref_own = rounds_to_own_best([r.rows for r in ref.runs], select, higher)  # = its selected rounds
    rows = []
    for arm in arms:
        reported = [selected_value(r.rows, metric, select, higher) for r in arm.runs]
        m, s = mean_std(reported)
        ends = [first_and_last(r.rows, metric) for r in arm.runs]
        first_mean = _mean_of([first for first, _ in ends if math.isfinite(first)])
        last_mean = _mean_of([last for _, last in ends if math.isfinite(last)])
        kept = None if first_mean is None or last_mean is None else kept_share(first_mean, m, last_mean, higher)
        if arm.name == reference:
            reach, rounds = ref_own, ref_own.mean
        else:
            reach = rounds_to_reach([r.rows for r in arm.runs], select, threshold, higher)
            rounds = reach.mean
        comm = [r.summary["communication_per_client"] for r in arm.runs]
        nbytes = [bytes_per_client_at(run.rows, rnd, run.config.get("clients"))
                  for run, rnd in zip(arm.runs, reach.per_seed)]
        peaks = [r.peak_rss_mb for r in arm.runs if r.peak_rss_mb is not None]
        client = [r.summary.get("client") or {} for r in arm.runs]
        cpeaks = [c["peak_bytes"] for c in client if c.get("peak_bytes") is not None]
        rows.append(TableRow(
            name=arm.name, algorithm=arm.algorithm, lr=arm.lr, best_mean=m, best_std=s,
            seeds=len(arm.runs), reach=reach, rounds=rounds,
            speedup=speedup(ref_own.mean, rounds), seconds=reach.mean_seconds,
            lr_grid=tuple(arm.grid), is_reference=arm.name == reference,
            bytes_up=mean(c["bytes_up_mean"] for c in comm),
            bytes_down=mean(c["bytes_down_mean"] for c in comm),
            s_per_round=_mean_of([r.summary.get("s_per_round") for r in arm.runs]),
            peak_rss_mb=max(peaks) if peaks else None,
            bytes_to_reach=None if not nbytes or any(b is None for b in nbytes) else mean(nbytes),
            client_forwards=_mean_of([c.get("forwards_per_round") for c in client]),
            client_backwards=_mean_of([c.get("backwards_per_round") for c in client]),
            client_s=_mean_of([c.get("s_per_round") for c in client]),
            client_peak_bytes=max(cpeaks) if cpeaks else None,
            last_mean=last_mean, kept=kept, first_mean=first_mean, privacy=_privacy_of(arm.runs),
            reliability=_reliability_of(arm.runs[0].config)))
    cfg0 = ref.runs[0].config
    info = cfg0.get("task_info", {}) or {}
    # arms whose runs were evaluated on another grid or run to another horizon than the reference's
    other = {arm.name: (arm.runs[0].config.get("eval_every"), arm.runs[0].config.get("rounds")) for arm in arms
             if (arm.runs[0].config.get("eval_every"), arm.runs[0].config.get("rounds"))
             != (cfg0.get("eval_every"), cfg0.get("rounds"))}
    context = {"task": cfg0.get("task"), "rounds": cfg0.get("rounds"), "planned_rounds": cfg0.get("planned_rounds"),
               "eval_every": cfg0.get("eval_every"), "other_grids": other,
               "clients": cfg0.get("clients"), "sampled": cfg0.get("sampled"),
               "seeds": [r.seed for r in ref.runs], "n_eval": info.get("n_eval"), "n_val": info.get("n_val")}
    return Table(rows, metric, reference, threshold, context, select, select_note)


def _best_header(table: Table) -> str:
    pct = " (%)" if is_percent(table.metric) else ""
    if table.on_test:
        return f"best {metric_label(table.metric)}{pct}, selected on test"
    return f"{metric_label(table.metric)}{pct} at best {metric_label(table.select)} round"


def _fmt_best(row: TableRow, metric: str) -> str:
    if not math.isfinite(row.best_mean):
        return "nan"
    scale = 100.0 if is_percent(metric) else 1.0
    if is_percent(metric):
        m = f"{row.best_mean * scale:.2f}"
        return m if row.best_std is None else f"{m} ± {row.best_std * scale:.2f}"
    m = f"{row.best_mean:.4g}"
    if row.best_std is None:
        return m
    if "e" in m:
        return f"{m} ± {row.best_std:.2g}"
    decimals = len(m.split(".")[1]) if "." in m else 0
    return f"{m} ± {row.best_std:.{decimals}f}"  # std to the mean's precision


def _fmt_reach(row: TableRow, own: str = "own best") -> str:
    if row.rounds is not None:
        return _fmt_rounds(row.rounds) + (f" ({own})" if row.is_reference else "")
    if row.reach.reached == 0:
        return "not reached"
    return f"— ({row.reach.reached}/{row.reach.n} seeds)"


def _fmt_work(row: TableRow) -> str:
    """Forwards + backpropagations per client-round, e.g. ``6 + 0`` (``—`` where not recorded)."""
    if row.client_forwards is None:
        return "—"
    return f"{row.client_forwards:,.4g} + {row.client_backwards or 0:,.4g}"


def markdown_columns(table: Table) -> list[str]:
    ref = display_name(table.reference)
    best = "best" if table.on_test else f"best {metric_label(table.select)}"
    return ["algorithm", "lr", _best_header(table),
            f"rounds to {ref}'s {best} ({_fmt_threshold(table.threshold, table.metric)})",
            f"time to {ref}'s {best}", f"bytes / client to {ref}'s {best}", "speed-up",
            "uplink / client", "downlink / client", "total / client", "s / round", "peak memory",
            "client fwd + bwd / round", "client s / round", "client peak memory"]


def to_markdown(table: Table) -> str:
    cols = markdown_columns(table)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    for r in table.rows:
        cells = [display_name(r.name), f"{r.lr:g}", _fmt_best(r, table.metric),
                 _fmt_reach(r, "own best" if table.on_test else "selected round"),
                 human_seconds(r.seconds), human_bytes(r.bytes_to_reach),
                 "—" if r.speedup is None else f"{r.speedup:.2f}×",
                 human_bytes(r.bytes_up), human_bytes(r.bytes_down), human_bytes(r.bytes_total),
                 human_seconds(r.s_per_round),
                 "—" if r.peak_rss_mb is None else f"{r.peak_rss_mb:,.0f} MiB",
                 _fmt_work(r), human_seconds(r.client_s), human_bytes(r.client_peak_bytes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_columns(metric: str, select: str | None = None) -> list[str]:
    """Column names; selecting on validation (``select`` another metric than ``metric``), the
    reported column is ``<metric>[_pct]_at_best_<select>`` instead of ``best_<metric>[_pct]``."""
    pct = "_pct" if is_percent(metric) else ""
    b = f"best_{metric}{pct}" if select in (None, metric) else f"{metric}{pct}_at_best_{select}"
    return ["algorithm", "base_algorithm", "lr", f"{b}_mean", f"{b}_std", "seeds", "reference",
            "rounds_to_reach", "seconds_to_reach", "seeds_reached", "speedup", "bytes_up_per_client",
            "bytes_down_per_client", "bytes_total_per_client", "s_per_round", "peak_rss_mib",
            "bytes_to_reach_per_client", "client_forwards_per_round", "client_backwards_per_round",
            "client_s_per_round", "client_peak_bytes", f"last_{metric}{pct}_mean"]


def to_csv(table: Table) -> str:
    scale = 100.0 if is_percent(table.metric) else 1.0
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_columns(table.metric, table.select))
    for r in table.rows:
        w.writerow([r.name, r.algorithm, repr(r.lr), r.best_mean * scale,
                    "" if r.best_std is None else r.best_std * scale, r.seeds, int(r.is_reference),
                    "" if r.rounds is None else r.rounds, "" if r.seconds is None else r.seconds,
                    r.reach.reached,
                    "" if r.speedup is None else r.speedup, r.bytes_up, r.bytes_down, r.bytes_total,
                    "" if r.s_per_round is None else r.s_per_round,
                    "" if r.peak_rss_mb is None else r.peak_rss_mb,
                    "" if r.bytes_to_reach is None else r.bytes_to_reach,
                    *("" if v is None else v for v in (r.client_forwards, r.client_backwards, r.client_s,
                                                        r.client_peak_bytes)),
                    "" if r.last_mean is None else r.last_mean * scale])
    return buf.getvalue()


def write_table(out: str | Path, table: Table) -> str:
    """Write ``table.md`` (table and footer) and ``table.csv``; returns the markdown."""
    out = Path(out)
    text = to_markdown(table) + "\n\n" + footer(table) + "\n"
    from ..atomic import write_atomic
    write_atomic(out / "table.md", text)
    write_atomic(out / "table.csv", to_csv(table))
    return text
