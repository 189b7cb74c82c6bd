"""The two one-file methods of examples/ (an option of its own; fold state of its own) through
every front end, nothing in src/hiso edited: run, rebuild, resume after a kill, compare with an
option per arm, the Flower ServerApp, ``hiso.run(Class)``; and a method file edited after its
run is refused in one line."""

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hiso
from cli_helpers import run_cli
from crash_harness import Crash
from hiso.cli import main
from hiso.config import ConfigError, RunConfig, load_config
from hiso.plugins import import_object

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLIP = f"{EXAMPLES / 'clip_method.py'}:ScalarClip"
MOMENT = f"{EXAMPLES / 'second_moment_method.py'}:SecondMoment"
# (spec, an option and its value, the lr it learns with)
CASES = [(CLIP, ("c", "0.5"), "0.05"), (MOMENT, ("beta2", "0.9"), "0.01")]
IDS = ["option", "state"]
RUN = ["--task", "quadratic", "--dim", "30", "--clients", "4", "--sampled", "2", "--eval-every", "2", "--threads", "1"]


def _run(capsys, *args):
    code, out, err = run_cli(["run", "--quiet", *map(str, args)], capsys)
    assert code == 0, err
    return out


def _state(path) -> dict:
    return torch.load(path, weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else _equal(a[k], b[k]) if isinstance(a[k], dict)
        else a[k] == b[k] for k in a)


def _method_args(spec, opt, lr):
    return [*RUN, "--algorithm", spec, "--method-opt", f"{opt[0]}={opt[1]}", "--lr", lr]


@pytest.mark.parametrize("spec,opt,lr", CASES, ids=IDS)
def test_run_records_the_option_and_rebuild_gives_the_model_and_state(tmp_path, capsys, spec, opt, lr):
    out = tmp_path / "r"
    _run(capsys, *_method_args(spec, opt, lr), "--rounds", "8", "--out", out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["method_opts"] == {opt[0]: float(opt[1])}
    assert os.path.normpath(out / saved["method_source"]["file"]) == spec.split(":")[0]  # (relative to the run)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"gap"' in x]
    assert rows[-1]["gap"] < rows[0]["gap"]
    model = _state(out / "model.pt")
    if spec == MOMENT:  # v, the method's own state, is kept beside the model and is not zero any more
        assert set(model) == {"round", "model", "second_moment"}
        assert all(bool((v > 0).any()) for v in model["second_moment"].values())
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "re.pt")], capsys)
    assert code == 0, err
    assert _equal(_state(tmp_path / "re.pt"), model)
    # the option is the run's: another value gives another log
    _run(capsys, *RUN, "--algorithm", spec, "--method-opt", f"{opt[0]}=0.25", "--lr", lr, "--rounds", "8",
         "--out", tmp_path / "other")
    assert (tmp_path / "other" / "history.bin").read_bytes() != (out / "history.bin").read_bytes()


@pytest.mark.parametrize("spec,opt,lr", CASES, ids=IDS)
def test_resume_after_a_kill_gives_the_uninterrupted_run(tmp_path, capsys, spec, opt, lr):
    args = [*_method_args(spec, opt, lr), "--checkpoint-every", "2", "--quiet"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run(capsys, *args[:-1], "--rounds", "6", "--out", full)
    with Crash(cut, 16) as crash, contextlib.suppress(BaseException), \
            contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        main(["run", *args, "--rounds", "6", "--out", str(cut)])
    assert crash.dead, "the run finished before the kill: kill it earlier"
    _run(capsys, "--resume", cut)
    assert (cut / "history.bin").read_bytes() == (full / "history.bin").read_bytes()
    assert _equal(_state(cut / "model.pt"), _state(full / "model.pt"))


def test_compare_runs_an_option_per_arm_under_out_named_by_its_variant(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text(f'task = "quadratic"\ndim = 30\nclients = 4\nsampled = 2\nrounds = 4\neval_every = 2\n'
                    f'threads = 1\n\n[compare]\nalgorithms = ["clip05", "clip2", "sm"]\n'
                    f'lr_grid = {{ clip05 = [0.05], clip2 = [0.05], sm = [0.01] }}\n[compare.variants]\n'
                    f'clip05 = {{ algorithm = "{CLIP}", method_opts = {{ c = 0.5 }} }}\n'
                    f'clip2 = {{ algorithm = "{CLIP}", method_opts = {{ c = 2.0 }} }}\n'
                    f'sm = {{ algorithm = "{MOMENT}", method_opts = {{ beta2 = 0.9 }} }}\n')
    out = tmp_path / "cmp"
    code, _, err = run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    table = (out / "table.md").read_text()
    assert all(arm in table for arm in ("clip05", "clip2", "sm"))
    configs = sorted(out.glob("runs/*/*/seed*/config.json"))
    assert len(configs) == 3 and all(out in p.parents for p in configs)
    assert sorted(json.loads(p.read_text())["method_opts"].get("c", 0) for p in configs) == [0, 0.5, 2.0]


@pytest.mark.parametrize("spec,opt,lr", CASES, ids=IDS)
def test_the_flower_serverapp_runs_it_as_the_simulator_does(tmp_path, monkeypatch, spec, opt, lr):
    from seed_method_checks import assert_serverapp_runs_it_as_the_simulator
    assert_serverapp_runs_it_as_the_simulator({"algorithm": spec, "method_opts": {opt[0]: opt[1]}, "lr": float(lr)},
                                             tmp_path, monkeypatch)


@pytest.mark.parametrize("spec,opt,lr", CASES, ids=IDS)
def test_hiso_run_takes_the_class_or_an_instance(tmp_path, spec, opt, lr):
    cls = import_object(spec, "algorithm")
    kw = dict(dim=30, clients=4, sampled=2, rounds=4, eval_every=2, threads=1, lr=float(lr))
    by_class = hiso.run("quadratic", tmp_path / "cls", algorithm=cls, method_opts={opt[0]: opt[1]}, **kw)
    by_instance = hiso.run("quadratic", tmp_path / "obj", algorithm=cls(**{opt[0]: float(opt[1])}), **kw)
    for run in (by_class, by_instance):
        assert run.config["algorithm"] == spec and run.config["method_opts"] == {opt[0]: float(opt[1])}
    assert (tmp_path / "cls" / "history.bin").read_bytes() == (tmp_path / "obj" / "history.bin").read_bytes()


def test_an_edited_method_file_is_refused_until_accepted(tmp_path, capsys):
    mine = tmp_path / "mine.py"
    shutil.copyfile(EXAMPLES / "clip_method.py", mine)
    out = tmp_path / "r"
    _run(capsys, *RUN, "--algorithm", f"{mine}:ScalarClip", "--lr", "0.05", "--rounds", "4", "--out", out)
    mine.write_text(mine.read_text().replace("np.clip(", "0.5 * np.clip("))
    for args in (["rebuild", str(out), "--out", str(tmp_path / "re.pt")], ["run", "--resume", str(out), "--rounds", "6"]):
        code, _, err = run_cli(args, capsys)
        assert code == 2 and str(mine) in err and "--accept-method-change" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["run", "--quiet", "--resume", str(out), "--rounds", "6", "--accept-method-change"], capsys)
    assert code == 0, err
    source = json.loads((out / "config.json").read_text())["method_source"]
    assert source["accepted"][0]["until_round"] == 4 and source["sha256"] != source["accepted"][0]["sha256"]
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "re.pt")], capsys)  # the change is the run's now
    assert code == 0, err


