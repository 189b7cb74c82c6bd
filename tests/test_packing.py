"""Packed forwards for the language tasks: a batch's prompts as one row without padding give the
padded logits and losses up to float rounding (classification and SQuAD's answer tokens, hooks and
batched perturbation), a model that cannot take a packed row is found by the probe and runs
padded, the cost rule packs short prompts only, and runs record the choice (old runs resume as
they began)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli  # noqa: E402
from lm_fixtures import write_lm_files  # noqa: E402

from hiso.runners.runfiles import saved_config  # noqa: E402
from hiso.tasks import language  # noqa: E402
from hiso.tasks.language import LanguageTask, packing_pays, packing_works  # noqa: E402

WORDS = [" terrible", " great"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_lm_files(tmp_path_factory.mktemp("packing"), "sst2", "squad")


def _task(files, name="sst2", **kw):
    data = {"data_dir": files[name], "min_size": 2}
    if name == "sst2":
        data["label_words"] = WORDS
    return LanguageTask(name, 3, model=files["lm"], **data, **kw)


@pytest.fixture
def always_pack(monkeypatch):
    """Pack every batch the probe allows (the tiny model's cost rule would leave some padded)."""
    monkeypatch.setattr(language, "packing_pays", lambda mask, hidden: True)


def _perturb_adapters(model):
    with torch.no_grad():  # lora_B starts at zero: make the adapters change the logits
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("lora", [False, True])
def test_packed_logits_equal_padded_for_every_prompt(files, always_pack, lora):
    packed = _task(files, lora_r=2 if lora else None)
    padded = _task(files, lora_r=2 if lora else None, pack=False)
    model = packed.build_model()
    assert packed._pack_ok is True  # the probe accepted the Llama architecture
    if lora:
        _perturb_adapters(model)
    batch = packed._collate(packed._data["train"][:8])
    mask = batch["attention_mask"]
    assert int(mask.sum()) < mask.numel()  # the batch has padding to drop
    with torch.no_grad():
        a, b = packed._logits(model, batch, 3), padded._logits(model, batch, 3)
    assert a.shape == b.shape == (8, 3, model.config.vocab_size)
    lens = mask.sum(1)
    for i in range(8):  # positions inside each prompt agree; before it, padding is not scored
        k = min(int(lens[i]), 3)
        assert torch.allclose(a[i, 3 - k:], b[i, 3 - k:], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert abs(float(packed.loss(model, batch)) - float(padded.loss(model, batch))) < 1e-5
        assert packed.evaluate(model) == pytest.approx(padded.evaluate(model), abs=1e-5)


def test_squad_answer_loss_is_the_same_packed(files, always_pack):
    packed, padded = _task(files, "squad", lora_r=2), _task(files, "squad", lora_r=2, pack=False)
    model = packed.build_model()
    _perturb_adapters(model)
    batch = packed.batch(0, 0, 0, 6)
    with torch.no_grad():
        a, b = float(packed.loss(model, batch)), float(padded.loss(model, batch))
    assert a == pytest.approx(b, abs=1e-5) and a > 0


def test_a_model_that_ignores_packed_positions_is_probed_and_run_padded(files, always_pack):
    task = _task(files)
    model = task.build_model()

    class NoPositions(torch.nn.Module):  # attends across the packed prompts: packing would be wrong
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, position_ids=None, **kw):
            return self.inner(**kw)

    bad = NoPositions(model)
    assert packing_works(model, task.tok) and not packing_works(bad, task.tok)
    fresh = _task(files)  # a task that did not build this model probes it on first use
    batch = fresh._collate(fresh._data["train"][:8])
    with torch.no_grad():
        got = fresh._logits(bad, batch, 1)
        want = _task(files, pack=False)._logits(model, batch, 1)
    assert fresh._pack_ok is False and torch.allclose(got, want, atol=1e-6)


def test_only_batches_that_save_work_are_packed():
    def mask(lens, T):
        m = torch.zeros(len(lens), T, dtype=torch.long)
        for i, n in enumerate(lens):
            m[i, T - n:] = 1
        return m
    sst2 = mask([14] * 15 + [32], 32)  # SST-2 at 32 tokens: ~2x padding, short rows
    assert packing_pays(sst2, 576)
    squad = mask([200] * 7 + [256], 256)  # SQuAD: long rows, little padding: attention would grow
    assert not packing_pays(squad, 576)
    assert not packing_pays(mask([32] * 4, 32), 576)  # nothing to drop
    assert not packing_pays(mask([5], 32), 576)  # one prompt: nothing to pack


@pytest.mark.parametrize("mode", ["hooks", "batched"])
def test_perturbed_scalars_are_the_same_packed(files, always_pack, mode):
    from hiso.methods.hiso_method import hiso
    from hiso.core.estimator import local_update
    from hiso.core.perturb import Perturber
    from hiso.core.preconditioner import PreconditionerConfig
    from hiso.core.state import ModelState

    out = []
    for pack in (True, False):
        task = _task(files, lora_r=2, pack=pack)
        state = ModelState(task.build_model(), hiso(lr=1e-2, mu=1e-3, perturbations=3,
                                                    precond=PreconditionerConfig()))
        _perturb_adapters(state.model)
        seeds = np.arange(3, dtype=np.uint64).reshape(1, 3) + 7
        res = local_update(state, Perturber(state.model, state.params, mode), task.loss,
                           [task.batch(0, 0, 0, 8)], seeds)
        out.append(res.scalars)
    assert np.abs(out[0] - out[1]).max() < 1e-3 and np.abs(out[0]).max() > 1e-2


def test_runs_record_packing_and_old_runs_resume_padded(files, tmp_path, capsys):
    base = ["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
            "--label-words", ",".join(WORDS), "--clients", "3", "--sampled", "2", "--min-size", "2",
            "--rounds", "2", "--batch-size", "8", "--lr", "1e-2", "--lora-r", "2"]
    assert run_cli(base + ["--out", str(tmp_path / "p")], capsys)[0] == 0
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["task_opts"]["pack_sequences"] is True and cfg["task_info"]["packed_forwards"] is True
    assert run_cli(base + ["--no-pack-sequences", "--out", str(tmp_path / "u")], capsys)[0] == 0
    cfg = json.loads((tmp_path / "u" / "config.json").read_text())
    assert cfg["task_opts"]["pack_sequences"] is False and cfg["task_info"]["packed_forwards"] is False
    # a run made before the option existed (no key in config.json) was padded: it resumes padded
    del cfg["task_opts"]["pack_sequences"]
    (tmp_path / "u" / "config.json").write_text(json.dumps(cfg))
    assert saved_config(tmp_path / "u")[0].pack_sequences is False


def test_a_run_made_before_packing_continues_padded(files, tmp_path, capsys, monkeypatch):
    """Resumed, a run whose config.json predates pack_sequences runs padded, as it began."""
    seen = []
    real = language.LanguageTask._logits

    def spy(self, model, batch, keep):
        seen.append(self.pack)
        return real(self, model, batch, keep)

    monkeypatch.setattr(language.LanguageTask, "_logits", spy)
    out = tmp_path / "old"
    base = ["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
            "--label-words", ",".join(WORDS), "--clients", "3", "--sampled", "2", "--min-size", "2",
            "--batch-size", "8", "--lr", "1e-2", "--lora-r", "2", "--eval-every", "100", "--quiet"]
    assert run_cli(base + ["--rounds", "1", "--no-pack-sequences", "--out", str(out)], capsys)[0] == 0
    cfg = json.loads((out / "config.json").read_text())
    del cfg["task_opts"]["pack_sequences"]  # as written before the option existed (a task option since schema 5)
    (out / "config.json").write_text(json.dumps(cfg))
    seen.clear()
    assert run_cli(base + ["--rounds", "2", "--out", str(out), "--resume"], capsys)[0] == 0
    assert seen and not any(seen)  # every forward of the continued round was padded
    assert json.loads((out / "config.json").read_text())["task_opts"]["pack_sequences"] is False
    # the same through run_to_dir given today's default (hiso compare continues runs this way)
    from hiso.runners.rundir import run_to_dir
    (out / "config.json").write_text(json.dumps(cfg))
    seen.clear()
    given = saved_config(out)[0].model_copy(update={"pack_sequences": True, "rounds": 3})
    run_to_dir(given, out, resume=True)
    assert seen and not any(seen)
    assert json.loads((out / "config.json").read_text())["task_opts"]["pack_sequences"] is False
