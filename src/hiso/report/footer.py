"""The footer under the comparison table (setup, column definitions, warnings) and a run's own notes.

``run_ending_note`` and ``loss_rise_note`` say of one run (``hiso run``) what ``ending_warnings``
says of an arm in the table; they share its threshold ``KEPT_WARN``."""

from __future__ import annotations

import math
from pathlib import Path

from .labels import _fmt_threshold, display_name, metric_label
from .reach import best_of, first_and_last, first_reach, kept_share
from .table_data import Table


def _privacy_of(runs) -> dict | None:
    """A DP arm's privacy (summary.json): its settings, and the most epsilon any of its seeds spent."""
    priv = [r.summary.get("privacy") for r in runs if r.summary.get("privacy")]
    if not priv:
        return None
    spent = [p for p in priv if p.get("epsilon") is not None]
    most = max(spent, key=lambda p: p["epsilon"]) if spent else {**priv[0], "epsilon": None}
    # a noise solved from dp_epsilon is each seed's own (solved for its sample): name the range
    z = [p["noise_multiplier"] for p in priv if p.get("noise_multiplier") is not None]
    return {**most, "noise_multipliers": (min(z), max(z)) if z else None}


_FAULTS = (("drop_rate", "lost"), ("late_rate", "late"), ("duplicate_rate", "duplicated"), ("corrupt_rate", "damaged"))


def _reliability_of(cfg: dict) -> str:
    """What an arm's config.json says the server and its clients were put through: the aggregation
    rule (when not the mean), its attackers and the faults injected ("" for none of them)."""
    parts = []
    rule = cfg.get("aggregate", "mean")
    if rule != "mean":
        trim, n = cfg.get("trim", 0.25), cfg.get("sampled", 0)
        none = f", which drops none of {n} answers: the plain mean" if math.floor(trim * n) == 0 else ""
        parts.append(f"aggregate {rule}" + (f" (trim {trim:g}{none})" if rule == "trimmed-mean" else ""))
    if k := cfg.get("byzantine", 0):
        attack = cfg.get("attack", "scale")
        scaled = f" x {cfg.get('attack_scale', 1e3):g}" if any(a in attack for a in ("scale", "random")) else ""
        who = "of each round's sampled" if cfg.get("byzantine_per_round") else f"fixed client{'s' if k > 1 else ''}"
        parts.append(f"{k} Byzantine {who} (attack {attack}{scaled})")
    faults = [f"{cfg[key] * 100:g}% {what}" for key, what in _FAULTS if cfg.get(key)]
    if faults:
        parts.append("answers " + ", ".join(faults))
    return "; ".join(parts)


def reliability_lines(table: Table) -> list[str]:
    """Footer lines naming each arm's aggregation rule, attackers and injected faults, once any arm
    has them: a robust arm's row beside a plain one must say what each was put through."""
    if not any(r.reliability for r in table.rows):
        return []
    return [f"- reliability: {display_name(r.name)}: {r.reliability or 'plain mean, no attackers or faults'}."
            for r in table.rows]


def privacy_lines(table: Table) -> list[str]:
    """Footer lines naming each differentially private arm's guarantee (a table of accuracies
    whose arms ran under different privacy must say so)."""
    lines = []
    for r in table.rows:
        p = r.privacy
        if not p:
            continue
        spent = "no epsilon (no delta given)"
        if p.get("epsilon") is not None:
            spent = f"({p['epsilon']:.3g}, {p['delta']:g})-DP over the run"
            if p.get("participations_max") is not None:  # (summaries before the public-sample accounting: none)
                spent += (f" for its most-sampled client ({p['participations_max']} rounds), against a reader who "
                          "knows who took part")
        lo, hi = p.get("noise_multipliers") or (p["noise_multiplier"],) * 2
        z = f"{lo:.4g}" if lo == hi else f"{lo:.4g}-{hi:.4g} (solved per seed)"
        lines.append(f"- privacy: {display_name(r.name)} ran with {p['mode']} differential privacy: scalars clipped "
                     f"at {p['clip']:g}, noise multiplier {z}; {spent}.")
    return lines