def test_method_options_are_checked_against_the_methods_fields(tmp_path):
    assert load_config(None, algorithm=CLIP, method_opts=["c=0.5"]).method_opts == {"c": 0.5}
    conf = tmp_path / "m.toml"
    conf.write_text(f'algorithm = "{MOMENT}"\n[method]\nbeta2 = 0.5\neps = 1e-6\n')
    assert load_config(conf, method_opts=["eps=1e-4"]).method_opts == {"beta2": 0.5, "eps": 1e-4}
    for opts, words in ((["d=1"], "no such option (its options: c)"), (["c=abc"], "expected a number"),
                        (["c"], "expected KEY=VALUE"), (["c=-1"], "c must be > 0")):
        with pytest.raises((ConfigError, ValueError), match=words.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, algorithm=CLIP, method_opts=opts).zo()
    with pytest.raises(ConfigError, match="decomfl has no options of its own"):
        load_config(None, algorithm="decomfl", method_opts=["c=1"])
    method = load_config(None, algorithm=CLIP, method_opts=["c=0.5"]).zo().method
    assert np.array_equal(method.step_scalars(np.array([2.0, -0.2, -9.0], np.float32)),
                          np.array([0.5, -0.2, -0.5], np.float32))


def test_a_method_declaring_no_option_groups_still_reads_p_mu_and_the_difference(tmp_path):
    f = tmp_path / "bare.py"
    f.write_text("from dataclasses import dataclass\nfrom hiso.core.method import Method\n\n"
                 "@dataclass(frozen=True)\nclass Bare(Method):\n    options = frozenset()\n")
    cfg = load_config(None, algorithm=f"{f}:Bare", perturbations=3, mu=1e-2, difference="central")
    assert cfg.unused_options() == {} and cfg.zo().shape == (1, 3)


@pytest.mark.slow
@pytest.mark.parametrize("spec,opt,lr", CASES, ids=IDS)
def test_hiso_flower_deploys_it_as_hiso_run_runs_it(tmp_path, capsys, spec, opt, lr):
    """``hiso flower``: a SuperLink and two SuperNodes as processes, the method loaded from its
    file by the ServerApp and by every ClientApp; the run directory is ``hiso run``'s, bit for
    bit, and records the method's option."""
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    args = [*_method_args(spec, opt, lr), "--clients", "2", "--sampled", "2", "--rounds", "3"]
    code, _, err = run_cli(["flower", "--nodes", "2", "--round-timeout", "120",
                            "--out", str(tmp_path / "flower"), *args], capsys)
    assert code == 0, err
    _run(capsys, "--out", tmp_path / "sim", *args)
    assert (tmp_path / "flower" / "history.bin").read_bytes() == (tmp_path / "sim" / "history.bin").read_bytes()
    assert _equal(_state(tmp_path / "flower" / "model.pt"), _state(tmp_path / "sim" / "model.pt"))
    assert json.loads((tmp_path / "flower" / "config.json").read_text())["method_opts"] == {opt[0]: float(opt[1])}
