"""The comparison's figures (PNG, drawn with matplotlib's object API: no pyplot, no GUI backend).

Every arm is drawn at its chosen lr, one colour per arm throughout. Curves are the mean over
seeds with a band from the seeds' min to max, aligned by round: a point at round r is drawn at x
= the mean over seeds of the x quantity at round r (per-client bytes, wall time).

* ``curves_rounds.png``: eval metric (left) and train loss (right) vs rounds.
* ``curves_comm.png``: the same vs communication per client (uplink + downlink, mean over the
  clients, cumulative; log x axis, decimal units) -- scalar-only methods move KB where
  full-model methods move MB to GB.
* ``curves_time.png``: the same vs training wall time (evaluation excluded).
* ``h_hist.png`` (when some arm runs HiSo): the distribution of the learned diagonal
  preconditioner H at the end of the run (all coordinates of all tensors, pooled over seeds),
  on bins equally spaced in log10(H), a log x axis and a dashed line at H_0 = 1.
* ``lr_sweep.png`` (when some arm has more than one lr): each lr's best eval metric, mean over
  seeds with min-max bars; the chosen lr is starred.

The eval panels draw the reference arm's mean best as a dashed horizontal line (the threshold
of "rounds to reach" in the table). Selected on validation, they draw no line (the threshold
is a validation value) but mark each arm's reported point: the mean over seeds of the eval
metric and of x at each run's round of best validation metric; ``lr_sweep.png`` then shows the
validation metric the lr was chosen by. The train loss is the participants' mean loss of each
round, smoothed by a trailing moving average (window shown in the panel title) before the
seeds are combined.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .table import (ArmResult, Table, best_of, display_name, higher_is_better, human_bytes,
                    is_percent, metric_label, selected_row)

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _by_round(rows: list[dict]) -> dict[int, dict]:
    return {int(r["round"]): r for r in rows}


def _smooth(y: np.ndarray, w: int) -> np.ndarray:
    """Trailing moving average over ``w`` points (shorter at the start)."""
    if w <= 1:
        return y
    c = np.cumsum(np.insert(np.nan_to_num(y, nan=0.0), 0, 0.0))
    n = np.isfinite(y).astype(float)
    cn = np.cumsum(np.insert(n, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - w, 0)
    cnt = cn[idx] - cn[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (c[idx] - c[lo]) / cnt, np.nan)


def series(arm: ArmResult, key: str, smooth: int = 1) -> dict[str, np.ndarray] | None:
    """``key`` on the rounds every seed has it: rounds, per-seed values, and per-round x quantities.

    Returns ``{"round", "y" (seeds x rounds), "comm" (mean per-client bytes), "time" (mean wall s)}``.
    """
    maps = [_by_round(r.rows) for r in arm.runs]
    rounds = sorted(set.intersection(*[{k for k, row in m.items() if row.get(key) is not None} for m in maps]))
    if not rounds:
        return None
    y = np.array([[float(m[k][key]) for k in rounds] for m in maps])
    if smooth > 1:
        y = np.stack([_smooth(v, smooth) for v in y])
    comm = np.array([[(m[k]["bytes_up"] + m[k]["bytes_down"]) / r.clients for k in rounds]
                     for m, r in zip(maps, arm.runs)]).mean(0)
    time = np.array([[m[k]["wall_s"] for k in rounds] for m in maps]).mean(0)
    return {"round": np.array(rounds), "y": y, "comm": comm, "time": time}


def _band(ax, x, y, color, label):
    with np.errstate(all="ignore"):
        mean, lo, hi = np.nanmean(y, 0), np.nanmin(y, 0), np.nanmax(y, 0)
    ax.plot(x, mean, color=color, lw=1.6, label=label)
    if y.shape[0] > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)


def _wants_log(values: list[np.ndarray]) -> bool:
    v = np.concatenate([a.ravel() for a in values]) if values else np.array([])
    v = v[np.isfinite(v)]
    return v.size > 0 and v.min() > 0 and v.max() / v.min() > 100


def _log_labels(axis, fmt=lambda v: f"{v:g}") -> None:
    """Plain tick labels on a log axis (0.6, 2, 10 KB; not 6 x 10^-1); when the axis spans
    less than two decades, the 2x, 3x and 5x minor ticks are labelled too. Call after plotting."""
    ax = axis.axes
    lo, hi = sorted(ax.get_xlim() if axis is ax.xaxis else ax.get_ylim())  # autoscaled limits
    axis.set_major_locator(LogLocator(base=10))
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    if lo > 0 and hi / lo < 100:
        axis.set_minor_formatter(FuncFormatter(lambda v, _: fmt(v) if f"{v:.1e}"[0] in "235" else ""))
    else:
        axis.set_minor_formatter(NullFormatter())


def _log_y(ax) -> None:
    ax.set_yscale("log")
    _log_labels(ax.yaxis)


def _bytes_axis(ax) -> None:
    ax.set_xscale("log")
    _log_labels(ax.xaxis, human_bytes)


X_LABELS = {"round": "communication round",
            "comm": "communication per client, up + down (bytes, log scale)",
            "time": "training wall time (s, evaluation excluded)"}
X_TITLES = {"round": "rounds", "comm": "communication", "time": "wall time"}
CURVE_FILES = {"round": "curves_rounds.png", "comm": "curves_comm.png", "time": "curves_time.png"}


def _selected_point(run, metric: str, select: str, xkind: str) -> tuple[float, float] | None:
    """(x, ``metric``) of a run at its round of best ``select`` (None if it has none)."""
    r = selected_row(run.rows, metric, select, higher_is_better(select, run.config.get("task")))
    if r is None:
        return None
    x = {"round": lambda: r["round"], "time": lambda: r["wall_s"],
         "comm": lambda: (r["bytes_up"] + r["bytes_down"]) / run.clients}[xkind]()
    return float(x), float(r[metric])


def plot_curves(arms: list[ArmResult], out: str | Path, metric: str, xkind: str,
                threshold: float | None = None, reference: str | None = None,
                title: str = "", select: str | None = None) -> Path:
    """Eval metric (left) and smoothed train loss (right) vs ``xkind`` (round, comm, time).
    ``select`` another metric than ``metric`` (selection on validation): no threshold line
    (it is a validation value); each arm's reported point is marked instead."""
    pct = 100.0 if is_percent(metric) else 1.0
    rounds = max(int(r.config.get("rounds", 1)) for a in arms for r in a.runs)
    w = max(1, rounds // 30)
    fig = Figure(figsize=(12, 4.6), dpi=110, layout="constrained")
    ax_e, ax_t = fig.subplots(1, 2)
    evals, trains = [], []
    drawn = {ax_e: False, ax_t: False}  # whether an axis got any point (a log axis needs one)
    for i, arm in enumerate(arms):
        label = f"{display_name(arm.name)} (lr {arm.lr:g})"
        for ax, key, sm, store in ((ax_e, metric, 1, evals), (ax_t, "train_loss", w, trains)):
            s = series(arm, key, sm)
            if s is None:
                continue
            x, y = s[xkind].astype(float), s["y"] * (pct if key == metric else 1.0)
            if xkind == "comm":  # log axis: round 0 (no bytes yet) has no place on it
                keep = x > 0
                x, y = x[keep], y[:, keep]
            store.append(y)
            drawn[ax] = drawn[ax] or x.size > 0
            _band(ax, x, y, _color(i), label)
    if select and select != metric:  # selected on validation: mark what the table reports
        for i, arm in enumerate(arms):
            pts = [_selected_point(r, metric, select, xkind) for r in arm.runs]
            pts = [p for p in pts if p is not None and (xkind != "comm" or p[0] > 0)]
            if pts:
                ax_e.plot([np.mean([p[0] for p in pts])], [np.mean([p[1] for p in pts]) * pct], marker="D", ms=7,
                          color=_color(i), markeredgecolor="black", ls="none")
        ax_e.plot([], [], marker="D", ms=7, color="white", markeredgecolor="black", ls="none",
                  label=f"reported: at the round of best {metric_label(select)} (mean over seeds)")
    elif threshold is not None and math.isfinite(threshold) and reference is not None:
        ax_e.axhline(threshold * pct, color="0.35", ls="--", lw=1,
                     label=f"{display_name(reference)}'s best (mean over seeds)")
    unit = " (%)" if pct != 1.0 else ""
    ax_e.set_ylabel(metric_label(metric) + unit)
    ax_e.set_title(f"{metric_label(metric)} vs {X_TITLES[xkind]}")
    ax_t.set_ylabel("train loss")
    ax_t.set_title(f"train loss (participants' mean, moving average over {w} round{'s' if w > 1 else ''})"
                   if w > 1 else "train loss (participants' mean)")
    if metric == "gap" or _wants_log(evals):
        _log_y(ax_e)
    if _wants_log(trains):
        _log_y(ax_t)
    for ax in (ax_e, ax_t):
        ax.set_xlabel(X_LABELS[xkind])
        if xkind == "comm" and drawn[ax]:  # (none: only round 0 evaluated yet, in a table --at-round)
            _bytes_axis(ax)
        ax.grid(True, which="major", alpha=0.3)
    if evals or trains:
        ax_e.legend(loc="best", fontsize=9, framealpha=0.9)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(out) / CURVE_FILES[xkind]
    fig.savefig(path)
    return path


def load_h(run_dir: Path) -> np.ndarray | None:
    """All entries of the final H of a HiSo run (``model.pt``'s ``"h"``), flattened; None if absent."""
    import torch

    p = Path(run_dir) / "model.pt"
    if not p.is_file():
        return None
    state = torch.load(p, map_location="cpu", weights_only=True)
    h = state.get("h")
    if not h:
        return None
    return np.concatenate([t.detach().double().flatten().numpy() for t in h.values()])


def plot_h_hist(arms: list[ArmResult], out: str | Path, bins: int = 60, title: str = "") -> Path | None:
    """Histogram of the learned H per HiSo arm, bins equally spaced in log10(H); None if no HiSo arm."""
    data = []
    for i, arm in enumerate(arms):
        if not _has_h(arm.algorithm):
            continue
        # (a run read as it stood at an earlier round has no H of that round on disk)
        hs = [h for h in (load_h(r.dir) for r in arm.runs if not r.cut) if h is not None]
        if hs:
            v = np.concatenate(hs)
            data.append((i, arm, v[np.isfinite(v) & (v > 0)], len(hs[0]), len(hs)))
    if not data:
        return None
    allv = np.concatenate([d[2] for d in data])
    lo, hi = np.log10(allv.min()), np.log10(allv.max())
    lo, hi = min(lo, 0.0), max(hi, 0.0)  # keep H_0 = 1 in view
    if hi - lo < 1e-6:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.logspace(lo, hi, bins + 1)
    fig = Figure(figsize=(7.5, 4.6), dpi=110, layout="constrained")
    ax = fig.subplots()
    for i, arm, v, d, n in data:
        wts = np.full(v.shape, 100.0 / v.size)
        med = float(np.median(v))
        lab = f"{display_name(arm.name)} (lr {arm.lr:g}): median {med:.2g}"
        ax.hist(v, bins=edges, weights=wts, histtype="stepfilled", alpha=0.25, color=_color(i))
        ax.hist(v, bins=edges, weights=wts, histtype="step", lw=1.5, color=_color(i), label=lab)
    ax.axvline(1.0, color="0.35", ls="--", lw=1, label="$H_0 = 1$ (initial value)")
    ax.set_xscale("log")
    _log_labels(ax.xaxis)
    ax.set_xlabel("H (diagonal preconditioner entry, log scale)")
    ax.set_ylabel("share of coordinates (%)")
    rounds = data[0][1].runs[0].config.get("rounds")
    d, n = data[0][3], data[0][4]
    ax.set_title(f"learned preconditioner H after {rounds} rounds\n"
                 f"({d:,} coordinates per model, pooled over {n} seed{'s' if n > 1 else ''}; "
                 f"bins equal in log10 H)", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(out) / "h_hist.png"
    fig.savefig(path)
    return path


def plot_lr_sweep(arms: list[ArmResult], out: str | Path, metric: str, title: str = "") -> Path | None:
    """Each lr's best metric (mean over seeds, min-max bars); the chosen lr starred."""
    if not any(len(a.grid) > 1 for a in arms):
        return None
    pct = 100.0 if is_percent(metric) else 1.0
    fig = Figure(figsize=(7.5, 4.6), dpi=110, layout="constrained")
    ax = fig.subplots()
    allv = []
    for i, arm in enumerate(arms):
        lrs = sorted(arm.grid)
        vals = [np.array(arm.grid[lr], dtype=float) * pct for lr in lrs]
        fin = [v[np.isfinite(v)] for v in vals]
        keep = [j for j, v in enumerate(fin) if v.size]
        x = np.array([lrs[j] for j in keep])
        m = np.array([fin[j].mean() for j in keep])
        lo = m - np.array([fin[j].min() for j in keep])
        hi = np.array([fin[j].max() for j in keep]) - m
        allv.append(m)
        ax.errorbar(x, m, yerr=[lo, hi], color=_color(i), marker="o", ms=5, lw=1.4, capsize=3,
                    label=display_name(arm.name))
        if arm.lr in arm.grid and np.isfinite(np.nanmean(np.array(arm.grid[arm.lr], dtype=float))):
            ax.plot([arm.lr], [np.nanmean(arm.grid[arm.lr]) * pct], marker="*", ms=16, color=_color(i),
                    markeredgecolor="black", ls="none")
        bad = [lrs[j] for j, v in enumerate(fin) if not v.size]
        for lr in bad:
            ax.annotate("NaN", (lr, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                        color=_color(i), fontsize=8)
    ax.plot([], [], marker="*", ms=12, color="white", markeredgecolor="black", ls="none", label="chosen lr")
    ax.set_xscale("log")
    ticks = sorted({lr for a in arms for lr in a.grid})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if metric == "gap" or _wants_log(allv):
        _log_y(ax)
    ax.set_xlabel("learning rate (log scale)")
    better = "highest" if higher_is_better(metric, arms[0].runs[0].config.get("task")) else "lowest"
    ax.set_ylabel(f"best {metric_label(metric)}" + (" (%)" if pct != 1.0 else ""))
    ax.set_title(f"lr grid: each run's {better} {metric_label(metric)}\n(mean over seeds, bars: min–max)",
                 fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(out) / "lr_sweep.png"
    fig.savefig(path)
    return path


def _setup_title(arms: list[ArmResult], wrap: bool = False, band: bool = True) -> str:
    """The setup in one line (``wrap``: the seeds on a second line)."""
    c = arms[0].runs[0].config
    n = len(arms[0].runs)
    bits = [str(c.get("task"))]
    if c.get("task") == "quadratic":
        bits.append(f"d = {c.get('dim')}")
    bits.append(f"{c.get('clients')} clients, {c.get('sampled')} per round")
    at = f"round {c.get('rounds')} of {c.get('planned_rounds')}" if c.get("planned_rounds") else f"{c.get('rounds')} rounds"
    # P, tau and the horizon only where every arm shares them (variants may set their own)
    shared = [f"{name} = {c.get(key)}" for name, key in (("P", "perturbations"), ("τ", "local_steps"))
              if all(a.runs[0].config.get(key) == c.get(key) for a in arms)]
    same_rounds = all(a.runs[0].config.get("rounds") == c.get("rounds") for a in arms)
    bits.append(", ".join(shared + ([at] if same_rounds else [])) or "arms of their own P, τ and rounds")
    seeds = f"mean over {n} seed{'s' if n > 1 else ''}" + (", band: min–max over seeds" if band and n > 1 else "")
    return ", ".join(bits) + ("\n" if wrap else " — ") + seeds


def plot_all(arms: list[ArmResult], out: str | Path, metric: str, reference: str,
             table: Table | None = None) -> list[Path]:
    """Every figure of the comparison into ``out``; returns the files written. Selected on
    validation (``table.select``), the lr sweep shows the validation metric lr was chosen by."""
    higher = higher_is_better(metric, arms[0].runs[0].config.get("task"))
    ref = next(a for a in arms if a.name == reference)
    threshold = table.threshold if table is not None else float(
        np.mean([best_of(r.rows, metric, higher) for r in ref.runs]))
    select = table.select if table is not None else metric
    title = _setup_title(arms)
    paths = [plot_curves(arms, out, metric, k, threshold, reference, title, select) for k in ("round", "comm", "time")]
    short = _setup_title(arms, wrap=True, band=False).split("\n")[0]
    for p in (plot_h_hist(arms, out, title=short), plot_lr_sweep(arms, out, select, title=short)):
        if p is not None:
            paths.append(p)
    return paths


def _has_h(algorithm: str) -> bool:
    """Whether the method learns HiSo's preconditioner H (its registry entry)."""
    from ..methods.registry import method_info
    try:
        return "preconditioner" in method_info(algorithm).can
    except (ValueError, ImportError):
        return False
