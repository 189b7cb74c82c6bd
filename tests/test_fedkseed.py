"""FedKSeed: a fixed pool of K seeds, FedKSeed-Pro's probabilities, catch-up with at most K draws."""

import math

import numpy as np
import pytest
import torch

from hiso.config import load_config
from hiso.core.directions import DirectionGenerator, direction
from hiso.core.messages import MessageError
from hiso.methods.fedkseed import (MAX_POOL, PoolReplica, decode_pool_uplink, draw_indices, encode_pool_uplink,
                                   pool_seeds, probabilities)
from hiso.runners.inprocess import FedKSeedSimulation

from conftest import TinyTask
from seed_method_checks import LinearTask, assert_run_refused, assert_same_model


def _cfg(**kw):
    return load_config(None, algorithm="fedkseed", task="quadratic", **kw)


def test_probabilities_are_a_softmax_of_min_max_normalised_mean_amplitudes():
    amp, count = np.array([2.0, 0.0, 3.0, 4.0]), np.array([1, 0, 2, 4])
    # mean |g| over each seed's history, which starts with one 0 (the authors' grad_initial)
    psi = [2.0 / 2, 0.0, 3.0 / 3, 4.0 / 5]
    norm = [v / (1.0 + 1e-10) for v in psi]
    e = [math.exp(v) for v in norm]
    assert np.allclose(probabilities(amp, count), [v / sum(e) for v in e], rtol=1e-12)
    assert np.array_equal(probabilities(amp, count, "uniform"), np.full(4, 0.25))
    assert np.allclose(probabilities(np.zeros(3), np.zeros(3)), 1 / 3)  # nothing seen yet: uniform


_C = [(1.0, 0.0), (-1.0, -2.0)]  # f_i(w) = c_i . w: with mu = 1/2 and w on a grid of halves every number is exact


def test_two_rounds_worked_by_hand():
    # run seed 5, K = 3: the pool's directions (Philox Rademacher) z_0 = (-1, 1), z_1 = (-1, -1), z_2 = (1, 1)
    z = [direction(int(s), [torch.Size([1, 2])])[0].flatten().tolist() for s in pool_seeds(5, 3)]
    assert z == [[-1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]]
    sim = FedKSeedSimulation(LinearTask(_C), _cfg(clients=2, sampled=2, lr=0.5, mu=0.5, seed_pool=3, seed=5,
                                             eval_every=100))
    # round 0: p uniform; client 0 draws seed 0 (g = c_0.z_0 = -1), client 1 seed 2 (g = c_1.z_2 = -3)
    # a = (-1/2, 0, -3/2), C = lr a = (-1/4, 0, -3/4), x_1 = -sum_j C_j z_j = (1/2, 1)
    sim.step()
    rec = sim.records[0]
    assert rec.idx.tolist() == [[0], [2]] and rec.g.tolist() == [[-1.0], [-3.0]]
    assert sim.state.params[0].tolist() == [[0.5, 1.0]]
    # round 1: mean |g| over (0, g...) = (1/2, 0, 3/2) -> min-max (1/3, 0, 1) -> softmax
    e = [math.exp(1 / 3), 1.0, math.e]
    assert np.allclose(sim.replica.p(), [v / sum(e) for v in e], rtol=1e-9)
    # client 0 draws seed 2 (g = 1), client 1 seed 0 (g = 1 - 2 = -1): a = (-1/2, 0, 1/2),
    # C = (-1/2, 0, -1/2), x_2 = (1/2) z_0 + (1/2) z_2 = (0, 1)
    sim.step()
    rec = sim.records[1]
    assert rec.idx.tolist() == [[2], [0]] and rec.g.tolist() == [[1.0], [-1.0]]
    assert sim.state.params[0].tolist() == [[0.0, 1.0]]
    assert np.array_equal(sim.replica.coef, [-0.5, 0.0, -0.5])


def _counting(monkeypatch):
    calls = {"combine": 0, "seeds": 0, "fill": 0}
    combine, fill = DirectionGenerator.combine, DirectionGenerator.fill

    def c(self, index, shape, seeds, *a, **k):
        calls["combine"] += 1
        calls["seeds"] += len(seeds)
        return combine(self, index, shape, seeds, *a, **k)

    def f(self, *a, **k):
        calls["fill"] += 1
        return fill(self, *a, **k)

    monkeypatch.setattr(DirectionGenerator, "combine", c)
    monkeypatch.setattr(DirectionGenerator, "fill", f)
    return calls


def test_replicas_are_bit_exact_and_a_late_client_draws_each_pool_seed_at_most_once(monkeypatch):
    task = TinyTask(num_clients=20)
    cfg = _cfg(clients=20, sampled=3, local_steps=2, seed_pool=16, lr=0.02, mode="faithful", batch_size=8,
               eval_every=1000)
    sim = FedKSeedSimulation(task, cfg)
    rows = list(sim.run(60))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    sim.sync_all()
    assert_same_model(sim.state, [rep.state for rep, _ in sim.clients.values()])
    late = PoolReplica(task.build_model(), sim.zo, 16, cfg.seed)
    calls = _counting(monkeypatch)
    late.catch_up(sim.records)  # 60 rounds x 3 clients x 2 steps = 360 pairs over 16 seeds
    n_tensors = len(late.state.params)
    assert calls["fill"] == 0 and calls["combine"] == n_tensors and calls["seeds"] <= 16 * n_tensors
    assert late.regenerations <= 16
    assert_same_model(sim.state, [late.state])


def test_uplink_is_tau_index_scalar_pairs():
    up = encode_pool_uplink(3, 7, np.array([5, 4095]), np.array([0.5, -1.0], np.float32), None)
    assert len(up) == 5 + 2 * (2 + 4)  # version, kind, flags, client, round; two u16 + float32 pairs
    c, r, idx, g, loss = decode_pool_uplink(up, 2, 4096)
    assert (c, r, idx.tolist(), g.tolist(), loss) == (3, 7, [5, 4095], [0.5, -1.0], None)
    with pytest.raises(MessageError, match="outside the pool"):
        decode_pool_uplink(up, 2, 4095)
    assert draw_indices(np.array([0.0, 1.0]), 0, 0, 0, 5).tolist() == [1] * 5


@pytest.mark.parametrize("flags, msg", [
    (["--seed-pool", "0"], "seed pool must hold 1 to"),
    (["--seed-pool", str(MAX_POOL + 1)], "16-bit"),
    (["--perturbations", "2"], "perturbations must be 1"),
    (["--directions", "sparse", "--direction-density", "0.1"], "dense family, not sparse"),
    (["--directions", "lowrank", "--direction-rank", "2"], "dense family, not lowrank"),
])
def test_bad_settings_fail_with_one_line(tmp_path, capsys, flags, msg):
    assert_run_refused(tmp_path, capsys, ["--algorithm", "fedkseed", "--task", "quadratic", "--rounds", "2", "--quiet",
                                          *flags], msg)


def test_fast_and_faithful_modes_agree():
    task = TinyTask(num_clients=10)
    sims = [FedKSeedSimulation(task, _cfg(clients=10, sampled=3, seed_pool=8, lr=0.02, mode=m, batch_size=8))
            for m in ("fast", "faithful")]
    for _ in range(15):
        for s in sims:
            s.step()
    a, b = sims
    assert all(np.array_equal(x.idx, y.idx) and np.array_equal(x.g, y.g) for x, y in zip(a.records, b.records))
    assert all(torch.equal(x, y) for x, y in zip(a.state.params, b.state.params))
    assert np.array_equal(a.comm.up, b.comm.up) and np.array_equal(a.comm.down, b.comm.down)
