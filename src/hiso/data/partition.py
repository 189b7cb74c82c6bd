"""Seeded partitions of a labelled training set into ``num_clients`` federated clients.

Every partitioner takes integer ``labels`` (one per training example) and returns a list of
``num_clients`` sorted int64 index arrays that are pairwise disjoint and together cover every
index exactly once. All randomness comes from ``np.random.default_rng([_SALT, seed])``, so the
same (labels, num_clients, alpha, seed) always gives the same split on any machine, and the
partition stream never coincides with other streams the task or algorithm derive from ``seed``.

Two Dirichlet conventions circulate under the same name and give very different
heterogeneity at the same ``alpha``; both are here, under different names:

* ``dirichlet`` -- the common one (Hsu et al. 2019; NIID-Bench, FedLab, Flower's
  ``DirichletPartitioner``): for each class, the class's examples are divided among the clients
  in proportions ``~ Dir(alpha, ..., alpha)`` (M entries). At ``alpha=1`` every client sees
  most classes.
* ``dirichlet-prior`` -- the DeComFL/HiSo authors' code (``cezo_fl/util/data_split.py``):
  each *client's label distribution* is drawn ``~ Dir(alpha * p)`` where ``p`` is the class
  frequency vector (C entries, sums to 1), so the concentration per class is ``alpha/C``
  (0.1 for MNIST at ``alpha=1``): clients are dominated by one or two classes.

Hugging Face ``flwr-datasets`` implements only the first convention, works on
``datasets.Dataset`` objects and pulls in ~500 MB (pyarrow, pandas, datasets, seaborn), so the
few lines of numpy below are used instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PARTITIONS = ("iid", "dirichlet", "dirichlet-prior")

# Mixed into every seed so the partition stream is independent of minibatch/model streams.
_SALT = 0x9A27


def _rng(seed: int) -> np.random.Generator:
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return np.random.default_rng([_SALT, int(seed)])


def _check(labels: Sequence[int] | np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError("labels must be a 1-D integer array")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise ValueError(
            f"cannot split {len(labels)} examples into {num_clients} non-empty clients"
        )
    return labels


def _finish(parts: list[list[np.ndarray]] | list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for p in parts:
        arr = np.concatenate(p) if isinstance(p, list) and p else np.asarray(p)
        out.append(np.sort(arr.astype(np.int64, copy=False)))
    return out


def iid(labels: Sequence[int] | np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Uniformly random split into clients whose sizes differ by at most one."""
    labels = _check(labels, num_clients)
    perm = _rng(seed).permutation(len(labels))
    return _finish(np.array_split(perm, num_clients))


