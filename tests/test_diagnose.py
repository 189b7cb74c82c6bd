"""``hiso diagnose``: an honest replay of H, the effective step the core really takes, correct
curvature estimates, the files and the command's errors."""

import json

import numpy as np
import pytest
import torch

from cli_helpers import run_cli
from conftest import TinyTask
from hiso.config import load_config
from hiso.core.state import ModelState, step_direction
from hiso.report import diagnose as dg
from hiso.runners.rundir import rebuild, run_to_dir, start_replica
from hiso.tasks.quadratic import QuadraticTask

QUAD = dict(task="quadratic", dim=30, clients=6, sampled=2, rounds=24, eval_every=8, threads=1)


def _h64(state) -> np.ndarray:
    return np.concatenate([h.detach().double().numpy().reshape(-1) for h in state.h])


@pytest.mark.parametrize("flags", [
    {}, {"h_granularity": "tensor", "h_bias_correction": True},
    {"h_stat": "denoised", "h_granularity": "model", "momentum": 0.5},
    {"local_steps": 2, "h_source": "every", "h_min": 0.5}], ids=["hiso", "tensor-bc", "denoised-model-mom", "every-clip"])
def test_snapshots_are_the_replayed_h_bit_for_bit(tmp_path, flags):
    cfg = load_config(None, **{**QUAD, **flags})
    run_to_dir(cfg, tmp_path)
    diag = dg.diagnose(tmp_path, points=4, curvature=False)
    s = diag.summary
    assert [p["round"] for p in s["points"]] == [0, 8, 16, 24]
    state, _ = rebuild(tmp_path)
    h = _h64(state)
    assert np.array_equal(np.concatenate(diag.h), h)  # bit for bit, float32 values widened
    assert s["replay_matches_model_pt"] is True
    final = s["final"]
    assert final["round"] == 24
    assert [final["h"][k] for k in dg.QNAMES] == np.quantile(h, dg.QUANTILES).tolist()
    assert final["h"]["mean"] == h.mean()
    assert [final["step"][k] for k in dg.QNAMES] == np.quantile(cfg.lr / h, dg.QUANTILES).tolist()
    for (name, _), t in zip(state.named, state.h):
        assert final["tensors"][name]["p50"] == float(np.median(t.double().numpy()))
    # a middle snapshot is the replica after that many rounds, not the final H relabelled
    mid, records, _ = start_replica(tmp_path)
    mid.replay(records[:8])
    assert [s["points"][1]["h"][k] for k in dg.QNAMES] == np.quantile(_h64(mid), dg.QUANTILES).tolist()
    assert s["points"][0]["h"]["min"] == s["points"][0]["h"]["max"] == 1.0  # H_0


def test_effective_step_is_lr_over_h_in_expectation():
    """The core's global update with scalars g_p = <H^{-1/2} u_p, grad> (the mu -> 0 limit of
    the clients' estimate along their perturbation H^{-1/2} u_p) averages to H^{-1} grad: the
    step x moves by is lr / H, as :func:`effective_step` says (not lr / sqrt(H))."""
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
    mean, se = core, ghat.std(0) / np.sqrt(n)
    want = dg.effective_step(h.numpy(), cfg.lr) / cfg.lr * grad.numpy()
    assert np.all(np.abs(mean - want) < 5 * se), (mean, want, se)
    assert not np.all(np.abs(mean - grad.numpy() / np.sqrt(h.numpy())) < 5 * se)


def test_hutchinson_and_grad2_on_the_quadratic_are_exact():
    task = QuadraticTask(5, dim=40, sigma=2.0)
    model = task.build_model()
    with torch.no_grad():
        model.x.normal_(generator=torch.Generator().manual_seed(1))
    batches = [task.batch(c, 0, 0, 0) for c in (0, 3, 3, 4)]
    (hut,) = dg.hutchinson_diag(task, model, batches, probes=2)
    torch.testing.assert_close(hut, task.lam.double(), rtol=1e-6, atol=0)  # v*v = 1 for a diagonal Hessian
    (g2,) = dg.grad_second_moment(task, model, batches)
    x = model.x.detach().double()
    want = torch.stack([(task.lam.double() * (x - task.b[c].double())) ** 2 for c in (0, 3, 3, 4)]).mean(0)
    torch.testing.assert_close(g2, want, rtol=1e-5, atol=1e-12)


