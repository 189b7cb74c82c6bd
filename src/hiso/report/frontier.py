"""The frontier: what each arm spends to reach a target, and which arms no other one beats.

``hiso compare`` writes ``DIR/frontier.md``, ``DIR/frontier.csv`` and ``DIR/frontier.png``
beside the table (:mod:`hiso.report.table`). For each target, the reference's best (the table's
T) and, when given, the user's ``--target`` (in the metric's own units: 0.80 is 80 % accuracy),
each arm's cost to reach it on four axes, all per client and lower is better:

* **rounds**: the first evaluated round whose (selection) metric reaches the target, mean over
  seeds (every seed must reach it; the table's rule, :func:`hiso.report.reach.rounds_to_reach`;
  to the reference's best, the reference's own row is its rounds to its own best, as in the table);
* **bytes / client**: the federation's cumulative uplink + downlink bytes at that round over
  the number of clients (the encoded messages' lengths: the table's "bytes to reach");
* **client forward-equivalents**: a client's forwards plus *two* per backpropagation (the
  field's convention: a backward pass costs about two forwards) per round it answers, times the
  rounds to reach, times the share of clients a round samples (m / M): the compute an average
  client spends to get there;
* **client peak memory**: the resident + transient peak of one client's answer (max over seeds;
  it does not depend on the target); where an arm's runs held the frozen base in another dtype
  (``--base-dtype``), each arm's memory names its base (``167 MB (int4 base)``): the same method
  at another base dtype is another client.

Each arm is also marked by the work its clients do: **forwards only** (zeroth-order clients, the
memory of inference) or **backprop** (first-order clients), from the measured backpropagations.

An arm that reaches the target is **Pareto-optimal** (marked ``*``) when no other arm that
reaches it is at least as good on every axis and better on one. An axis that some reaching arm
lacks (runs without client measurements, older runs) is left out of the comparison for all,
and the footer names the axes used. Arms that do not reach the target have no cost and are
never on the frontier.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from .labels import _fmt_rounds, _fmt_threshold, display_name, human_bytes
from .reach import rounds_to_reach

BACKWARD_FORWARDS = 2  # a backpropagation counted as two forwards
AXES = ("rounds", "bytes", "forward_eq", "peak_bytes")
AXIS_LABEL = {"rounds": "rounds", "bytes": "bytes / client", "forward_eq": "client forward-equivalents",
              "peak_bytes": "client peak memory"}


def forward_equivalents(forwards: float | None, backwards: float | None) -> float | None:
    """Forwards + 2 x backpropagations (None where the forwards are not known)."""
    if forwards is None:
        return None
    return forwards + BACKWARD_FORWARDS * (backwards or 0.0)


@dataclass
class Cost:
    """One arm's cost to reach one target (None: not reached, or not measured)."""

    name: str
    reached: int  # seeds that reached it
    seeds: int
    rounds: float | None
    bytes: float | None
    forward_eq: float | None
    peak_bytes: float | None
    pareto: bool = False
    forwards_only: bool | None = None  # no backpropagation on a client (None: not measured)
    base_dtype: str | None = None  # the runs' --base-dtype (None: runs before it, a float32 base)

    def axis(self, a: str) -> float | None:
        return getattr(self, a)


@dataclass
class Frontier:
    label: str  # "DeComFL's best (91.2 %)" or "target 80 %"
    threshold: float
    costs: list[Cost]
    axes: tuple[str, ...] = field(default=())


def dominates(a: Cost, b: Cost, axes) -> bool:
    """Whether ``a`` is at least as good as ``b`` on every axis and better on one."""
    va, vb = [a.axis(x) for x in axes], [b.axis(x) for x in axes]
    return all(x <= y for x, y in zip(va, vb)) and any(x < y for x, y in zip(va, vb))


def mark_pareto(costs: list[Cost]) -> tuple[str, ...]:
    """Set ``pareto`` on the reaching arms no other reaching arm dominates; returns the axes used
    (those every reaching arm has)."""
    live = [c for c in costs if c.rounds is not None]
    axes = tuple(a for a in AXES if live and all(c.axis(a) is not None for c in live))
    for c in costs:
        c.pareto = c in live and not any(dominates(o, c, axes) for o in live if o is not c)
    return axes


def _per_client_bytes(rows: list[dict], rnd: int | None, clients: int | None) -> float | None:
    if rnd is None or not clients:
        return None
    for r in rows:
        if r.get("round") == rnd and "bytes_up" in r and "bytes_down" in r:
            return (float(r["bytes_up"]) + float(r["bytes_down"])) / clients
    return None


def cost_of(row, runs, select: str, threshold: float, higher: bool, reach=None) -> Cost:
    """``row`` (a :class:`~hiso.report.table.TableRow`) and its arm's ``runs``: its cost to reach
    ``threshold`` on ``select`` (``reach``: the seeds' rounds, when already known)."""
    reach = reach or rounds_to_reach([r.rows for r in runs], select, threshold, higher)
    rounds = reach.mean
    nbytes = [_per_client_bytes(r.rows, rnd, r.config.get("clients")) for r, rnd in zip(runs, reach.per_seed)]
    fe_round = forward_equivalents(row.client_forwards, row.client_backwards)
    cfg = runs[0].config
    share = (cfg.get("sampled") or 0) / (cfg.get("clients") or 1)
    return Cost(row.name, reach.reached, reach.n, rounds,
                None if rounds is None or any(b is None for b in nbytes) else mean(nbytes),
                None if rounds is None or fe_round is None else fe_round * rounds * share,
                row.client_peak_bytes,
                forwards_only=None if row.client_forwards is None else not row.client_backwards,
                base_dtype=cfg.get("base_dtype"))


