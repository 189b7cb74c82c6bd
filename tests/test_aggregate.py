"""The server's aggregation rules, per (k, p) entry, against numpy computed by hand."""

import numpy as np
import pytest

from hiso.core import Server, Uplink
from hiso.core.aggregate import combine

RNG = np.random.default_rng(0)


def _answers(n, shape=(2, 3)):
    return RNG.standard_normal((n, *shape))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_mean_is_the_weighted_mean(n):
    g, w = _answers(n), RNG.uniform(0.5, 3, n)
    by_hand = sum(w[i] * g[i] for i in range(n)) / w.sum()
    np.testing.assert_allclose(combine(g, w, "mean"), by_hand, rtol=1e-12)
    np.testing.assert_allclose(combine(g, None, "mean"), g.mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8])
def test_median_unweighted_is_numpys(n):
    g = _answers(n)
    np.testing.assert_array_equal(combine(g, None, "median"), np.median(g, axis=0))
    np.testing.assert_array_equal(combine(g, np.full(n, 2.5), "median"), np.median(g, axis=0))


def test_weighted_median_per_entry_by_hand():
    g = _answers(6)
    w = np.array([1.0, 4.0, 1.0, 1.0, 2.0, 1.0])  # total 10, half 5
    got = combine(g, w, "median")
    for idx in np.ndindex(g.shape[1:]):
        v = g[(slice(None), *idx)]
        order = np.argsort(v)
        cum = np.cumsum(w[order])
        i = int(np.nonzero(cum >= 5)[0][0])
        want = (v[order][i] + v[order][i + 1]) / 2 if cum[i] == 5 else v[order][i]
        assert got[idx] == want
    # a heavy client is the median wherever it holds more than half the weight
    heavy = np.array([1.0, 1.0, 10.0])
    np.testing.assert_array_equal(combine(g[:3], heavy, "median"), g[2])


@pytest.mark.parametrize("n,trim", [(8, 0.25), (8, 0.2), (5, 0.2), (4, 0.0), (10, 0.1), (3, 0.49)])
def test_trimmed_mean_drops_floor_trim_n_at_each_end(n, trim):
    g = _answers(n)
    cut = int(np.floor(trim * n))
    s = np.sort(g, axis=0)
    np.testing.assert_allclose(combine(g, None, "trimmed-mean", trim), s[cut:n - cut].mean(axis=0), rtol=1e-12)
    w = RNG.uniform(0.5, 3, n)
    got = combine(g, w, "trimmed-mean", trim)
    for idx in np.ndindex(g.shape[1:]):
        v = g[(slice(None), *idx)]
        keep = np.argsort(v, kind="stable")[cut:n - cut]
        assert got[idx] == pytest.approx((v[keep] * w[keep]).sum() / w[keep].sum(), rel=1e-12)


def test_robust_rules_ignore_one_huge_and_one_flipped_answer():
    honest = 1.0 + 0.1 * _answers(6)
    g = np.concatenate([honest, 1e3 * honest[:1], -honest[1:2]])  # 8 answers, 2 of them lies
    assert np.abs(combine(g, None, "mean") - honest.mean(0)).max() > 50
    for rule in ("median", "trimmed-mean"):
        out = combine(g, None, rule, 0.25)
        assert np.all((out >= honest.min(0)) & (out <= honest.max(0))), rule


def test_bad_rule_and_trim_are_refused():
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        combine(_answers(3), None, "mode")
    with pytest.raises(ValueError, match="trim"):
        combine(_answers(3), None, "trimmed-mean", 0.5)
    with pytest.raises(ValueError, match="trim"):
        Server(4, 2, 1, 2, rule="trimmed-mean", trim=-0.1)


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed-mean"])
def test_server_logs_the_rule_s_result_and_weights_count(rule):
    w = [1.0, 3.0, 1.0, 2.0, 1.0]
    srv = Server(5, 5, 2, 3, seed=1, weights=w, rule=rule, trim=0.2)
    plan = srv.plan()
    g = _answers(5).astype(np.float32)
    rec = srv.aggregate([Uplink(c, plan.round, g[c]) for c in plan.participants])
    np.testing.assert_array_equal(rec.scalars, combine(g.astype(np.float64), np.array(w), rule, 0.2).astype(np.float32))
    if rule != "median":  # ignoring the weights changes the result
        assert not np.allclose(rec.scalars, combine(g.astype(np.float64), None, rule, 0.2))


def test_the_combine_is_the_rule_wrapped_by_central_dp_and_the_secure_sum():
    """build_combine: the method's rule innermost, central DP around it, the secure sum around
    both; each layer's arithmetic is the methods' (private_mean, answer_levels + secure_mean)."""
    from types import SimpleNamespace

    from hiso.core.aggregate import CentralDP, Rule, SecureSum, build_combine
    from hiso.methods.privacy import DPConfig, private_mean
    from hiso.methods.secagg import SecAggConfig, answer_levels, secure_mean
    dp, grid, plan = DPConfig(1.0, 0.5), SecAggConfig(clip=8.0, bits=20, threshold=2), SimpleNamespace(round=4, attempt=1)
    g, w = _answers(3), np.ones(3)
    c = build_combine(combine, dp=dp, noise_seed=3, secagg=grid)
    assert isinstance(c, SecureSum) and isinstance(c.inner, CentralDP) and isinstance(c.inner.inner, Rule)
    assert c.min_answers == 2 and c.inner.min_answers == 1
    total = np.sum([answer_levels(x, grid, dp) for x in g], axis=0)
    assert np.array_equal(c(g, w, plan), secure_mean(total, 3, grid, dp, 3, 4, 1))
    assert np.array_equal(c.from_sum(total, 3, plan), c(g, w, plan))
    assert np.array_equal(c.inner(g, w, plan), private_mean(g, dp, 3, 4, 1))
    assert np.array_equal(c.inner.inner(g, w, plan), combine(g, w))
    assert isinstance(build_combine(combine, dp=DPConfig(1.0, 0.5, "local")), Rule)  # the clients noised it
    with pytest.raises(ValueError, match="only the sum"):
        build_combine(combine, "median", secagg=grid)
    with pytest.raises(ValueError, match="plain mean"):
        build_combine(combine, weighted=True, dp=dp)