def test_hutchinson_matches_the_exact_hessian_diagonal_of_an_mlp():
    from torch.func import functional_call

    task = TinyTask(num_clients=3)
    model = task.build_model()
    batch = task.batch(1, 0, 0, 16)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()

    def f(flat):
        parts, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            parts[n] = flat[i:i + k].reshape(s)
            i += k
        return task.loss(lambda x: functional_call(model.double(), parts, (x.double(),)), batch)

    hess = torch.autograd.functional.hessian(f, flat0)
    model.float()
    probes = 400
    est = torch.cat([t.reshape(-1) for t in dg.hutchinson_diag(task, model, [batch], probes=probes)])
    diag = hess.diagonal()
    sd = ((hess ** 2).sum(1) - diag ** 2).sqrt() / np.sqrt(probes)  # std of the mean of v_i (Hv)_i
    assert torch.all((est - diag).abs() <= 5 * sd + 1e-5)
    assert (hess - torch.diag(diag)).abs().max() > 1e-3  # the test is not trivially diagonal


def test_spearman_and_pearson():
    x = np.array([0.1, 0.5, 0.2, 3.0, 1.0])
    assert dg.spearman(x, x ** 3) == pytest.approx(1.0) and dg.spearman(x, -x) == pytest.approx(-1.0)
    a, b = [1, 2, 2, 3], [1, 3, 2, 4]  # ties take their average rank
    assert dg.spearman(a, b) == pytest.approx(np.corrcoef([0, 1.5, 1.5, 3], [0, 2, 1, 3])[0, 1])
    assert dg.pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert dg.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_curvature_on_a_multi_tensor_model(tmp_path):
    import hiso
    task = TinyTask(num_clients=6, seed=3)
    hiso.run(task, tmp_path, algorithm="hiso", rounds=10, sampled=2, lr=0.05, eval_every=5)
    diag = dg.diagnose(tmp_path, points=3, batches=3, probes=2, task=task)
    cur = diag.summary["curvature"]
    assert cur is not None and len(cur["tensors"]) == 8  # three Linear, one LayerNorm
    model = rebuild(tmp_path, task)[0].model
    bs = dg.unseen_batches(task, load_config(None, **{k: v for k, v in json.loads(
        (tmp_path / "config.json").read_text()).items() if k != "task_info"}), 10, 3)
    g2 = [t.numpy().reshape(-1) for t in dg.grad_second_moment(task, model, bs)]
    for t, g, hh in zip(cur["tensors"], g2, diag.h):
        assert t["grad2_mean"] == pytest.approx(g.mean(), rel=1e-12)
        assert t["grad2"]["spearman"] == dg.spearman(hh, g)
    allh, allg = np.concatenate(diag.h), np.concatenate(g2)
    assert cur["overall"]["grad2"]["spearman"] == pytest.approx(dg.spearman(allh, allg))
    assert "across tensors" in diag.text


def test_cli_writes_the_files_and_prints_the_summary(tmp_path, capsys):
    run = tmp_path / "run"
    run_to_dir(load_config(None, **QUAD), run)
    code, out, err = run_cli(["diagnose", str(run), "--points", "5", "--out", str(tmp_path / "d")], capsys)
    assert code == 0, err
    text = (tmp_path / "d" / "diagnose.txt").read_text()
    assert text in out and "H at round 24" in text and "H vs Hutchinson" in text
    s = json.loads((tmp_path / "d" / "diagnose.json").read_text())
    assert [p["round"] for p in s["points"]] == [0, 6, 12, 18, 24] and s["curvature"] is not None
    assert (tmp_path / "d" / "diagnose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (run / "diagnose.txt").exists()
    code, out, _ = run_cli(["diagnose", str(run), "--no-curvature", "--quiet"], capsys)
    assert code == 0 and out == ""
    assert json.loads((run / "diagnose.json").read_text())["curvature"] is None
    assert (run / "diagnose.png").is_file()


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    dec = tmp_path / "dec"
    run_to_dir(load_config(None, **{**QUAD, "rounds": 2, "algorithm": "decomfl"}), dec)
    nohist = tmp_path / "nohist"
    run_to_dir(load_config(None, **{**QUAD, "rounds": 2}), nohist)
    (nohist / "history.bin").unlink()
    for d, msg in ((tmp_path / "missing", "not a directory"), (tmp_path / "empty", "config.json not found"),
                   (dec, "has no preconditioner H"), (nohist, "history.bin not found")):
        code, out, err = run_cli(["diagnose", str(d)], capsys)
        assert code == 2 and msg in err and err.count("\n") == 1 and err.startswith("hiso: error:"), err
    code, _, err = run_cli(["diagnose", str(dec), "--points", "1"], capsys)
    assert code == 2