def dirichlet(
    labels: Sequence[int] | np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Common convention: each class is split across clients with proportions ~ Dir(alpha 1_M).

    A class's (shuffled) examples are cut at ``floor(cumsum(proportions) * n_class)``. If some
    client ends up with fewer than ``min_size`` examples the whole draw is repeated (the usual
    NIID-Bench/Flower rule), up to ``max_tries`` times; client sizes are therefore unequal.
    If every try leaves a small client (thousands of clients with a few examples each: the
    smallest of 10,000 clients is almost surely below it), the last draw is repaired instead of
    rejected, see :func:`_repair`. A split that some try accepts is the same as before the
    repair existed (the draws and their order are unchanged), so old runs rebuild theirs.
    """
    labels = _check(labels, num_clients)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_size * num_clients > len(labels):
        raise ValueError(
            f"min_size={min_size} x {num_clients} clients exceeds {len(labels)} examples"
        )
    rng = _rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    conc = np.full(num_clients, float(alpha))
    clients = np.arange(num_clients)
    for _ in range(max(1, max_tries)):
        sizes = np.zeros(num_clients, dtype=np.int64)
        draw = []
        for idx in by_class:
            idx = rng.permutation(idx)
            cuts = (np.cumsum(rng.dirichlet(conc))[:-1] * len(idx)).astype(np.int64)
            counts = np.diff(cuts, prepend=0, append=len(idx))  # np.split(idx, cuts) sizes
            sizes += counts
            draw.append((idx, counts))
        if sizes.min() >= min_size:
            break
    owner = np.empty(len(labels), dtype=np.int64)
    for idx, counts in draw:
        owner[idx] = np.repeat(clients, counts)
    if sizes.min() < min_size:
        owner = _repair(owner, num_clients, min_size, rng)
    return _by_owner(owner, num_clients)


def _by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Client m's sorted indices, for an (n,) array giving each example's client."""
    order = np.argsort(owner, kind="stable")  # stable: each client's indices stay ascending
    return np.split(order, np.cumsum(np.bincount(owner, minlength=num_clients))[:-1])


def _repair(owner: np.ndarray, num_clients: int, min_size: int, rng) -> np.ndarray:
    """Top every client up to ``min_size`` with examples taken from clients above it.

    Each client above ``min_size`` offers its surplus (a random ``size - min_size`` of its
    examples); the total deficit is drawn uniformly from the offers, without replacement,
    shuffled and dealt to the short clients in client order. Donors keep >= ``min_size``; only
    the deficit moves (at 60,000 MNIST images, 10,000 clients, alpha=1, min_size=4: 1,880 examples, 3 %
    of the examples), and what a short client receives follows the donors' label mix, not its
    own, so repaired clients are a little less skewed than drawn ones.
    """
    owner = owner.copy()
    sizes = np.bincount(owner, minlength=num_clients)
    need = np.maximum(min_size - sizes, 0)
    shuffled = rng.permutation(len(owner))
    by_client = shuffled[np.argsort(owner[shuffled], kind="stable")]  # random order per client
    rank = np.arange(len(owner)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    offered = by_client[rank < np.repeat(np.maximum(sizes - min_size, 0), sizes)]
    moved = offered[rng.choice(len(offered), int(need.sum()), replace=False)]
    owner[moved] = np.repeat(np.arange(num_clients), need)
    return owner


def dirichlet_prior(
    labels: Sequence[int] | np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    balance: bool = True,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Authors' convention: client label distributions q_m ~ Dir(alpha * p), p = class frequencies.

    Follows ``get_dirichlet_split_indexes`` in the DeComFL repository: draw an M x C matrix of
    client label distributions, then cut each class's examples across clients in proportion to
    its column (normalised). With ``balance=True`` (the authors' default) clients above
    ``n // M`` examples give randomly chosen surplus examples to clients below it, so every
    client ends with ``n // M`` examples; this softens but does not remove the skew. Deviations
    from the authors' code, both so the split covers every index and is reproducible: the
    ``n % M`` left-over examples (which they drop) go one each to clients 0, 1, ...; class
    examples are shuffled before cutting (they cut in dataset order). Without ``balance``,
    draws are repeated until every client has at least ``min_size`` examples.
    """
    labels = _check(labels, num_clients)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    n = len(labels)
    if min_size * num_clients > n:
        raise ValueError(f"min_size={min_size} x {num_clients} clients exceeds {n} examples")
    rng = _rng(seed)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    prior = np.array([len(i) for i in by_class], dtype=np.float64) / n
    for _ in range(max_tries):
        q = rng.dirichlet(
            alpha * prior, size=num_clients
        )  # (M, C): one label distribution per client
        col = q.sum(axis=0)
        if not np.all(np.isfinite(q)) or np.any(col <= 0):
            continue  # underflow at tiny alpha: nobody got mass for some class; redraw
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k, idx in enumerate(by_class):
            idx = rng.permutation(idx)
            cum = np.cumsum(q[:, k]) / col[k]
            cuts = np.floor(cum[:-1] * len(idx)).astype(np.int64)
            for m, chunk in enumerate(np.split(idx, cuts)):
                parts[m].append(chunk)
        flat = [np.concatenate(p) for p in parts]
        if balance:
            flat = _balance(flat, n, rng)
        if min(len(p) for p in flat) >= min_size:
            return _finish(flat)
    raise ValueError(
        f"dirichlet_prior(alpha={alpha}) gave a client with < {min_size} examples in {max_tries} "
        "draws; raise alpha, lower min_size or use balance=True"
    )


def _balance(parts: list[np.ndarray], n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The authors' balancing pass: move random surplus examples to clients below n // M."""
    m = len(parts)
    expected = n // m
    diff = np.array([len(p) - expected for p in parts])
    parts = list(parts)
    extra: list[np.ndarray] = []
    pool: np.ndarray | None = None
    for r in np.argsort(-diff, kind="stable"):  # clients with the largest surplus first
        d = int(diff[r])
        if d > 0:
            p = rng.permutation(parts[r])
            extra.append(p[-d:])
            parts[r] = p[:-d]
        elif d < 0:
            if pool is None:  # surplus clients come first, so `extra` is complete here
                pool = rng.permutation(np.concatenate(extra))
            need = -d
            parts[r] = np.concatenate([parts[r], pool[:need]])
            pool = pool[need:]
    if pool is None:  # nobody was short: every surplus is part of the n % m remainder
        pool = np.concatenate(extra) if extra else np.empty(0, dtype=np.int64)
    for r, i in enumerate(pool):  # n % m examples the authors drop
        parts[r] = np.append(parts[r], i)
    return parts


def partition(
    kind: str,
    labels: Sequence[int] | np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float = 1.0,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Dispatch on ``kind`` in :data:`PARTITIONS` (``alpha``/``min_size`` unused for ``iid``)."""
    if kind == "iid":
        return iid(labels, num_clients, seed)
    if kind == "dirichlet":
        return dirichlet(labels, num_clients, alpha, seed, min_size=min_size)
    if kind == "dirichlet-prior":
        return dirichlet_prior(labels, num_clients, alpha, seed, balance=True, min_size=min_size)
    raise ValueError(f"unknown partition {kind!r}; choose one of {', '.join(PARTITIONS)}")


def label_histograms(
    labels: Sequence[int] | np.ndarray, parts: Sequence[np.ndarray], num_classes: int | None = None
) -> np.ndarray:
    """(num_clients, num_classes) int64 matrix of per-client label counts."""
    labels = np.asarray(labels)
    c = int(labels.max()) + 1 if num_classes is None else num_classes
    return np.stack([np.bincount(labels[p], minlength=c)[:c] for p in parts]).astype(np.int64)


def label_entropy(hist: np.ndarray) -> np.ndarray:
    """Per-client entropy (bits) of the label distribution: log2(C) if uniform, 0 if one class.

    The single number used to compare heterogeneity of partitions (lower = more skewed).
    """
    hist = np.asarray(hist, dtype=np.float64)
    p = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log2(p), 0.0)
    return terms.sum(axis=1)


def format_histograms(hist: np.ndarray, max_rows: int | None = 20) -> str:
    """A fixed-width table of per-client label counts, size and entropy, for logs and the CLI."""
    hist = np.asarray(hist)
    ent = label_entropy(hist)
    c = hist.shape[1]
    w = max(5, len(str(int(hist.max(initial=0)))) + 1)
    head = "client" + "".join(f"{k:>{w}}" for k in range(c)) + f"{'size':>8}{'H(bits)':>9}"
    rows = [head]
    shown = hist.shape[0] if max_rows is None else min(max_rows, hist.shape[0])
    for m in range(shown):
        cells = "".join(f"{int(v):>{w}}" for v in hist[m])
        rows.append(f"{m:>6}{cells}{int(hist[m].sum()):>8}{ent[m]:>9.2f}")
    if shown < hist.shape[0]:
        rows.append(f"... {hist.shape[0] - shown} more clients")
    rows.append(f"mean label entropy {ent.mean():.3f} bits (uniform {np.log2(c):.3f})")
    return "\n".join(rows)


__all__ = [
    "PARTITIONS",
    "dirichlet",
    "dirichlet_prior",
    "format_histograms",
    "iid",
    "label_entropy",
    "label_histograms",
    "partition",
]
