"""More of ``hiso diagnose``: the replay is the run's H for every H variant and at every
snapshot, lr/H is the step the core's update takes in expectation, Hutchinson is right on a
model whose Hessian is not diagonal, and the per-tensor / across-tensor numbers are wired right."""

import json

import numpy as np
import pytest
import torch

from conftest import TinyTask
from hiso.config import load_config
from hiso.core.history import parse_history
from hiso.core.state import ModelState, step_direction
from hiso.report.diagnose import QUANTILES, correlations, diagnose, measure_curvature
from hiso.runners.rundir import rebuild, run_to_dir
from hiso.tasks.quadratic import QuadraticTask
from hiso.tasks.registry import build_task

QUAD = dict(task="quadratic", dim=30, clients=6, sampled=2, rounds=24, eval_every=8, threads=1)
QN = ("min", "p5", "median", "p95", "max")


def _h64(state) -> np.ndarray:
    return np.concatenate([h.detach().double().numpy().reshape(-1) for h in state.h])


@pytest.mark.parametrize("flags", [
    {"h_granularity": "tensor", "h_bias_correction": True},
    {"h_stat": "denoised", "h_granularity": "model", "momentum": 0.5},
    {"local_steps": 2, "h_source": "every", "h_min": 0.5}], ids=["tensor-bc", "denoised-model-mom", "every-clip"])
def test_every_snapshot_is_the_replica_after_that_many_rounds(tmp_path, flags):
    cfg = load_config(None, **{**QUAD, **flags})
    run_to_dir(cfg, tmp_path)
    d = diagnose(tmp_path, points=4, curvature="no", progress=False)
    assert d["matches_model_pt"] is True
    assert np.array_equal(d["_arrays"]["h"], _h64(rebuild(tmp_path)[0]))  # bit for bit
    records = parse_history(tmp_path / "history.bin").records
    state = ModelState(build_task(cfg).build_model(), cfg.zo())
    snaps = {s["round"]: s for s in d["over_rounds"]}
    assert sorted(snaps) == [0, 8, 16, 24]
    for rec in [None, *records]:
        if rec is not None:
            state.apply(rec)
        if state.round in snaps:
            h = _h64(state)
            assert [snaps[state.round]["h"][k] for k in QN] == np.quantile(h, QUANTILES).tolist()
            assert [snaps[state.round]["step"][k] for k in QN] == np.quantile(cfg.lr / h, QUANTILES).tolist()


def test_effective_step_is_lr_over_h_in_expectation():
    """The core's global update with scalars g_p = <H^{-1/2} u_p, grad> (the mu -> 0 limit of a
    client's estimate along its perturbation H^{-1/2} u_p) averages to H^{-1} grad: x moves by
    lr / H times the gradient, the step ``hiso diagnose`` reports (not lr / sqrt(H))."""
    task = QuadraticTask(4, dim=4)
    cfg = load_config(None, task="quadratic", dim=4, perturbations=1)
    state = ModelState(task.build_model(), cfg.zo())
    h = torch.tensor([0.25, 1.0, 4.0, 16.0])
    state.h[0].copy_(h)
    p = state.params[0]
    grad = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    n = 5000
    seeds = np.arange(1, n + 1, dtype=np.uint64)
    g = np.empty(n, np.float32)
    ghat = np.empty((n, 4))
    for i in range(n):  # each direction alone: the scalar along it, and that sample of ghat
        w = step_direction(state.gen, 0, p, seeds[i:i + 1], np.array([1.0], np.float32), state.h[0]).double()
        g[i] = float(w @ grad)
        ghat[i] = (w * float(g[i])).numpy()
    core = step_direction(state.gen, 0, p, seeds, g, state.h[0]).double().numpy()  # (1/P) sum_p g_p H^-1/2 u_p
    np.testing.assert_allclose(core, ghat.mean(0), rtol=1e-4, atol=1e-6)
    se = ghat.std(0) / np.sqrt(n)
    assert np.all(np.abs(core - grad.numpy() / h.numpy()) < 5 * se), (core, se)
    assert not np.all(np.abs(core - grad.numpy() / np.sqrt(h.numpy())) < 5 * se)


def test_hutchinson_matches_the_exact_hessian_diagonal_of_an_mlp():
    from torch.func import functional_call

    task = TinyTask(num_clients=3)
    model = task.build_model().double()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in params]
    first_round, batch_size = 5, 16
    batch = task.batch(0, first_round, 0, batch_size)  # measure_curvature's one batch (client 0)

    def f(flat):
        parts, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            parts[n] = flat[i:i + k].reshape(s)
            i += k
        x, y = batch
        return ((functional_call(model, parts, (x.double(),)) - y.double()) ** 2).mean()

    hess = torch.autograd.functional.hessian(f, torch.cat([p.detach().reshape(-1) for p in params]))
    model.float()
    probes = 400
    cur = measure_curvature(task, model, list(model.parameters()), first_round=first_round, batches=1,
                            probes=probes, batch_size=batch_size)
    est = torch.cat([t.reshape(-1) for t in cur.hutchinson]).double()
    diag = hess.diagonal()
    sd = ((hess ** 2).sum(1) - diag ** 2).sqrt() / np.sqrt(probes)  # std of the mean of v_i (Hv)_i
    assert torch.all((est - diag).abs() <= 5 * sd + 1e-5)
    assert (hess - torch.diag(diag)).abs().max() > 1e-3  # not trivially diagonal


def test_per_tensor_and_across_tensor_numbers(tmp_path):
    import hiso

    task = TinyTask(num_clients=6, seed=3)
    hiso.run(task, tmp_path, algorithm="hiso", rounds=10, sampled=2, lr=0.05, eval_every=5)
    d = diagnose(tmp_path, points=3, curvature="yes", batches=3, probes=2, progress=False)
    cur = d["curvature"]
    assert [t["name"] for t in cur["per_tensor"]] == [n for n, _ in task.build_model().named_parameters()]
    cfg = json.loads((tmp_path / "config.json").read_text())
    state, _ = rebuild(tmp_path, task)
    again = measure_curvature(task, state.model, state.params, first_round=11, batches=3, probes=2,
                              batch_size=cfg["batch_size"], seed=cfg["seed"])
    hs = [h.double().reshape(-1).numpy() for h in state.h]
    g2 = [g.double().reshape(-1).numpy() for g in again.grad2]
    hu = [c.double().reshape(-1).numpy() for c in again.hutchinson]
    for t, h, g, c in zip(cur["per_tensor"], hs, g2, hu):
        assert t["h_mean"] == pytest.approx(h.mean()) and t["grad2_mean"] == pytest.approx(g.mean())
        assert t["hutchinson_mean"] == pytest.approx(c.mean())
        assert t["grad2"] == pytest.approx(correlations(h, g))
    want = correlations([h.mean() for h in hs], [g.mean() for g in g2])
    assert cur["across_tensors"]["grad2"]["spearman"] == pytest.approx(want["spearman"])
    assert cur["across_tensors"]["grad2"]["pearson"] == pytest.approx(want["pearson"])