def frontiers(table, arms, target: float | None = None) -> list[Frontier]:
    """The reference's best and, if given, ``target``: each arm's cost and the Pareto marks."""
    by_name = {a.name: a for a in arms}
    ref = display_name(table.reference)
    best = "best" if table.on_test else f"best {table.select}"
    out = []
    goals = [(f"{ref}'s {best} ({_fmt_threshold(table.threshold, table.metric)})", table.threshold)]
    if target is not None:
        goals.append((f"target {_fmt_threshold(target, table.metric)}", target))
    for i, (label, thr) in enumerate(goals):
        costs = []
        for row in table.rows:
            # to T, the table's own reach (the reference's: each seed to its own best)
            reach = row.reach if i == 0 else None
            costs.append(cost_of(row, by_name[row.name].runs, table.select, thr, table.higher, reach))
        out.append(Frontier(label, thr, costs, mark_pareto(costs)))
    return out


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "—"
    if kind == "bytes" or kind == "peak_bytes":
        return human_bytes(v)
    if kind == "rounds":
        return _fmt_rounds(v)
    return f"{v:,.4g}"


def _work(c: Cost) -> str:
    return {True: "forwards only", False: "backprop", None: "—"}[c.forwards_only]


def _memory(c: Cost, by_dtype: bool) -> str:
    cell = _fmt(c.peak_bytes, "peak_bytes")
    return f"{cell} ({c.base_dtype or 'float32'} base)" if by_dtype and c.peak_bytes is not None else cell


def to_markdown(fronts: list[Frontier]) -> str:
    parts = []
    for f in fronts:
        by_dtype = any(c.base_dtype not in (None, "float32") for c in f.costs)
        lines = [f"**To {f.label}** (per client; `*`: Pareto-optimal)", "",
                 "| algorithm | client | Pareto | " + " | ".join(AXIS_LABEL[a] for a in AXES) + " |",
                 "|---|---|:---:|" + "---:|" * len(AXES)]
        for c in f.costs:
            cells = [_memory(c, by_dtype) if a == "peak_bytes" else _fmt(c.axis(a), a) for a in AXES]
            if c.rounds is None:
                cells[0] = "not reached" if c.reached == 0 else f"— ({c.reached}/{c.seeds} seeds)"
            lines.append(f"| {display_name(c.name)} | {_work(c)} | {'*' if c.pareto else ''} | "
                         + " | ".join(cells) + " |")
        axes = ", ".join(AXIS_LABEL[a] for a in f.axes) or "none (no arm reached it)"
        lines += ["", f"Pareto over: {axes}."]
        parts.append("\n".join(lines))
    note = ("Forward-equivalents count a backpropagation as two forwards (the field's convention) and are a "
            "client's per answered round times the rounds to reach times the share of clients sampled a round; "
            "bytes are the encoded messages (up + down) per client at that round; an arm that does not reach the "
            "target is not on the frontier. Client: forwards only (no backpropagation: a client needs inference "
            "memory) or backprop.")
    return "\n\n".join(parts + [note]) + "\n"


def to_csv(fronts: list[Frontier]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["target", "threshold", "algorithm", "pareto", "seeds_reached", "rounds", "bytes_per_client",
                "client_forward_equivalents", "client_peak_bytes", "forwards_only", "base_dtype"])
    for f in fronts:
        for c in f.costs:
            w.writerow([f.label, repr(f.threshold), c.name, int(c.pareto), c.reached,
                        *("" if v is None else v for v in (c.rounds, c.bytes, c.forward_eq, c.peak_bytes)),
                        "" if c.forwards_only is None else int(c.forwards_only), c.base_dtype or ""])
    return buf.getvalue()


def write_frontier(out: str | Path, fronts: list[Frontier], plot: bool = True) -> str:
    """``frontier.md``, ``frontier.csv`` and (``plot``) ``frontier.png``; returns the markdown."""
    out = Path(out)
    text = to_markdown(fronts)
    (out / "frontier.md").write_text(text)
    (out / "frontier.csv").write_text(to_csv(fronts))
    if plot:
        plot_frontier(fronts, out / "frontier.png")
    return text


def plot_frontier(fronts: list[Frontier], path: Path) -> None:
    """One row per target: rounds against bytes / client, and rounds against client
    forward-equivalents (log axes); Pareto-optimal arms filled and starred, the others hollow;
    forwards-only arms' names end in "(fwd only)"."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(len(fronts), 2, figsize=(11, 4.2 * len(fronts)), squeeze=False)
    for i, f in enumerate(fronts):
        for j, (axis, xlabel) in enumerate((("bytes", "bytes / client to reach (up + down)"),
                                            ("forward_eq", "client forward-equivalents to reach (bwd = 2 fwd)"))):
            ax = axs[i][j]
            pts = [c for c in f.costs if c.rounds is not None and c.axis(axis) is not None]
            for c in pts:
                x, y = c.axis(axis), c.rounds
                if c.pareto:
                    ax.scatter([x], [y], marker="*", s=180, color="C3", zorder=3)
                else:
                    ax.scatter([x], [y], marker="o", s=60, facecolors="none", edgecolors="C0")
                name = display_name(c.name) + (" (fwd only)" if c.forwards_only else "")
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
            if pts and all(c.axis(axis) > 0 for c in pts):
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded 2x10^1 labels
            ax.set_xlabel(xlabel)
            ax.set_ylabel("rounds to reach")
            missed = [display_name(c.name) for c in f.costs if c.rounds is None]
            ax.set_title(f"to {f.label}" + ("" if pts else ": no arm reached it")
                         + (f" (not reached: {', '.join(missed)})" if missed and pts else ""), fontsize=9)
            ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
