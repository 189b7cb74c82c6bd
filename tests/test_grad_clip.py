"""Gradient-norm clipping of the first-order seed methods' local SGD (``--grad-clip``): the rule,
a client's step under it, exact replicas, and the fingerprint of runs written before it."""

import json

import numpy as np
import pytest
import torch

from hiso.core import ModelState
from hiso.core.join import config_blob, config_fingerprint
from hiso.methods.ferret import clip_grads
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def zo(algorithm, **kw):
    from hiso.config import load_config
    return load_config(None, algorithm=algorithm, task="quadratic", ferret_k=4, ferret_blocks=2, **kw).zo()


def test_clip_grads_scales_to_the_norm_above_it_and_keeps_them_below():
    g = [torch.tensor([3.0, 0.0]), None, torch.tensor([[4.0]])]  # joint norm 5
    out = clip_grads(g, 1.0)
    assert out[1] is None
    assert torch.allclose(out[0], torch.tensor([0.6, 0.0])) and torch.allclose(out[2], torch.tensor([[0.8]]))
    assert all(a is b for a, b in zip(clip_grads(g, 5.0), g))  # at the norm: untouched, the same tensors
    nan = [torch.tensor([float("nan")])]
    assert clip_grads(nan, 1.0)[0] is nan[0]  # left for the caller's finiteness check


@pytest.mark.parametrize("algorithm", ["ferret", "sketch", "fedkrso"])
def test_a_clipped_step_moves_lr_times_the_clip_along_the_gradient(algorithm):
    """One local step from x_r under grad_clip c moves x by lr c g / ||g|| when ||g|| > c: the
    answer equals an unclipped client's at lr c / ||g||, bit for bit in Ferret's float32
    projections; a clip above ||g|| changes nothing."""
    task = TinyTask()
    batches = [task.batch(2, 5, 0, 8)]
    seeds = np.random.default_rng(1).integers(0, 2**31, zo(algorithm).shape)
    model = task.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.autograd.grad(task.loss(model, batches[0]), params)
    norm = float(torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in g])))
    assert norm > 0.05

    def answer(cfg):
        return cfg.method.local_update(ModelState(task.build_model(), cfg, round=5), None, task.loss, batches,
                                       seeds).scalars

    clipped = answer(zo(algorithm, lr=0.5, grad_clip=0.05))
    assert np.allclose(clipped, answer(zo(algorithm, lr=0.5 * 0.05 / norm)), rtol=1e-5, atol=1e-7)
    assert not np.allclose(clipped, answer(zo(algorithm, lr=0.5)))
    assert np.array_equal(answer(zo(algorithm, lr=0.5, grad_clip=10 * norm)), answer(zo(algorithm, lr=0.5)))


@pytest.mark.parametrize("algorithm", ["ferret", "sketch", "fedkrso"])
def test_replicas_of_a_clipped_run_stay_bit_identical(algorithm):
    from seed_method_checks import assert_same_model, late_client
    cfg = zo(algorithm, lr=0.3, local_steps=2, grad_clip=0.05)
    task = TinyTask()
    sim = Simulation(task, cfg, clients_per_round=3, seed=4, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    list(sim.run(12))
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, cfg).state])


def test_runs_without_it_keep_their_fingerprint_and_a_clip_is_another_configuration():
    for algorithm in ("ferret", "sketch"):
        plain, clipped = zo(algorithm), zo(algorithm, grad_clip=1.0)
        assert "grad_clip" not in config_blob(plain)  # what runs written before the option hashed
        assert json.loads(config_blob(clipped))["ferret" if algorithm == "ferret" else "method"]["grad_clip"] == 1.0
        assert config_fingerprint(plain) != config_fingerprint(clipped)


def test_the_cli_records_it_rebuilds_the_run_and_refuses_it_elsewhere(tmp_path, capsys):
    from hiso.cli import main
    from hiso.runners.rundir import rebuild
    out = tmp_path / "run"
    assert main(["run", "--task", "quadratic", "--algorithm", "sketch", "--rounds", "6", "--grad-clip", "0.5",
                 "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["grad_clip"] == 0.5
    _, ckpt = rebuild(out)
    final = torch.load(out / "model.pt")
    assert all(torch.equal(final["model"][k], v) for k, v in ckpt["model"].items())
    capsys.readouterr()
    rc = main(["run", "--task", "quadratic", "--algorithm", "decomfl", "--grad-clip", "1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "grad_clip is for ferret, sketch and fedkrso" in err[0]


def test_each_of_two_local_steps_is_clipped_as_computed_by_hand():
    """Two local SGD steps, each gradient above the clip: x_2 = x_1 - lr clip(g(x_1)) after
    x_1 = x_0 - lr clip(g(x_0)), computed here step by step; Ferret's answer is the projections
    of x_0 - x_2, which a client clipping only its first step would not give (sketch quantises
    the same steps' projections: methods/sketch.py calls Ferret's local update)."""
    task = TinyTask()
    batches = [task.batch(2, 5, k, 8) for k in range(2)]
    cfg = zo("ferret", lr=0.5, local_steps=2, grad_clip=0.05)
    seeds = np.random.default_rng(3).integers(0, 2**31, cfg.shape)

    def by_hand(clip_steps):
        from hiso.methods.ferret import blocks_of
        model = task.build_model()
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        for k, batch in enumerate(batches):
            g = torch.autograd.grad(task.loss(model, batch), params)
            norm = float(torch.linalg.vector_norm(torch.cat([x.double().reshape(-1) for x in g])))
            assert norm > 0.05  # the clip binds at both steps
            scale = 0.05 / norm if k in clip_steps else 1.0
            with torch.no_grad():
                for p, gi in zip(params, g):
                    p.sub_(0.5 * scale * gi)
        delta = [(s - p.detach()).reshape(-1).double() for s, p in zip(start, params)]
        gen = ModelState(task.build_model(), cfg).gen
        out = np.zeros(cfg.shape)
        for i, b in enumerate(blocks_of(params, cfg.shape[0])):
            for k in range(cfg.shape[1]):
                out[b, k] += float(torch.dot(delta[i], gen.fill(int(seeds[b, k]), i, params[i].shape).reshape(-1).double()))
        return out

    got = cfg.method.local_update(ModelState(task.build_model(), cfg), None, task.loss, batches, seeds).scalars
    assert np.allclose(got, by_hand({0, 1}), rtol=1e-4, atol=1e-6)  # float32 steps, up to the order of float ops
    assert not np.allclose(got, by_hand({0}), rtol=1e-4, atol=1e-6)
