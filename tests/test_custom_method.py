"""examples/custom_method.py (FZOO's normalised step, one file, nothing in hiso edited) through
every front end: hiso run, rebuild, --resume, compare and the Flower ServerApp."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hiso.config import RunConfig
from hiso.core.history import read_history

from cli_helpers import run_cli

SPEC = f"{Path(__file__).resolve().parent.parent / 'examples' / 'custom_method.py'}:FZOO"
RUN = ["--task", "quadratic", "--dim", "30", "--clients", "4", "--sampled", "2", "--perturbations", "4",
       "--lr", "0.05", "--eval-every", "2", "--threads", "1"]


def _model(path):
    return torch.load(path, weights_only=False)


def _run(args, capsys):
    code, out, err = run_cli(["run", "--quiet", *args], capsys)
    assert code == 0, err
    return out


def test_the_hook_normalises_each_steps_scalars_by_their_spread():
    method = RunConfig(algorithm=SPEC, perturbations=4).zo().method
    g = np.array([1.0, 3.0, -2.0, 6.0], dtype=np.float32)
    want = (g.astype(np.float64) / np.std(g.astype(np.float64))).astype(np.float32)
    assert np.array_equal(method.step_scalars(g), want) and float(np.std(want.astype(np.float64))) == pytest.approx(1)
    assert np.array_equal(method.step_scalars(np.zeros(4, np.float32)), np.zeros(4, np.float32))


def test_run_logs_the_normalised_mean_and_learns(tmp_path, capsys):
    out = tmp_path / "r"
    _run([*RUN, "--algorithm", SPEC, "--rounds", "8", "--out", str(out)], capsys)
    from hiso.runners.runfiles import saved_config
    assert saved_config(out)[0].algorithm == SPEC  # (config.json: the file relative to the run directory)
    records = read_history(out / "history.bin")[2]
    _run([*RUN, "--algorithm", "decomfl", "--rounds", "8", "--out", str(tmp_path / "d")], capsys)
    plain = read_history(tmp_path / "d" / "history.bin")[2]
    # the same clients and directions, other scalars: DeComFL's forward differences, normalised
    assert [r.participants for r in records] == [r.participants for r in plain]
    assert not np.allclose(records[0].scalars, plain[0].scalars)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "gap" in x]
    assert rows[-1]["gap"] < rows[0]["gap"]


def test_rebuild_and_resume_give_the_run_bit_for_bit(tmp_path, capsys):
    full, short = tmp_path / "full", tmp_path / "short"
    _run([*RUN, "--algorithm", SPEC, "--rounds", "6", "--out", str(full)], capsys)
    _run([*RUN, "--algorithm", SPEC, "--rounds", "3", "--out", str(short)], capsys)
    code, _, err = run_cli(["run", "--quiet", "--resume", str(short), "--rounds", "6"], capsys)
    assert code == 0, err
    assert (short / "history.bin").read_bytes() == (full / "history.bin").read_bytes()
    a, b = _model(full / "model.pt"), _model(short / "model.pt")
    assert a["round"] == b["round"] == 6 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    code, _, err = run_cli(["rebuild", str(full), "--out", str(tmp_path / "re.pt")], capsys)
    assert code == 0, err
    c = _model(tmp_path / "re.pt")
    assert all(torch.equal(a["model"][k], c["model"][k]) for k in a["model"])


def test_compare_tabulates_it_beside_a_builtin_method(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text(f'task = "quadratic"\ndim = 30\nclients = 4\nsampled = 2\nperturbations = 4\nrounds = 4\n'
                    f'eval_every = 2\nthreads = 1\n\n[compare]\nalgorithms = ["decomfl", "fzoo"]\n'
                    f'lr_grid = {{ decomfl = [0.01], fzoo = [0.05] }}\n'
                    f'[compare.variants]\nfzoo = {{ algorithm = "{SPEC}" }}\n')
    code, stdout, err = run_cli(["compare", "--config", str(conf), "--out", str(tmp_path / "cmp"), "--quiet"], capsys)
    assert code == 0, err
    table = (tmp_path / "cmp" / "table.md").read_text()
    assert "fzoo" in table and "DeComFL" in table


def test_the_flower_serverapp_runs_it_as_the_simulator_does(tmp_path, monkeypatch):
    from seed_method_checks import assert_serverapp_runs_it_as_the_simulator
    assert_serverapp_runs_it_as_the_simulator({"algorithm": SPEC, "perturbations": 4}, tmp_path, monkeypatch)
