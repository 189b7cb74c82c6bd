"""Runs on another device (--device): the task wrapper that moves models, the refusal where the
device is missing, and, where a GPU exists, a CUDA run rebuilt bit for bit on the GPU and the CPU."""

import json

import pytest
import torch

from cli_helpers import run_cli
from hiso.config import load_config
from hiso.runners.rundir import rebuild, run_to_dir
from hiso.tasks.device import OnDevice, on_device
from hiso.tasks.registry import build_task

TINY = ["--task", "quadratic", "--dim", "40", "--clients", "6", "--sampled", "3", "--rounds", "12",
        "--eval-every", "4", "--quiet"]


def _cfg(**kw):
    return load_config(task="quadratic", dim=40, clients=6, sampled=3, rounds=12, eval_every=4, **kw)


def test_a_wrapped_task_runs_exactly_like_the_task(tmp_path):
    cfg = _cfg(algorithm="hiso", momentum=0.5)
    plain = run_to_dir(cfg, tmp_path / "plain")
    wrapped_task = OnDevice(build_task(cfg), "cpu")  # forced, though cpu needs no wrapper
    wrapped = run_to_dir(cfg, tmp_path / "wrapped", task=wrapped_task)
    a, b = torch.load(tmp_path / "plain" / "model.pt"), torch.load(tmp_path / "wrapped" / "model.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["h"][k], b["h"][k]) for k in a["h"])
    assert plain["final"] == wrapped["final"]
    info = json.loads((tmp_path / "wrapped" / "config.json").read_text())["task_info"]
    assert info["device"] == "cpu"
    # attributes read and written go to the task itself
    wrapped_task.some_flag = 3
    assert wrapped_task.task.some_flag == 3 and wrapped_task.dim == 40
    assert on_device(wrapped_task, "cuda") is wrapped_task  # never wrapped twice
    assert on_device(wrapped_task.task, "cpu") is wrapped_task.task


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")
def test_a_missing_cuda_device_is_one_line_and_leaves_no_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--device", "cuda", *TINY], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "CUDA" in err and "--device cpu" in err
    assert not out.exists()
    code, _, err = run_cli(["run", "--out", str(out), "--device", "gpu", *TINY], capsys)
    assert code == 2 and "device" in err
    assert run_cli(["run", "--out", str(out), *TINY], capsys)[0] == 0
    for device, needle in (("cuda", "CUDA"), ("gpu", "unknown device")):
        code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "m.pt"), "--device", device], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the CUDA run and its "
                                "CPU rebuild run only where a GPU exists")


@needs_cuda
@pytest.mark.parametrize("directions", ["philox-rademacher", "philox-gaussian"])
def test_a_cuda_run_is_rebuilt_bit_for_bit_on_the_gpu_and_on_the_cpu(tmp_path, directions):
    cfg = _cfg(algorithm="hiso", device="cuda", mode="faithful", directions=directions)
    run_to_dir(cfg, tmp_path / "run")  # faithful: every client's replica checked against the server
    saved = torch.load(tmp_path / "run" / "model.pt")
    assert all(t.device.type == "cpu" for t in saved["model"].values())
    for device in ("cuda", "cpu"):
        state, ckpt = rebuild(tmp_path / "run", device=device)
        assert state.params[0].device.type == device
        assert all(torch.equal(saved["model"][k], ckpt["model"][k]) for k in saved["model"]), device
        assert all(torch.equal(saved["h"][k], ckpt["h"][k]) for k in saved["h"]), device
