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

A method may combine the answers its own way over these rules (its ``combine`` hook: FeedSign's
majority vote, :func:`hiso.methods.feedsign.sign_vote`).

Non-finite scalars never reach a rule: the decoder and :meth:`Server.aggregate` reject them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

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


# ------------------------------------------------------------- the server's combine, and its wrappers
#
# The server turns a round's valid answers into its aggregate with one Combine, built once from
# the run's configuration (build_combine): the method's rule (Rule) innermost, wrapped by central
# DP (CentralDP) and the secure sum (SecureSum), as Flower's DP strategy wraps a strategy. Both
# wrappers are defined for the plain unweighted mean only (build_combine refuses the others);
# their arithmetic is the method's hooks (hiso.methods.privacy's DPConfig, hiso.methods.secagg's
# SecAggConfig), which the core calls without importing them.


class Combine(Protocol):
    """``combine(g, weights, plan)``: a round's answers ``g`` (n, tau, P) float64 in the
    participants' order, their weights (n,) and the round's plan -> its aggregate (tau, P)."""

    min_answers: int  # fewer valid answers than this: the round is planned again

    def __call__(self, g: np.ndarray, weights: np.ndarray, plan) -> np.ndarray: ...


@dataclass(frozen=True)
class Rule:
    """The method's combine over the base rule (``fn(g, w, rule, trim)``: :func:`combine` or a
    method's own), innermost of the wrappers."""

    fn: Callable
    rule: str = "mean"
    trim: float = 0.25
    weighted: bool = False
    own: bool = False  # the method's own combine (not the rule's mean: FeedSign's vote)
    min_answers = 1

    def __call__(self, g: np.ndarray, weights: np.ndarray, plan) -> np.ndarray:
        return self.fn(g, weights, self.rule, self.trim)


class CentralDP:
    """Central DP around the plain mean: the noised mean of the clipped answers
    (``dp.private_mean``: the server clips each answer and noises their sum, the noise keyed by
    ``noise_seed``, a secret never sent, the round and its attempt)."""

    min_answers = 1

    def __init__(self, inner: Rule, dp, noise_seed: int):
        self.inner, self.dp, self.noise_seed = inner, dp, int(noise_seed)

    def __call__(self, g: np.ndarray, weights: np.ndarray, plan) -> np.ndarray:
        return self.dp.private_mean(g, self.noise_seed, plan.round, plan.attempt)


class SecureSum:
    """Secure aggregation around the plain mean (or around central DP): the server learns only
    the integer sum of the answers' levels on ``grid`` (each clipped first under the inner
    central DP), and takes the mean from it (:meth:`from_sum`, the inner DP's noise added to the
    sum). Called on the answers themselves (in process), it is what such a sum would give."""

    def __init__(self, inner: Rule | CentralDP, grid):
        central = isinstance(inner, CentralDP)
        self.inner, self.grid = inner, grid
        self.dp, self.noise_seed = (inner.dp, inner.noise_seed) if central else (None, 0)

    @property
    def min_answers(self) -> int:  # SecAgg+ cannot unmask fewer (and a sum of one is that answer)
        return self.grid.threshold

    def __call__(self, g: np.ndarray, weights: np.ndarray, plan) -> np.ndarray:
        return self.from_sum(np.sum([self.grid.answer_levels(x, self.dp) for x in g], axis=0), len(g), plan)

    def from_sum(self, total: np.ndarray, n: int, plan) -> np.ndarray:
        """The aggregate from the integer sum ``total`` of ``n`` answers' levels (float64)."""
        return self.grid.secure_mean(total, n, self.dp, self.noise_seed, plan.round, plan.attempt)


def build_combine(fn: Callable, rule: str = "mean", trim: float = 0.25, *, weighted: bool = False,
                  own: bool = False, dp=None, noise_seed: int = 0, secagg=None) -> Combine:
    """The server's combine for a run: the method's ``fn`` over ``rule``, wrapped by central DP
    (``dp`` in central mode; local mode: the clients noised their answers) and by the secure sum
    (``secagg``); one-line errors for what the wrappers cannot account for. ``own``: ``fn`` is the
    method's own combine (its hook overridden), which the wrappers would replace by the mean."""
    check_rule(rule, trim)
    if own and dp is not None:
        raise ValueError("a method's own combine (FeedSign's votes, ...) is not accounted for differential privacy: "
                         "turn DP off")
    if dp is not None and (rule != "mean" or weighted):
        raise ValueError("differential privacy is accounted for the plain mean: use --aggregate mean without --weighted")
    if secagg is not None and (rule != "mean" or weighted or own):
        raise ValueError("secure aggregation gives the server only the sum: it needs the plain mean")
    out: Combine = Rule(fn, rule, trim, weighted, own)
    if dp is not None and dp.mode == "central":
        out = CentralDP(out, dp, noise_seed)
    if secagg is not None:
        out = SecureSum(out, secagg)
    return out
