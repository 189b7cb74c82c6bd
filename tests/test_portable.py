"""A run travels: moved elsewhere (with its inputs, or alone and pointed at them), it rebuilds bit
for bit, evaluates and exports from any working directory; its files and exports name no path of
the machine that made it; an exported adapter loads in a process without hiso, offline."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("safetensors")

from lm_fixtures import write_sst2, write_tiny_lm  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from hiso.cli import main  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _make(root: Path) -> Path:
    """Under ``root``: a tiny LM, SST-2 files, a method file and a LoRA run of that method."""
    files = root / "files"
    write_tiny_lm(files / "lm")
    write_sst2(files / "sst2")
    shutil.copy(EXAMPLES / "clip_method.py", files / "mine.py")
    cwd = os.getcwd()
    os.chdir(root)  # paths given relative to the working directory, as a user types them
    try:
        assert main(["run", "--task", "sst2", "--model", "files/lm", "--data-dir", "files/sst2",
                     "--algorithm", "files/mine.py:ScalarClip", "--label-words", " terrible, great",
                     "--clients", "3", "--sampled", "2", "--rounds", "3", "--min-size", "2", "--mu", "1e-2",
                     "--batch-size", "4", "--lora-r", "2", "--lr", "0.5", "--out", "runs/t1", "--quiet"]) == 0
    finally:
        os.chdir(cwd)
    return root / "runs" / "t1"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("made")
    run = _make(root)
    return root, run, torch.load(run / "model.pt", weights_only=True)


def _same_model(a: Path, ckpt: dict) -> None:
    got = torch.load(a, weights_only=True)
    assert set(got["model"]) == set(ckpt["model"])
    assert all(torch.equal(got["model"][k], ckpt["model"][k]) for k in ckpt["model"]), "not bit for bit"
    assert got["base"] == ckpt["base"]


def _last_eval(run: Path) -> dict:
    row = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    return {k: v for k, v in row.items() if k.startswith("eval_")}


def test_a_run_moved_with_its_inputs_rebuilds_evaluates_and_exports_from_anywhere(made, tmp_path, capsys,
                                                                                    monkeypatch):
    from hiso.runners.runfiles import saved_config
    from hiso.runners.runmodel import config_sha256

    root, run0, ckpt = made
    sha = config_sha256(saved_config(run0)[0])
    moved = tmp_path / "elsewhere"
    shutil.copytree(root, moved)
    shutil.rmtree(root / "files")  # nothing is read from where the run was made
    try:
        elsewhere = tmp_path / "cwd"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)  # another working directory
        run = moved / "runs" / "t1"
        code, _, err = run_cli(["rebuild", str(run), "--out", str(tmp_path / "rb.pt")], capsys)
        assert code == 0, err
        _same_model(tmp_path / "rb.pt", ckpt)
        code, _, err = run_cli(["eval", str(run), "--out", str(tmp_path / "eval.json")], capsys)
        assert code == 0, err
        assert json.loads((tmp_path / "eval.json").read_text())["metrics"] == _last_eval(run)
        code, _, err = run_cli(["export", str(run), "--out", str(tmp_path / "merged")], capsys)
        assert code == 0, err
        # the configuration's hash leaves out where its inputs are
        assert json.loads((tmp_path / "merged" / "hiso.json").read_text())["config_sha256"] == sha
    finally:
        shutil.copytree(moved / "files", root / "files")  # (for the module's other tests)


def test_a_run_moved_alone_is_pointed_at_its_inputs_and_refused_in_one_line_without(made, tmp_path, capsys,
                                                                                      monkeypatch):
    root, run0, ckpt = made
    run = tmp_path / "far" / "away" / "t1"
    shutil.copytree(run0, run)
    monkeypatch.chdir(tmp_path)
    files = root / "files"
    given = []
    for flag, path in (("--method-file", files / "mine.py"), ("--data-dir", files / "sst2"), ("--model", files / "lm")):
        code, _, err = run_cli(["rebuild", str(run), "--out", "rb.pt", *given], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err
        given += [flag, str(path)]
    assert not (tmp_path / "rb.pt").exists()
    code, _, err = run_cli(["rebuild", str(run), "--out", "rb.pt", *given], capsys)
    assert code == 0, err
    _same_model(tmp_path / "rb.pt", ckpt)
    code, _, err = run_cli(["eval", str(run), "--out", "e.json", *[g for g in given if g != "--data-dir"
                                                                   and g != str(files / "sst2")]], capsys)
    assert code == 2 and "--data-dir" in err, err  # eval's --data-dir is the run's data, or other data of the task
    code, _, err = run_cli(["eval", str(run), "--out", "e.json", *given], capsys)
    assert code == 0 and json.loads((tmp_path / "e.json").read_text())["metrics"] == _last_eval(run0), err
    code, _, err = run_cli(["export", str(run), "--out", "adapter", "--format", "peft", *given], capsys)
    assert code == 0, err
    import hiso
    from hiso.core.state import trainable_params
    from hiso.runners.portable import relocated
    with relocated(data_dir=files / "sst2", model=files / "lm", method_file=files / "mine.py"):  # the Python API
        state = hiso.rebuild(run)
    got = dict(trainable_params(state.model))
    assert got and set(got) == set(ckpt["model"]) and all(torch.equal(t, ckpt["model"][n]) for n, t in got.items())
    with pytest.raises(ValueError, match="--method-file"):
        hiso.rebuild(run)
    bad = ["--data-dir", str(tmp_path / "nope")]
    code, _, err = run_cli(["rebuild", str(run), "--out", "rb2.pt", *given, *bad], capsys)
    assert code == 2 and "--data-dir" in err and "not found" in err, err
    # continued to more rounds where it now is: its config.json still names its inputs relative to it
    code, _, err = run_cli(["run", "--resume", str(run), "--rounds", "4", "--quiet", "--method-file",
                            str(files / "mine.py"), "--data-dir", str(files / "sst2"), "--model", str(files / "lm")],
                           capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["rounds_done"] == 4
    stored = json.loads((run / "config.json").read_text())
    assert stored["task_opts"]["data_dir"] == os.path.relpath(files / "sst2", run)


def _machine_paths(d: Path, *paths: Path) -> list[str]:
    """The files under ``d`` whose bytes name any of ``paths`` (as text)."""
    words = [str(p).encode() for p in paths]
    return [str(f.relative_to(d)) for f in sorted(d.rglob("*")) if f.is_file()
            and any(w in f.read_bytes() for w in words)]


def test_no_file_of_a_run_or_its_exports_names_a_path_of_the_machine(made, tmp_path, capsys, monkeypatch):
    root, run, _ = made
    monkeypatch.chdir(tmp_path)
    outs = tmp_path / "exports"
    for fmt in ("peft", "merged", "state-dict"):
        code, _, err = run_cli(["export", str(run), "--out", str(outs / fmt), "--format", fmt], capsys)
        assert code == 0, err
    code, _, err = run_cli(["eval", str(run)], capsys)
    assert code == 0, err
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "summary.json", "model.pt", "metrics.jsonl", "eval.json"} <= names
    machine = (root.resolve(), tmp_path.resolve(), Path.home() / ".cache", Path(sys.prefix))
    assert _machine_paths(run, *machine) == []
    assert _machine_paths(outs, *machine) == []


_STRANGER = r"""
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
adapter = sys.argv[1]
base = json.load(open(adapter + "/adapter_config.json"))["base_model_name_or_path"]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[9, 10, 11, 12, 13, 14]])).logits
assert not any(m == "hiso" or m.startswith("hiso.") for m in sys.modules), "hiso was imported"
print(json.dumps(logits[0, -1].tolist()))
"""


def test_an_exported_adapter_loads_in_a_process_without_hiso_offline(made, tmp_path, capsys, monkeypatch):
    from hiso.runners.runmodel import load_run_model

    _, run, _ = made
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["export", str(run), "--out", "adapter", "--format", "peft", "--base-dir", "base"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: peft" in card.split("---")[1]
    assert all(w in card for w in ("ScalarClip", "sst2", "round 3", "up", "eval_acc", "It was"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", _STRANGER, "adapter"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.tensor(json.loads(done.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        ours = load_run_model(run).model(input_ids=torch.tensor([[9, 10, 11, 12, 13, 14]])).logits[0, -1]
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0)
    # each card's own code, as written, loads and asks the model in such a process (merged: alone)
    code, _, err = run_cli(["export", str(run), "--out", "merged", "--format", "merged"], capsys)
    assert code == 0, err
    for d in ("adapter", "merged"):
        card_code = (tmp_path / d / "README.md").read_text().split("```python\n")[1].split("```")[0]
        done = subprocess.run([sys.executable, "-c", f"DIR = {d!r}\n{card_code}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() in ("0", "1"), done.stderr[-2000:]
    # the base written is the run's: exporting again onto it is accepted, onto another model refused
    code, _, err = run_cli(["export", str(run), "--out", "adapter2", "--format", "peft", "--base-dir", "base"], capsys)
    assert code == 0, err
    write_tiny_lm(tmp_path / "other", seed=5)
    code, _, err = run_cli(["export", str(run), "--out", "adapter3", "--format", "peft", "--base-dir", "other"],
                           capsys)
    assert code == 2 and "--base-dir" in err and not (tmp_path / "adapter3").exists(), err
