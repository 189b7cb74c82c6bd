"""Experiment tracking: TensorBoard event files (read back with tensorboard's own reader) and MLflow
runs hold what metrics.jsonl holds, per round, for hiso run and for each run of hiso compare."""

import json

import numpy as np
import pytest
import torch

from cli_helpers import run_cli
from hiso.report.tracking import Tracking, h_quantiles

RUN = ["--task", "quadratic", "--dim", "30", "--clients", "6", "--sampled", "2", "--rounds", "6",
       "--eval-every", "3", "--quiet"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_h_quantiles_are_numpys_and_min_max_stay_exact_when_subsampled():
    g = torch.Generator().manual_seed(0)
    h = [torch.rand(40, 7, generator=g), torch.rand(13, generator=g) * 5]
    allv = torch.cat([t.reshape(-1) for t in h]).numpy()
    got = h_quantiles(h)
    want = np.quantile(allv, [0.05, 0.5, 0.95])
    assert [got["h_p05"], got["h_p50"], got["h_p95"]] == pytest.approx(want, rel=1e-6)
    assert got["h_min"] == allv.min() and got["h_max"] == allv.max()
    sub = h_quantiles(h, max_values=20)  # every 15th value: quantiles approximate, extremes exact
    assert sub["h_min"] == allv.min() and sub["h_max"] == allv.max() and sub["h_p50"] != got["h_p50"]


def _scalars(logdir):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc, {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_each_rounds_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    run, tb = tmp_path / "myrun", tmp_path / "tb"
    code, _, err = run_cli(["run", "--out", str(run), "--tensorboard", str(tb), *RUN], capsys)
    assert code == 0, err
    _, got = _scalars(tb / "myrun")
    rows = _rows(run)
    for key in ("train_loss", "gap", "eval_loss", "bytes_up", "bytes_down", "wall_s"):
        want = {r["round"]: r[key] for r in rows if r.get(key) is not None}
        assert got[key].keys() == want.keys(), key
        assert all(got[key][s] == pytest.approx(v, rel=1e-6) for s, v in want.items()), key
    assert sorted(got["gap"]) == [0, 3, 6]
    for r in range(1, 7):
        assert got["round_s"][r] == pytest.approx(rows[r]["wall_s"] - rows[r - 1]["wall_s"], rel=1e-5, abs=1e-7)
    # H's quantiles each round; the last equal the final model's H
    h = list(torch.load(run / "model.pt")["h"].values())
    assert sorted(got["h_p50"]) == list(range(1, 7))
    assert got["h_p50"][6] == pytest.approx(h_quantiles(h)["h_p50"], rel=1e-6)
    assert got["h_max"][6] == pytest.approx(float(max(t.max() for t in h)), rel=1e-6)


def test_compare_tracks_every_run_tagged_with_algorithm_lr_seed(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    code, _, err = run_cli(["compare", "--out", str(tmp_path / "cmp"), "--algorithms", "hiso,decomfl", "--seeds", "0,1",
                            "--lr-grid", "hiso=0.01", "--lr-grid", "decomfl=0.02", "--tensorboard", str(tb),
                            *[a for a in RUN if a != "--quiet"], "--quiet"], capsys)
    assert code == 0, err
    for algo, lr in (("hiso", 0.01), ("decomfl", 0.02)):
        for seed in (0, 1):
            acc, got = _scalars(tb / algo / f"lr{lr!r}" / f"seed{seed}")
            run = tmp_path / "cmp" / "runs" / algo / f"lr{lr!r}" / f"seed{seed}"
            assert got["train_loss"][6] == pytest.approx(_rows(run)[6]["train_loss"], rel=1e-6)
            assert ("h_p50" in got) == (algo == "hiso")
            text = acc.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
            assert f"algorithm = {algo}" in text and f"lr = {lr}" in text and f"seed = {seed}" in text


def test_mlflow_run_holds_the_rows(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # a plain directory must work as it is
    from mlflow.tracking import MlflowClient

    from hiso.report.tracking import mlflow_uri

    store, run = tmp_path / "mlruns", tmp_path / "r"
    code, _, err = run_cli(["run", "--out", str(run), "--mlflow", str(store), *RUN], capsys)
    assert code == 0, err
    c = MlflowClient(tracking_uri=mlflow_uri(str(store)))
    (mr,) = c.search_runs([c.get_experiment_by_name("hiso").experiment_id])
    assert mr.data.tags["algorithm"] == "hiso" and mr.data.params["dim"] == "30" and mr.info.status == "FINISHED"
    hist = {m.step: m.value for m in c.get_metric_history(mr.info.run_id, "train_loss")}
    assert hist == pytest.approx({r["round"]: r["train_loss"] for r in _rows(run)[1:]}, rel=1e-12)


def test_a_missing_tracker_package_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "mlflow")
                        else real(name, *a))
    with pytest.raises(ValueError, match=r"-e .\.\[track\]. in hiso.s clone"):
        Tracking(tensorboard="x").check()
    code, _, err = run_cli(["run", "--out", str(tmp_path / "r"), "--mlflow", str(tmp_path / "m"), *RUN], capsys)
    assert code == 2 and "pip install -e '.[track]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists() and not (tmp_path / "m").exists()


def test_the_python_api_tracks_a_run_as_the_command_line_does(tmp_path):
    pytest.importorskip("tensorboard")
    import hiso
    run = hiso.run("quadratic", tmp_path / "apirun", tensorboard=tmp_path / "tb", dim=20, clients=4, sampled=2,
                   rounds=4, eval_every=2)
    _, got = _scalars(tmp_path / "tb" / "apirun")
    assert {r["round"]: r["train_loss"] for r in run.metrics[1:]} == pytest.approx(got["train_loss"])


def test_the_python_api_says_when_a_tracker_is_not_installed(tmp_path, monkeypatch):
    import sys

    import hiso
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(Exception, match="mlflow"):
        hiso.run("quadratic", tmp_path / "r", mlflow=str(tmp_path / "ml"), dim=20, clients=4, sampled=2, rounds=2)
    assert not (tmp_path / "r").exists()
