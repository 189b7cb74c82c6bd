"""``hiso flower`` with relative paths, as a user types them: the data and model directories mean
the same place for the ServerApp and the nodes (which run in other working directories) as for
the command, and a missing one is refused in one line before a federation is started."""

from __future__ import annotations

import importlib.util
import json

import pytest

from cli_helpers import run_cli
from conftest import wait_exit
from lm_fixtures import write_sst2, write_tiny_lm

pytestmark = [
    pytest.mark.flower,
    pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="the flower extra is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs the llm extra"),
]

ARGS = ["--task", "sst2", "--model", "files/lm", "--data-dir", "files/sst2", "--label-words", " terrible, great",
        "--clients", "2", "--nodes", "2", "--sampled", "2", "--rounds", "1", "--min-size", "2", "--batch-size", "4",
        "--lora-r", "2", "--lr", "0.5", "--eval-max", "4"]


def test_relative_data_and_model_directories_reach_the_serverapp_and_the_nodes(tmp_path, spawned):
    write_tiny_lm(tmp_path / "files" / "lm")
    write_sst2(tmp_path / "files" / "sst2")
    p = spawned.hiso("flower", *ARGS, "--out", "runs/fl", cwd=tmp_path)
    assert wait_exit(p, within_s=900) == 0, p.log.read_text()[-4000:]
    out = tmp_path / "runs" / "fl"
    assert json.loads((out / "summary.json").read_text())["rounds_done"] == 1
    stored = json.loads((out / "config.json").read_text())
    assert stored["task_opts"]["data_dir"] == "../../files/sst2" and stored["task_opts"]["model"] == "../../files/lm"


def test_a_missing_data_directory_is_refused_before_the_federation_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["flower", *ARGS, "--out", "runs/fl"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--data-dir files/sst2" in err, err
    assert not (tmp_path / "runs").exists()
