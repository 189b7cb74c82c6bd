"""``hiso diagnose``: the replayed H is the run's own, its summaries are numpy's, the measured
curvature is right where it is known (the quadratic), and the command fails cleanly."""

import json
import shutil

import numpy as np
import pytest
import torch

from cli_helpers import run_cli
from hiso.config import load_config
from hiso.core.history import parse_history
from hiso.report.diagnose import correlations, diagnose, measure_curvature
from hiso.runners.rundir import rebuild, run_to_dir
from hiso.tasks.registry import build_task

ROUNDS = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("diag") / "run"
    cfg = load_config(task="quadratic", dim=30, clients=5, sampled=2, rounds=ROUNDS, eval_every=8,
                      algorithm="hiso", lr=0.05, h_granularity="coordinate")
    run_to_dir(cfg, out)
    return out


def test_replayed_h_is_the_runs_and_its_summaries_are_numpys(run):
    d = diagnose(run, points=5, curvature="no", progress=False)
    state, _ = rebuild(run)
    h = state.h[0].double().numpy()
    assert d["matches_model_pt"] is True
    assert [r["round"] for r in d["over_rounds"]] == [0, 6, 12, 18, 24]
    last = d["over_rounds"][-1]
    assert last["h"]["median"] == float(np.quantile(h, 0.5)) and last["h"]["max"] == float(h.max())
    assert last["step"]["median"] == float(np.quantile(0.05 / h, 0.5))
    assert last["step"]["mean"] == float(np.mean(0.05 / h))
    first = d["over_rounds"][0]  # H_0 = 1: every summary of round 0 is 1 and the step is lr
    assert all(v == 1.0 for v in first["h"].values()) and first["step"]["median"] == 0.05
    assert np.array_equal(d["_arrays"]["h"], h)
    assert d["curvature"] is None


def test_a_history_cut_short_is_reported_as_not_the_runs_h(run, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    log = parse_history(run / "history.bin")
    assert len(log.records) == ROUNDS
    data = (run / "history.bin").read_bytes()
    (cut / "history.bin").write_bytes(data[: len(data) - 40])  # the last record torn: dropped on reading
    d = diagnose(cut, points=3, curvature="no", progress=False)
    assert d["rounds"] < ROUNDS and d["matches_model_pt"] is False


def test_hutchinson_recovers_the_quadratics_hessian_diagonal_and_grad2_is_by_hand(run):
    cfg = load_config(task="quadratic", dim=30, clients=5, sampled=2, rounds=ROUNDS, algorithm="hiso", lr=0.05)
    task = build_task(cfg)
    state, _ = rebuild(run)
    cur = measure_curvature(task, state.model, state.params, first_round=ROUNDS + 1, batches=7, probes=2)
    # a diagonal Hessian: v * (H v) = v^2 lambda = lambda for every Rademacher v
    assert torch.allclose(cur.hutchinson[0], task.lam, rtol=1e-6, atol=0)
    x = state.params[0].detach()
    by_hand = sum((task.lam * (x - task.b[c % 5])) ** 2 for c in range(7)) / 7
    assert torch.allclose(cur.grad2[0], by_hand, rtol=1e-5, atol=1e-12)
    d = diagnose(run, points=3, curvature="yes", batches=7, progress=False)
    c, want = d["curvature"]["overall"]["hutchinson"], correlations(d["_arrays"]["h"], task.lam.double().numpy())
    assert c["pearson"] == pytest.approx(want["pearson"], abs=1e-6) and c["spearman"] == want["spearman"]


def test_correlations_match_numpy_and_average_tied_ranks():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    c = correlations(a, b)
    assert c["pearson"] == pytest.approx(np.corrcoef(a, b)[0, 1], abs=1e-12)
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))  # no ties: plain ranks
    assert c["spearman"] == pytest.approx(np.corrcoef(ra, rb)[0, 1], abs=1e-12)
    # ties: [1, 1, 2] ranks as [0.5, 0.5, 2]; a monotone map of it correlates perfectly
    assert correlations([1.0, 1.0, 2.0, 3.0], [5.0, 5.0, 7.0, 9.0])["spearman"] == pytest.approx(1.0)
    assert correlations([1.0, 1.0], [2.0, 3.0]) == {"pearson": None, "spearman": None}


