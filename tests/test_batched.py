"""Batched perturbed forwards (``--perturb-mode batched``): a local step's points in one stacked
forward give hooks mode's scalars up to float rounding, on LoRA and full parameters, chunked or
not; runs made with it record the mode and rebuild bit for bit (replicas replay scalars)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli  # noqa: E402
from lm_fixtures import write_lm_files  # noqa: E402

from hiso.config import load_config, parse_size  # noqa: E402
from hiso.core.directions import DirectionGenerator  # noqa: E402
from hiso.core.estimator import local_update  # noqa: E402
from hiso.core.perturb import Perturber, Shift  # noqa: E402
from hiso.core.preconditioner import PreconditionerConfig  # noqa: E402
from hiso.core.state import ModelState  # noqa: E402
from hiso.methods.hiso_method import hiso  # noqa: E402
from hiso.tasks.language import LanguageTask  # noqa: E402

WORDS = ["great", "terrible"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_lm_files(tmp_path_factory.mktemp("batched"), "sst2")


def _task(files, lora):
    kw = {"lora_r": 2, "lora_targets": ["q_proj", "v_proj"]} if lora else {}
    # float32 forwards in both modes: "auto" takes bf16 for full parameters on a CPU with AMX
    return LanguageTask("sst2", 3, model=files["lm"], data_dir=files["sst2"], label_words=WORDS, min_size=2,
                        autocast="none", **kw)


def _scalars(files, lora, mode, difference, tau, batch_memory=None):
    task = _task(files, lora)
    cfg = hiso(lr=1e-2, mu=1e-3, perturbations=3, local_steps=tau, difference=difference,
               precond=PreconditionerConfig())
    state = ModelState(task.build_model(), cfg)
    g = torch.Generator().manual_seed(1)  # a non-trivial H, the same for both modes
    state.h = [torch.rand(p.shape, generator=g) + 0.5 for p in state.params]
    perturber = Perturber(state.model, state.params, mode, batch_memory=batch_memory)
    seeds = (np.arange(tau * 3, dtype=np.uint64) + 7).reshape(tau, 3)
    res = local_update(state, perturber, task.loss, [task.batch(0, 0, k, 8) for k in range(tau)], seeds)
    return res, [p.detach().clone() for p in state.params]


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("difference,tau", [("forward", 1), ("central", 2)])
def test_batched_scalars_equal_hooks_up_to_rounding(files, lora, difference, tau):
    hooks, x_hooks = _scalars(files, lora, "hooks", difference, tau)
    batched, x_batched = _scalars(files, lora, "batched", difference, tau)
    # a loss differs by a few float32 ulps (~1e-7 at loss 0.7); / mu = 1e-3 that is ~1e-4 in a
    # scalar, against scalars of order 0.01-1 whose perturbations differ by far more
    assert np.abs(hooks.scalars - batched.scalars).max() < 1e-3
    assert np.abs(hooks.scalars).max() > 1e-2
    assert abs(hooks.loss - batched.loss) < 1e-5
    # the model is never written, in either mode
    assert all(torch.equal(a, b) for a, b in zip(x_hooks, x_batched))


def test_chunks_give_the_unchunked_losses(files):
    task = _task(files, lora=False)
    model = task.build_model().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = DirectionGenerator()
    shifts = [Shift(gen, None, 0.0)] + [Shift(gen, s, 1e-2) for s in (3, 4, 5, 6)]
    batch = task.batch(1, 0, 0, 6)
    per_point = sum(p.numel() * 4 for p in params)
    with torch.no_grad():
        whole = Perturber(model, params, "batched").losses(task.loss, batch, shifts)
        chunked = Perturber(model, params, "batched", batch_memory=2 * per_point).losses(task.loss, batch, shifts)
        one_by_one = Perturber(model, params, "hooks").losses(task.loss, batch, shifts)
    assert len(whole) == len(chunked) == 5
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-6)
    np.testing.assert_allclose(whole, one_by_one, rtol=0, atol=1e-6)
    assert len(set(np.round(whole, 5))) > 1  # the points differ: each group saw its own shift


def test_batched_mode_refuses_a_loss_vmap_cannot_batch(files):
    task = _task(files, lora=True)
    model = task.build_model().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = DirectionGenerator()

    def item_loss(m, b):  # reads a parameter-dependent value into Python
        v = task.loss(m, b)
        return v * 0 + float(v.item())

    with torch.no_grad(), pytest.raises(RuntimeError, match="perturb-mode hooks"):
        Perturber(model, params, "batched").losses(item_loss, task.batch(0, 0, 0, 4), [Shift(gen, 1, 1e-3)])


def test_sizes_parse_and_bad_ones_are_refused(tmp_path, capsys):
    assert parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29 and parse_size("1000") == 1000
    assert load_config(None, perturb_mode="batched", batch_memory="64M").batch_memory_bytes == 64 << 20
    for bad in ("lots", "-1G", "0", "5X"):
        code, out, err = run_cli(["run", "--batch-memory", bad, "--out", str(tmp_path / bad), "--quiet"], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, (bad, err)
        assert not (tmp_path / bad).exists()


def test_batched_run_records_its_mode_and_rebuilds_bit_for_bit(files, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
            "--label-words", " terrible, great", "--clients", "3", "--sampled", "2", "--rounds", "3",
            "--eval-every", "3", "--min-size", "2", "--lr", "0.05", "--mu", "1e-2", "--batch-size", "4",
            "--lora-r", "2", "--perturb-mode", "batched", "--batch-memory", "1M", "--out", str(out), "--quiet"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["perturb_mode"] == "batched" and cfg["batch_memory"] == "1M"
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    ckpt, rb = torch.load(out / "model.pt"), torch.load(tmp_path / "rb.pt")
    assert ckpt["round"] == rb["round"] == 3
    assert all(torch.equal(ckpt["model"][k], rb["model"][k]) for k in ckpt["model"])
    # the same run in hooks mode: the same scalars up to rounding, so nearly the same model
    code, _, err = run_cli([a if a != "batched" else "hooks" for a in args[:-3]] + ["--out", str(tmp_path / "h"), "--quiet"],
                           capsys)
    assert code == 0, err
    hk = torch.load(tmp_path / "h" / "model.pt")
    moved = max(float((ckpt["model"][k] - hk["model"][k]).abs().max()) for k in ckpt["model"])
    assert moved < 1e-4
