"""Client partitioners: coverage, determinism, min sizes, and the two Dirichlet conventions."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hiso.data.partition import (
    PARTITIONS,
    dirichlet,
    dirichlet_prior,
    format_histograms,
    iid,
    label_entropy,
    label_histograms,
    partition,
)

# MNIST-like: 10 classes, mildly unequal sizes, shuffled order.
COUNTS = [592, 674, 596, 613, 584, 542, 592, 627, 585, 595]
LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), COUNTS))
N = len(LABELS)


def mean_entropy(parts) -> float:
    return float(label_entropy(label_histograms(LABELS, parts, 10)).mean())


@pytest.mark.parametrize("kind", PARTITIONS)
@pytest.mark.parametrize("m", [1, 7, 40])
def test_disjoint_and_covering(kind, m):
    parts = partition(kind, LABELS, m, seed=1, alpha=0.5, min_size=5)
    assert len(parts) == m
    assert all(p.dtype == np.int64 for p in parts)
    allidx = np.concatenate(parts)
    assert len(allidx) == N, "some index is duplicated or missing"
    np.testing.assert_array_equal(np.sort(allidx), np.arange(N))


@pytest.mark.parametrize("kind", PARTITIONS)
def test_seeded(kind):
    a = partition(kind, LABELS, 12, seed=7, alpha=0.3)
    b = partition(kind, LABELS, 12, seed=7, alpha=0.3)
    c = partition(kind, LABELS, 12, seed=8, alpha=0.3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_sizes_and_mix():
    parts = iid(LABELS, 9, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert mean_entropy(parts) > 0.99 * np.log2(10)


@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_dirichlet_min_size_holds(alpha):
    unconstrained = dirichlet(LABELS, 20, alpha, seed=0, min_size=0)
    assert min(len(p) for p in unconstrained) < 50, "test needs a first draw that violates min_size"
    parts = dirichlet(LABELS, 20, alpha, seed=0, min_size=50)
    assert min(len(p) for p in parts) >= 50


def test_dirichlet_prior_min_size_holds_unbalanced():
    parts = dirichlet_prior(LABELS, 10, 1.0, seed=0, balance=False, min_size=100)
    assert min(len(p) for p in parts) >= 100


def test_impossible_min_size_raises():
    with pytest.raises(ValueError, match="min_size"):
        dirichlet(LABELS, 10, 1.0, seed=0, min_size=N)


@pytest.mark.parametrize(
    ("m", "alpha", "seed", "min_size", "digest"),
    [(20, 0.1, 0, 50, "4d7380d65affe9ba"), (40, 0.5, 1, 5, "92e6393f8413d5bb")],
)
def test_dirichlet_accepted_draws_are_unchanged(m, alpha, seed, min_size, digest):
    """Digests of the list-of-chunks implementation (b967fd9): old runs rebuild their split."""
    parts = dirichlet(LABELS, m, alpha, seed=seed, min_size=min_size)
    got = hashlib.sha256(b"".join(p.tobytes() + b"|" for p in parts)).hexdigest()[:16]
    assert got == digest


def test_dirichlet_repairs_when_every_draw_has_a_small_client():
    """2,000 clients of ~3 examples: no draw has all >= 2, so the last one is topped up."""
    parts = dirichlet(LABELS, 2000, 1.0, seed=0, min_size=2, max_tries=20)
    raw = dirichlet(LABELS, 2000, 1.0, seed=0, min_size=0, max_tries=1)
    sizes, raw_sizes = np.array([len(p) for p in parts]), np.array([len(p) for p in raw])
    assert raw_sizes.min() < 2 and sizes.min() >= 2
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(N))
    assert all(np.all(np.diff(p) > 0) for p in parts)
    short = raw_sizes < 2  # draw 1 is the same draw: only the deficit moved, donors kept >= 2
    again = dirichlet(LABELS, 2000, 1.0, seed=0, min_size=2, max_tries=1)
    moved = sum(len(np.setdiff1d(a, b)) for a, b in zip(again, raw, strict=True))
    assert moved == int(np.maximum(2 - raw_sizes, 0).sum()) and short.any()


def test_dirichlet_prior_balanced_sizes():
    """The authors' balancing gives everyone n // M; the n % M remainder is spread, not dropped."""
    parts = dirichlet_prior(LABELS, 7, 1.0, seed=0)
    sizes = sorted(len(p) for p in parts)
    assert sizes[0] == N // 7 and sizes[-1] <= N // 7 + 1 and sum(sizes) == N


def test_alpha_controls_skew():
    for f in (dirichlet, dirichlet_prior):
        low = np.mean([mean_entropy(f(LABELS, 10, 0.1, seed=s)) for s in range(3)])
        high = np.mean([mean_entropy(f(LABELS, 10, 100.0, seed=s)) for s in range(3)])
        assert high > low + 0.5, f.__name__


def test_prior_convention_is_more_skewed_at_alpha_1():
    """Dir(alpha * p) per client (authors') vs Dir(alpha 1_M) per class (common), alpha = 1.

    Measured here (10 classes, 10 clients): about 2.85 vs 1.95 bits of mean label entropy with
    balancing, 1.35 without; uniform is log2(10) = 3.32.
    """
    seeds = range(4)
    common = np.mean([mean_entropy(dirichlet(LABELS, 10, 1.0, seed=s)) for s in seeds])
    prior = np.mean([mean_entropy(dirichlet_prior(LABELS, 10, 1.0, seed=s)) for s in seeds])
    raw = np.mean(
        [mean_entropy(dirichlet_prior(LABELS, 10, 1.0, seed=s, balance=False)) for s in seeds]
    )
    assert common > 2.6
    assert prior < common - 0.5
    assert raw < prior


def test_histograms_and_format():
    parts = dirichlet(LABELS, 4, 1.0, seed=0)
    hist = label_histograms(LABELS, parts, 10)
    assert hist.shape == (4, 10) and hist.dtype == np.int64
    assert hist.sum(axis=1).tolist() == [len(p) for p in parts]
    assert hist.sum(axis=0).tolist() == COUNTS
    ent = label_entropy(np.array([[5, 0, 0, 0], [1, 1, 1, 1]]))
    np.testing.assert_allclose(ent, [0.0, 2.0])
    text = format_histograms(hist)
    assert text.splitlines()[0].startswith("client") and len(text.splitlines()) == 1 + 4 + 1
    assert "more clients" in format_histograms(
        label_histograms(LABELS, iid(LABELS, 30, 0), 10), max_rows=5
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown partition"):
        partition("shards", LABELS, 3, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet(LABELS, 3, 0.0, seed=0)
    with pytest.raises(ValueError):
        iid(LABELS, N + 1, seed=0)
    with pytest.raises(ValueError):
        iid(LABELS.astype(float), 3, seed=0)