def test_cli_writes_png_text_json_and_refuses_what_it_cannot_diagnose(run, tmp_path, capsys):
    code, out, _ = run_cli(["diagnose", str(run), "--out", str(tmp_path / "d"), "--points", "4"], capsys)
    assert code == 0 and "H at round 24" in out and "bit for bit" in out and "Hutchinson" in out
    for name in ("diagnose.png", "diagnose.txt", "diagnose.json"):
        assert (tmp_path / "d" / name).stat().st_size > 0
    saved = json.loads((tmp_path / "d" / "diagnose.json").read_text())
    assert saved["rounds"] == ROUNDS and saved["curvature"]["overall"]["hutchinson"]["pearson"] is not None
    assert (tmp_path / "d" / "diagnose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dec = tmp_path / "dec"
    run_to_dir(load_config(task="quadratic", dim=10, clients=3, sampled=2, rounds=2, algorithm="decomfl"), dec)
    for target, needle in ((dec, "no preconditioner"), (tmp_path / "missing", "not found")):
        code, _, err = run_cli(["diagnose", str(target)], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_a_foreign_history_is_refused_and_unused_parameters_have_zero_curvature(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "seed": cfg["seed"] + 1}))
    with pytest.raises(ValueError, match="history is of run seed"):
        diagnose(other, points=3, curvature="no", progress=False)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
            self.b = torch.nn.Parameter(torch.tensor([3.0]))  # never used by the loss

    class T:
        num_clients = 1

        def batch(self, *a):
            return None

        def loss(self, model, batch):
            return (model.a ** 3).sum()

    model = Two()
    cur = measure_curvature(T(), model, list(model.parameters()), first_round=0, batches=2, probes=2)
    assert torch.equal(cur.hutchinson[0], torch.tensor([6.0, 12.0]))  # d2/da2 a^3 = 6a, diagonal: exact
    assert torch.equal(cur.grad2[0], torch.tensor([9.0, 144.0]))  # (3a^2)^2
    assert torch.equal(cur.hutchinson[1], torch.zeros(1)) and torch.equal(cur.grad2[1], torch.zeros(1))


def test_noise_floor_level_is_the_floor_model_variants_h_and_lr_follows_the_decay(tmp_path):
    """The noise-floor level is H's average fed with S / (P H) from the scalars: for the
    ``floor`` statistic at ``model`` granularity that is exactly the run's own (uniform) H, up to
    its float32 rounding; and the effective step uses the round's lr under ``lr_decay``."""
    out = tmp_path / "floor"
    cfg = load_config(task="quadratic", dim=400, clients=5, sampled=2, rounds=ROUNDS, eval_every=8,
                      algorithm="hiso", lr=0.05, h_stat="floor", h_granularity="model", lr_decay=6.0)
    run_to_dir(cfg, out)
    d = diagnose(out, points=5, curvature="no", progress=False)
    levels = [r["floor_level"] for r in d["over_rounds"]]
    medians = [r["h"]["median"] for r in d["over_rounds"]]
    assert levels[0] == 1.0 and levels[-1] != 1.0  # it moved
    assert np.allclose(levels, medians, rtol=1e-5, atol=0)
    assert [r["lr"] for r in d["over_rounds"]] == [0.05 / (1 + r / 6.0) for r in (0, 6, 12, 18, 24)]
    last = d["over_rounds"][-1]
    assert last["step"]["median"] == pytest.approx(0.05 / (1 + 24 / 6.0) / medians[-1], rel=1e-6)


def test_noise_floor_level_differs_from_a_per_coordinate_h_with_signal(run):
    """On the small quadratic (d = 30, P = 5: little noise per coordinate) HiSo's H carries
    per-coordinate signal, so the level is a different number from its median: the level is
    not just a copy of H."""
    d = diagnose(run, points=3, curvature="no", progress=False)
    last = d["over_rounds"][-1]
    assert last["floor_level"] > 0 and abs(last["floor_level"] / last["h"]["median"] - 1) > 1e-3


def test_an_out_that_is_a_file_is_refused_in_one_line_before_the_work(run, tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        code, _, err = run_cli(["diagnose", str(run), "--out", str(out), "--curvature", "no"], capsys)
        assert code == 2 and "is a file" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "f").read_text() == "mine"


def test_the_per_tensor_panel_shows_at_most_the_largest_tensors(run, tmp_path, monkeypatch):
    """A full model has hundreds of tensors: the panel names the PANEL_TENSORS largest, and says so."""
    from matplotlib.figure import Figure

    from hiso.report import diagnose as diag

    d = diagnose(run, points=3, curvature="no", progress=False)
    one = d["per_tensor"][0]
    many = [{**one, "name": f"t{i}", "numel": i + 1} for i in range(diag.PANEL_TENSORS + 12)]
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    diag.plot({**d, "per_tensor": many}, tmp_path / "p.png")
    panel = next(ax for ax in saved[0].axes if ax.get_title().startswith("H per tensor"))
    names = [t.get_text() for t in panel.get_yticklabels()]
    assert len(names) == diag.PANEL_TENSORS and names[0] == f"t{len(many) - 1}"
    assert f"the {diag.PANEL_TENSORS} largest of {len(many)}" in panel.get_title()
