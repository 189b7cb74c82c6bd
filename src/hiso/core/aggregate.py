"""How the server combines the clients' scalars: mean, median or trimmed mean, per entry.

Each round's answers form an (n, tau, P) array of scalars; a rule reduces it to the (tau, P)
array every replica applies. Robust rules work entry by entry ((k, p) independently): a
scalar is one number, so the check is cheap and a Byzantine client can only move the entries
it sends, within what the rule lets through.

* ``mean``: the weighted mean (``w / w.sum()``; equal weights without ``w``). Not robust: one
  client scaling its scalars by 1e3 moves the mean by ~1e3/n.
* ``median``: the weighted median per entry: sort the n values, and take the value where the
  cumulative weight first reaches half the total; when it lands exactly on half (possible
  only with an even split, e.g. equal weights and even n), the mean of that value and the
  next, so with equal weights it is ``numpy.median``. Robust while the attackers hold less
  than half the weight.
* ``trimmed-mean``: per entry, drop the ``floor(trim * n)`` lowest and the as many highest
  values (by count, whatever their weights: an attacker cannot avoid being trimmed by
  claiming a small weight) and take the weighted mean of the rest; with equal weights it is
  ``scipy.stats.trim_mean(g, trim, axis=0)``. Robust while the attackers are at most
  ``floor(trim * n)`` per round.

* the sign vote (:func:`sign_vote`, FeedSign's): the sign of what the rule gives (under the
  mean, of the weighted *sum*), 0 on an exact tie.

Non-finite scalars never reach a rule: the decoder and :meth:`Server.aggregate` reject them.
"""

from __future__ import annotations

import numpy as np

RULES = ("mean", "median", "trimmed-mean")


def check_rule(rule: str, trim: float = 0.25) -> None:
    """One-line errors for an unknown rule or a trim fraction outside [0, 0.5)."""
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r} (choose from {', '.join(RULES)})")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")


def combine(g: np.ndarray, w: np.ndarray | None = None, rule: str = "mean", trim: float = 0.25) -> np.ndarray:
    """Reduce answers ``g`` (n, ...) with weights ``w`` (n,) (None: equal) by ``rule``,
    entry by entry; float64 in, float64 out. See the module's docstring for the rules."""
    check_rule(rule, trim)
    g = np.asarray(g, dtype=np.float64)
    n = g.shape[0]
    if n == 0:
        raise ValueError("nothing to aggregate")
    w = np.ones(n) if w is None else np.asarray(w, dtype=np.float64)
    if w.shape != (n,) or not np.all(w > 0):
        raise ValueError("weights must be one positive number per answer")
    if rule == "mean":
        return np.tensordot(w / w.sum(), g, axes=1)
    order = np.argsort(g, axis=0, kind="stable")
    vals = np.take_along_axis(g, order, axis=0)
    ws = w[order]  # each value's weight, in the sorted order of its entry
    if rule == "median":
        cum = np.cumsum(ws, axis=0)
        half = cum[-1] / 2
        i = np.argmax(cum >= half, axis=0)[None]  # first index reaching half the weight
        lo = np.take_along_axis(vals, i, axis=0)[0]
        hi = np.take_along_axis(vals, np.minimum(i + 1, n - 1), axis=0)[0]
        exact = np.take_along_axis(cum, i, axis=0)[0] == half
        return np.where(exact, (lo + hi) / 2, lo)
    cut = int(np.floor(trim * n))
    vals, ws = vals[cut:n - cut], ws[cut:n - cut]
    return (vals * ws).sum(axis=0) / ws.sum(axis=0)


def sign_vote(g: np.ndarray, w: np.ndarray | None = None, rule: str = "mean", trim: float = 0.25) -> np.ndarray:
    """The (weighted) majority vote of answers ``g`` (n, ...): float32 -1, 0 or +1 per entry.

    Under the mean it is the sign of the weighted *sum*: exact for equal (or integer) weights, so
    a tie is 0, where the mean's w / w.sum() (1/6, 1/10, ...) can leave +-5e-17 and a step."""
    g = np.asarray(g, dtype=np.float64)
    w = np.ones(len(g)) if w is None else np.asarray(w, dtype=np.float64)
    agg = combine(g, w, rule, trim)  # also checks the rule, the weights and that there are answers
    return np.sign(np.tensordot(w, g, axes=1) if rule == "mean" else agg).astype(np.float32)
