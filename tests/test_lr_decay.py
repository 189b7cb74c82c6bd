"""Inverse-time lr decay (ZOConfig.lr_decay): round r steps with lr / (1 + r / T), on every
replica alike, in the local steps and in the global step."""

import json

import numpy as np
import pytest
import torch

from hiso.core import ModelState, RoundRecord
from hiso.methods.hiso_method import decomfl, hiso
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def test_lr_at_is_inverse_time_and_constant_by_default():
    zo = decomfl(lr=0.1, lr_decay=50)
    assert zo.lr_at(0) == 0.1
    assert zo.lr_at(50) == pytest.approx(0.05)
    assert zo.lr_at(150) == pytest.approx(0.025)
    assert decomfl(lr=0.1).lr_at(10**6) == 0.1
    with pytest.raises(ValueError, match="lr_decay"):
        decomfl(lr=0.1, lr_decay=0.0)


@pytest.mark.parametrize("make", [hiso, decomfl], ids=["hiso", "decomfl"])
def test_a_round_steps_exactly_as_a_constant_run_at_that_rounds_lr(make):
    """The global step of round r with decay equals, bit for bit, a constant-lr step at lr_at(r)."""
    task = TinyTask()
    rng = np.random.default_rng(0)
    decayed = ModelState(task.build_model(), make(lr=0.05, perturbations=3, lr_decay=4))
    for r in range(7):  # advance the decaying replica to round 7
        decayed.apply(RoundRecord(r, rng.integers(0, 2**31, (1, 3)), rng.standard_normal((1, 3)).astype(np.float32)))
    rec = RoundRecord(7, rng.integers(0, 2**31, (1, 3)), rng.standard_normal((1, 3)).astype(np.float32))
    at7 = decayed.state_dict()
    at7 = {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in at7.items()}
    const = ModelState(task.build_model(), make(lr=0.05 / (1 + 7 / 4), perturbations=3))
    undecayed = ModelState(task.build_model(), make(lr=0.05, perturbations=3))
    for st in (const, undecayed):
        st.load_state_dict(at7)
        st.apply(rec)
    decayed.apply(rec)
    assert all(torch.equal(a, b) for a, b in zip(decayed.params, const.params))
    assert not all(torch.equal(a, b) for a, b in zip(decayed.params, undecayed.params))


def test_local_steps_use_the_rounds_lr():
    """With tau > 1 the client's intermediate step uses lr_at(r): its scalars equal a constant-lr
    client's at that lr, and differ from the undecayed lr's."""
    from hiso.core import Perturber, local_update
    task = TinyTask()
    batches = [task.batch(0, 6, k, 8) for k in range(2)]
    seeds = np.arange(6, dtype=np.int64).reshape(2, 3) + 11

    def scalars(zo, rnd):
        st = ModelState(task.build_model(), zo, round=rnd)
        return local_update(st, Perturber(st.model, st.params), task.loss, batches, seeds).scalars

    got = scalars(decomfl(lr=0.5, perturbations=3, local_steps=2, lr_decay=2), 6)
    assert np.array_equal(got, scalars(decomfl(lr=0.5 / 4, perturbations=3, local_steps=2), 6))
    assert not np.array_equal(got, scalars(decomfl(lr=0.5, perturbations=3, local_steps=2), 6))


def test_faithful_clients_and_a_late_client_match_the_server_with_decay():
    zo = hiso(lr=0.02, perturbations=3, local_steps=2, lr_decay=10)
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=10**6)
    rows = list(sim.run(60))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert min(c.state.round for c in sim.clients.values()) < 60
    sim.sync_all()
    for c in sim.clients.values():
        assert all(torch.equal(a, b) for a, b in zip(c.state.params, sim.state.params))
        assert all(torch.equal(a, b) for a, b in zip(c.state.h, sim.state.h))
    late = ModelState(task.build_model(), zo)
    late.replay(sim.server.records_since(0))
    assert all(torch.equal(a, b) for a, b in zip(late.params, sim.state.params))
    plain = Simulation(TinyTask(num_clients=20), hiso(lr=0.02, perturbations=3, local_steps=2), clients_per_round=3,
                       seed=1, batch_size=8, eval_every=1000)
    list(plain.run(60))
    assert not all(torch.equal(a, b) for a, b in zip(plain.state.params, sim.state.params))


def test_config_records_lr_decay_rebuild_reproduces_it_and_full_model_runs_refuse_it(tmp_path):
    from hiso.config import ConfigError, load_config
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="quadratic", dim=30, rounds=25, eval_every=5, threads=1, algorithm="decomfl",
                      lr_decay=5.0)
    assert cfg.zo().lr_decay == 5.0
    run_to_dir(cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["lr_decay"] == 5.0
    _, ckpt = rebuild(tmp_path)
    final = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(final["model"][k], v) for k, v in ckpt["model"].items())
    with pytest.raises(ConfigError,
                       match="lr_decay is for hiso, decomfl, feedsign, ferret, sketch, fedkrso, greedy and conmezo"):
        load_config(None, algorithm="fedavg", task="quadratic", lr_decay=5.0)
    with pytest.raises(ConfigError, match="lr_decay"):
        load_config(None, lr_decay=-1.0)


@pytest.mark.parametrize("algorithm", ["ferret", "sketch"])
def test_first_order_clients_step_at_the_rounds_lr_and_replicas_follow(algorithm):
    """Ferret's and sketch's clients take their SGD steps at lr_at(r): round 7's answer equals,
    bit for bit, a constant-lr client's at lr / (1 + 7 / T), and differs from the undecayed one;
    a decaying run's replicas (one that skipped every round included) stay bit-identical."""
    from hiso.config import load_config
    from seed_method_checks import assert_same_model, late_client

    def zo(**kw):
        return load_config(None, algorithm=algorithm, task="quadratic", ferret_k=4, ferret_blocks=2,
                           local_steps=2, **kw).zo()

    task = TinyTask()
    decayed = zo(lr=0.2, lr_decay=4.0)
    lr7 = decayed.lr_at(7)
    batches = [task.batch(3, 7, s, 8) for s in range(2)]
    seeds = np.random.default_rng(0).integers(0, 2**31, decayed.shape)
    answers = []
    for cfg in (decayed, zo(lr=lr7), zo(lr=0.2)):
        state = ModelState(task.build_model(), cfg, round=7)
        answers.append(cfg.method.local_update(state, None, task.loss, batches, seeds).scalars)
    assert np.array_equal(answers[0], answers[1]) and not np.array_equal(answers[0], answers[2])

    sim = Simulation(task, decayed, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    list(sim.run(12))
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, decayed).state])