def selection_lines(table: Table) -> list[str]:
    """The footer's lines on what lr and the reported round were selected on."""
    c, lab = table.context, metric_label(table.metric)
    better = "highest" if table.higher else "lowest"
    spread = ("mean ± sample std over seeds" if len(c.get("seeds") or []) > 1 else
              "1 seed: no spread (give more seeds, e.g. --seeds 0,1,2, for mean ± std)")
    if table.on_test:
        note = f" ({table.select_note})" if table.select_note else ""
        return [
            f"- selected on test: lr and each run's reported round are chosen on the very examples "
            f"reported, so the numbers are optimistic{note}.",
            f"- lr: chosen per algorithm from its grid by the best mean over seeds of the runs' best {lab} "
            "(selection.json lists the grid).",
            f"- best {lab}: the {better} {lab} over a run's evaluated rounds; {spread}."]
    vlab = metric_label(table.select)
    n_val = f" ({c['n_val']:,} held-out examples, apart from the {c['n_eval']:,} reported)" if (
        c.get("n_val") and c.get("n_eval")) else ""
    return [
        f"- selected on validation{n_val}: lr, each run's reported round and the rounds to reach are "
        f"chosen on {vlab}; {lab} is measured on the other held-out examples and only reported.",
        f"- lr: chosen per algorithm from its grid by the best mean over seeds of the runs' best {vlab} "
        "(selection.json lists the grid).",
        f"- {lab} at best {vlab} round: a run's {lab} at its first evaluated round with its {better} "
        f"{vlab}; {spread}."]


def _rounds_text(c: dict) -> str:
    """"N rounds", or for a table of runs as they stood at an earlier round (``--at-round``) what
    that leaves out."""
    if not c.get("planned_rounds"):
        return f"{c.get('rounds')} rounds"
    return (f"the runs as they stood at round {c.get('rounds')} of the {c.get('planned_rounds')} planned "
            "(runs still going cut there: their bytes, times and work up to that round; peak memory only "
            "of finished runs)")


def _other_grids(c: dict) -> str:
    """The arms evaluated every other number of rounds, or run to another horizon, than the reference."""
    parts = [f"{display_name(name)} every {every} rounds over {rounds}"
             for name, (every, rounds) in (c.get("other_grids") or {}).items()]
    return f" ({'; '.join(parts)})" if parts else ""


def footer(table: Table) -> str:
    c, m = table.context, table.metric
    ref = display_name(table.reference)
    sel = metric_label(table.select)
    seeds = c.get("seeds") or []
    n_eval = f" on {c['n_eval']:,} held-out examples" if c.get("n_eval") else ""
    cmp_word = "≥" if table.higher else "≤"
    best = "best" if table.on_test else f"best {sel}"
    own = "its own best" if table.on_test else "its selected round"
    return "\n".join([
        f"Task {c.get('task')}: {c.get('clients')} clients, {c.get('sampled')} sampled per round, "
        f"{_rounds_text(c)}, evaluated every {c.get('eval_every')} rounds{_other_grids(c)}{n_eval}; "
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))}).",
        *selection_lines(table),
        f"- rounds to {ref}'s {best}: per seed the first evaluated round with {sel} {cmp_word} "
        f"{_fmt_threshold(table.threshold, m)} ({ref}'s mean best {sel}), mean over seeds; "
        f"'—' if some seed never reaches it. {ref}'s own row: rounds to {own} (per seed, mean"
        + ("" if table.on_test else f"; where it attains its own best {sel}") + ").",
        f"- time to {ref}'s {best}: the same, in seconds of training (wall_s at that round; evaluation "
        "excluded), mean over seeds; it depends on the machine and on the runs beside it (--jobs).",
        f"- bytes / client to {ref}'s {best}: the same, in bytes: the federation's uplink + downlink "
        "bytes up to that round / clients, mean over seeds (arms of different bytes per round compare here).",
        f"- speed-up: {ref}'s rounds to {own} / this row's rounds to reach it "
        f"(resolution: {c.get('eval_every')} rounds" + (", each arm its own evaluation grid" if c.get("other_grids")
                                                         else "") + ").",
        "- communication: bytes per client over the whole run (mean over all clients, then seeds); "
        "decimal units (1 KB = 1000 B).",
        "- s / round: training wall time per round (evaluation excluded), mean over seeds; "
        "peak memory: the process's peak resident memory during the run, max over seeds.",
        "- client fwd + bwd / round: forwards (model evaluations on a minibatch) + backpropagations one "
        "sampled client computes per round; client s / round: its measured seconds for them (mean over seeds); "
        "client peak memory: its resident tensors (model, H, ...) + the peak of the tensors one answer allocates, "
        "max over seeds, without the client's data and the Python/torch runtime (hiso.runners.client_cost).",
        *privacy_lines(table),
        *reliability_lines(table),
        *lr_warnings(table),
        *ending_warnings(table),
    ])


KEPT_WARN = 0.75  # warn when the runs end holding less than this share of their reported gain


def ending_warnings(table: Table) -> list[str]:
    """Footer lines for arms whose runs ended well below what the table reports for them."""
    lines = []
    higher = table.higher
    for r in table.rows:
        if r.kept is None and r.first_mean is not None and r.last_mean is not None and \
                (r.last_mean < r.first_mean if higher else r.last_mean > r.first_mean):
            lines.append(f"- warning: {display_name(r.name)} ended worse than it started: {metric_label(table.metric)} "
                         f"{_fmt_threshold(r.last_mean, table.metric)} at the last evaluation against "
                         f"{_fmt_threshold(r.first_mean, table.metric)} at round 0 (means over seeds), with "
                         f"{_fmt_threshold(r.best_mean, table.metric)} reported: the lr is too large for it.")
            continue
        if r.kept is None or r.kept >= KEPT_WARN or r.last_mean is None:
            continue
        lines.append(f"- warning: {display_name(r.name)} ended below what it reports: {metric_label(table.metric)} "
                     f"{_fmt_threshold(r.last_mean, table.metric)} at the last evaluation against "
                     f"{_fmt_threshold(r.best_mean, table.metric)} reported (mean over seeds), {1 - r.kept:.0%} of its "
                     "gain since round 0 lost after the reported round: the final model is not the reported one "
                     "(hiso export RUN --round R --out DIR rebuilds that round's); a smaller lr or --lr-decay for "
                     "runs that hold their best.")
    return lines


def run_ending_note(rows: list[dict], metric: str, higher: bool, rebuild_from: str | Path | None = None) -> str | None:
    """One line for a single run that ended below its best evaluation (less than ``KEPT_WARN``
    of its gain from round 0 kept), naming the best round and, for a run with a log
    (``rebuild_from``: its directory), how to get that round's model; else None."""
    first, last = first_and_last(rows, metric)
    best = best_of(rows, metric, higher)
    kept = kept_share(first, best, last, higher)
    if kept is None or kept >= KEPT_WARN:
        return None
    at = first_reach(rows, metric, best, higher)
    how = f"hiso export {rebuild_from} --round {at} --out DIR rebuilds that one; " if rebuild_from else ""
    return (f"note: {metric} ended at {last:.4g}, below its best {best:.4g} at round {at} ({1 - kept:.0%} of its "
            f"gain lost): the last model is not the best one ({how}a smaller lr or --lr-decay for runs that "
            "hold their best)")


RISE_WARN = 1.5  # say so during a run when an evaluation's loss reaches this times round 0's


def smaller_lr(lr: float | None, chosen: float | None) -> str:
    """What to try for an lr too large: ``chosen`` (the lr the project's grids chose for the
    method on the task, its default) when ``lr`` is above it, else a smaller lr."""
    if lr is not None and chosen is not None and lr > chosen:
        return f"try --lr {chosen:g}, the one the project's lr grids chose and the default without --lr, or --lr-decay"
    return "a smaller --lr, or --lr-decay"


def loss_rise_note(first_loss: float | None, row: dict, lr: float | None, chosen: float | None = None) -> str | None:
    """One line, the first time a run's held-out loss climbs to ``RISE_WARN`` x its round-0 value
    (None otherwise). Of the 153 runs measured for docs/results.md (README), the 16 that crossed it all
    ended far below their best (an lr too large for the model, e.g. Gemma-3 LoRA at SmolLM2's 1e-2,
    or for the horizon); none that held its best crossed it. Said while the run can still be stopped.
    ``chosen``: the task's default lr for the method (:func:`smaller_lr`)."""
    loss = row.get("eval_loss")
    if first_loss is None or loss is None or not first_loss > 0 or loss < RISE_WARN * first_loss:
        return None
    what = f"the lr ({lr:g})" if lr is not None else "the lr"
    return (f"note: eval_loss {loss:.4g} at round {row['round']} is {loss / first_loss:.1f}x round 0's "
            f"({first_loss:.4g}): runs whose held-out loss rose this far ended well below their best; {what} is "
            f"likely too large for this model or horizon ({smaller_lr(lr, chosen)}). The run goes on")


def lr_warnings(table: Table) -> list[str]:
    """Footer lines for lrs that may not be the best: chosen at an end of a grid of two or more
    (the optimum may lie outside it), or not tuned at all (a one-point grid)."""
    lines, untuned = [], []
    for r in table.rows:
        grid = sorted(r.lr_grid)
        if len(grid) == 1:
            untuned.append(display_name(r.name))
        elif len(grid) > 1 and r.lr in (grid[0], grid[-1]):
            end, side = ("smallest", "below") if r.lr == grid[0] else ("largest", "above")
            lines.append(f"- warning: {display_name(r.name)}'s lr {r.lr:g} is the {end} of its grid "
                         f"({', '.join(f'{x:g}' for x in grid)}): the best lr may lie {side} it; extend the grid.")
    if untuned:
        lines.append(f"- lr not tuned (a one-point grid) for {', '.join(untuned)}.")
    return lines
