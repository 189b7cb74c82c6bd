"""The Python API (import hiso), users' own tasks on the command line, and the example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hiso
from cli_helpers import run_cli
from conftest import TinyTask, run_within

ROOT = Path(__file__).resolve().parents[1]

# A user's task module, written outside the package: a regression whose metric is maximised
# although its name does not say so (the task declares it), with its own default lr.
USER_TASK = textwrap.dedent('''
    import numpy as np
    import torch
    from torch import nn

    import hiso


    class Ridge(hiso.Task):
        """A tiny federated regression."""

        metrics = {"eval_score": "max", "eval_loss": "min"}
        default_lr = {"zo": 0.02, "first-order": 0.1}

        def __init__(self, num_clients, seed=0):
            super().__init__(num_clients, seed)
            g = torch.Generator().manual_seed(seed)
            self.X = torch.randn(num_clients, 24, 5, generator=g)
            self.Y = self.X @ torch.randn(5, 1, generator=g)

        def build_model(self):
            with torch.random.fork_rng():
                torch.manual_seed(self.seed)
                return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))

        def batch(self, client, round, step, batch_size):
            rng = np.random.default_rng([self.seed, client, round, step])
            idx = torch.as_tensor(rng.choice(24, size=min(batch_size, 24), replace=False))
            return self.X[client, idx], self.Y[client, idx]

        def loss(self, model, batch):
            x, y = batch
            return ((model(x) - y) ** 2).mean()

        @torch.no_grad()
        def evaluate(self, model):
            mse = float(((model(self.X.reshape(-1, 5)) - self.Y.reshape(-1, 1)) ** 2).mean())
            return {"eval_score": -mse, "eval_loss": mse}


    NotATask = object
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``usertask.py`` in a directory of its own, importable as ``usertask``."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "usertask.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(d))
    yield d / "usertask.py"
    sys.modules.pop("usertask", None)


def _model_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ Python API

def test_run_read_metrics_and_rebuild_exactly(tmp_path):
    task = TinyTask(num_clients=6, seed=3)
    rows = []
    run = hiso.run(task, tmp_path / "r", algorithm="hiso", rounds=12, sampled=2, lr=0.05, eval_every=4,
                   progress=rows.append)
    assert [r["round"] for r in run.metrics] == list(range(13)) and len(rows) == 13
    assert run.config["clients"] == 6 and run.config["seed"] == 3  # the task's
    assert run.summary["rounds_done"] == 12 and run.metrics[-1]["eval_loss"] == run.summary["final"]["eval_loss"]
    rebuilt = hiso.rebuild(tmp_path / "r", task)
    ckpt = run.checkpoint()
    assert rebuilt.round == 12 and _model_equal(rebuilt.model.state_dict(), ckpt["model"])
    assert all(torch.equal(h, ckpt["h"][n]) for (n, _), h in zip(rebuilt.named, rebuilt.h))
    assert _model_equal(run.model(task).state_dict(), ckpt["model"])
    assert not _model_equal(task.build_model().state_dict(), ckpt["model"])  # it did train


def test_federation_steps_in_process_like_a_run(tmp_path):
    task = TinyTask(num_clients=5, seed=1)
    runner = hiso.federation(task, algorithm="decomfl", rounds=6, sampled=2, lr=0.05, eval_every=3)
    rows = list(runner.run(6))
    run = hiso.run(task, tmp_path / "r", algorithm="decomfl", rounds=6, sampled=2, lr=0.05, eval_every=3)
    assert [{k: v for k, v in r.items() if k not in ("wall_s", "client_s")} for r in rows] == \
           [{k: v for k, v in r.items() if k not in ("wall_s", "client_s")} for r in run.metrics]
    assert _model_equal(runner.state_dict()["model"], run.checkpoint()["model"])


def test_a_task_class_declares_its_default_lr_and_metric_direction(tmp_path, user_module):
    import usertask
    task = usertask.Ridge(4, seed=0)
    assert hiso.run_config(task, algorithm="hiso").lr == 0.02
    assert hiso.run_config(task, algorithm="fedavg").lr == 0.1
    run = hiso.run(task, tmp_path / "r", rounds=6, sampled=2, eval_every=2)
    scores = [r["eval_score"] for r in run.metrics if "eval_score" in r]
    assert run.summary["best"]["eval_score"] == max(scores) != min(scores)  # "max": the highest is best
    assert run.summary["best"]["eval_loss"] == min(r["eval_loss"] for r in run.metrics if "eval_loss" in r)


def test_resume_from_python_continues_only_the_same_run(tmp_path):
    task = TinyTask(num_clients=5, seed=1)
    kw = dict(algorithm="hiso", sampled=2, lr=0.05, eval_every=2)
    full = hiso.run(task, tmp_path / "full", rounds=8, **kw)
    cut = hiso.run(task, tmp_path / "cut", rounds=4, **kw)
    with pytest.raises(ValueError, match="holds another run"):  # another lr or algorithm: refused
        hiso.run(task, cut.dir, rounds=8, resume=True, **{**kw, "lr": 0.5})
    with pytest.raises(ValueError, match="algorithm"):
        hiso.run(task, cut.dir, rounds=8, resume=True, **{**kw, "algorithm": "decomfl"})
    again = hiso.run(task, cut.dir, rounds=8, resume=True, **kw)  # the same run to more rounds
    assert _model_equal(again.checkpoint()["model"], full.checkpoint()["model"])
    assert _model_equal(hiso.rebuild(cut.dir, task).model.state_dict(), full.checkpoint()["model"])
    fresh = hiso.run(task, tmp_path / "new", rounds=2, resume=True, **kw)  # nothing there: it starts
    assert fresh.summary["rounds_done"] == 2


def test_run_from_python_refuses_a_directory_holding_a_run_unless_forced(tmp_path):
    task = TinyTask(num_clients=5, seed=1)
    first = hiso.run(task, tmp_path / "r", rounds=2, sampled=2, lr=0.05)
    (first.dir / "eval.json").write_text("{}")
    (first.dir / "mine.txt").write_text("kept")
    with pytest.raises(FileExistsError, match="force=True replaces it"):
        hiso.run(task, first.dir, rounds=3, sampled=2, lr=0.05)
    assert first.summary["rounds_done"] == 2
    second = hiso.run(task, first.dir, rounds=3, sampled=2, lr=0.05, force=True)
    assert second.summary["rounds_done"] == 3 and not (first.dir / "eval.json").exists()
    assert (first.dir / "mine.txt").read_text() == "kept"


@pytest.mark.parametrize("options, needle", [
    ({"seed": 5}, "seed=5: the task object was built with seed 1"),
    ({"clients": 16}, "clients=16: the task object was built with clients 5"),
    ({"lora_r": 8}, "lora_r=8: a task object is built already"),
    ({"data_dir": "/data"}, "data_dir='/data'"),
])
def test_options_that_would_contradict_a_task_object_are_refused(tmp_path, options, needle):
    task = TinyTask(num_clients=5, seed=1)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        hiso.run(task, tmp_path / "r", rounds=2, sampled=2, **options)
    assert not (tmp_path / "r").exists()
    # the task's own values, given again, are fine
    assert hiso.run_config(task, seed=1, clients=5, lr=0.05).seed == 1


def test_a_runconfig_without_an_lr_takes_the_tasks_default(user_module):
    import usertask
    task = usertask.Ridge(4, seed=0)
    assert hiso.run_config(task, hiso.RunConfig(rounds=2, sampled=2)).lr == 0.02  # Ridge's, not the quadratic's
    assert hiso.run_config(task, hiso.RunConfig(rounds=2, sampled=2, lr=0.3)).lr == 0.3


def test_run_takes_a_built_in_tasks_name_and_rejects_a_class(tmp_path):
    run = hiso.run("quadratic", tmp_path / "q", rounds=3, dim=10, clients=4, sampled=2, eval_every=3)
    assert run.config["task"] == "quadratic" and run.config["task_opts"]["dim"] == 10 and run.summary["rounds_done"] == 3
    with pytest.raises(TypeError, match=r"TinyTask\(num_clients=8, seed=0\)"):
        hiso.run(TinyTask, tmp_path / "c", rounds=2)
    with pytest.raises(TypeError, match="not int"):
        hiso.run(3, tmp_path / "c", rounds=2)


def test_a_relative_task_file_is_recorded_by_its_absolute_path(tmp_path, monkeypatch, user_module):
    monkeypatch.chdir(Path(user_module).parent)
    cfg = hiso.RunConfig(task="usertask.py:Ridge", clients=4, sampled=2)
    assert cfg.task == f"{Path(user_module).resolve()}:Ridge"


# ------------------------------------------------------------------ a user's task on the command line

@pytest.mark.parametrize("form", ["module", "path"])
def test_hiso_run_and_rebuild_a_task_from_outside_the_package(tmp_path, capsys, user_module, form):
    spec = "usertask:Ridge" if form == "module" else f"{user_module}:Ridge"
    out = tmp_path / "run"
    code, stdout, err = run_cli(["run", "--task", spec, "--clients", "5", "--sampled", "2", "--rounds", "8",
                                 "--eval-every", "4", "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["lr"] == 0.02  # the task's own default lr
    from hiso.runners.runfiles import saved_config
    assert saved_config(out)[0].task == spec  # (a file: config.json names it relative to the run directory)
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "m.pt")], capsys)
    assert code == 0, err
    rebuilt = torch.load(tmp_path / "m.pt", weights_only=True)
    assert _model_equal(rebuilt["model"], torch.load(out / "model.pt", weights_only=True)["model"])


@pytest.mark.slow
def test_hiso_compare_a_user_task_selects_by_its_declared_direction(tmp_path, capsys, user_module):
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "--task", f"{user_module}:Ridge", "--algorithms", "hiso,decomfl",
                                 "--lr-grid", "hiso=0.001,0.03", "--lr-grid", "decomfl=0.001,0.03",
                                 "--clients", "5", "--sampled", "2", "--rounds", "10", "--eval-every", "5",
                                 "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    sel = json.loads((out / "selection.json").read_text())
    assert sel["metric"] == "eval_score" and sel["higher_is_better"] is True  # the task's first metric
    for arm in sel["arms"].values():
        means = {g["lr"]: g["mean_best"] for g in arm["grid"]}
        assert arm["chosen_lr"] == max(means, key=means.get)
    assert "eval_score" in stdout


@pytest.mark.parametrize("spec, needle", [
    ("nosuchmodule_xyz:Task", "cannot import nosuchmodule_xyz"),
    ("usertask:Missing", "has no 'Missing'"),
    ("usertask:NotATask", "not a subclass of hiso.Task"),
    ("no/such/file.py:Task", "not found"),
    ("mnist2", "unknown task 'mnist2'"),
])
def test_a_bad_task_name_is_one_line_and_exit_2(tmp_path, capsys, user_module, spec, needle):
    code, _, err = run_cli(["run", "--task", spec, "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ the example

@pytest.mark.slow
def test_the_example_runs_and_rebuilds_exactly(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_within([sys.executable, str(ROOT / "examples" / "custom_task.py"), "--out", str(tmp_path / "ex"),
                       "--rounds", "20"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "bit-identical to the server's model and H" in proc.stdout
    assert json.loads((tmp_path / "ex" / "summary.json").read_text())["rounds_done"] == 20


def test_a_task_object_the_command_line_cannot_rebuild_is_one_line(tmp_path, capsys):
    from hiso.tasks.vision import VisionTask
    task = VisionTask("mnist", 4, seed=0, eval_max=50)
    run = hiso.run(task, tmp_path / "v", rounds=1, sampled=2, eval_every=1)
    assert run.config["task"] == "hiso.tasks.vision:VisionTask" and run.config["lr"] == 2e-3  # mnist's default
    from hiso.tasks import registry
    registry._SPEC_CACHE.pop(run.config["task"])  # as in another process: the name is all there is
    code, _, err = run_cli(["eval", str(run.dir)], capsys)
    assert code == 2 and "cannot be built from a run configuration" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("algorithm", ["hiso", "fedavg", "fedkseed"])
def test_a_federation_run_twice_continues_where_it_stands(algorithm):
    task = TinyTask(num_clients=5, seed=1)
    kw = dict(algorithm=algorithm, rounds=5, sampled=2, lr=0.05, eval_every=1,
              **({"perturbations": 1} if algorithm == "fedkseed" else {}))
    whole = [{k: v for k, v in r.items() if k not in ("wall_s", "client_s")} for r in hiso.federation(task, **kw).run(5)]
    runner = hiso.federation(task, **kw)
    first, second = list(runner.run(3)), list(runner.run(5))
    assert [r["round"] for r in first] == [0, 1, 2, 3] and [r["round"] for r in second] == [4, 5]
    got = [{k: v for k, v in r.items() if k not in ("wall_s", "client_s")} for r in first + second]
    assert [r["eval_loss"] for r in got] == [r["eval_loss"] for r in whole]  # the 5-round run's rows
    with pytest.raises(ValueError, match="at round 5"):
        runner.run(2)


def test_a_declared_metric_that_evaluate_does_not_return_is_refused(tmp_path):
    class Misnamed(TinyTask):
        metrics = {"accuracy": "max"}  # evaluate() returns eval_loss
    with pytest.raises(ValueError, match="declares the metric 'accuracy' but its evaluate\\(\\) returned eval_loss"):
        hiso.run(Misnamed(num_clients=4, seed=0), tmp_path / "r", rounds=2, sampled=2, lr=0.05)


SIZED_TASK = USER_TASK.replace("def __init__(self, num_clients, seed=0):", "def __init__(self, num_clients, seed=0, rows=24):") \
    .replace("self.X = torch.randn(num_clients, 24, 5, generator=g)",
             "self.rows = rows\n        self.X = torch.randn(num_clients, rows, 5, generator=g)") \
    .replace("idx = torch.as_tensor(rng.choice(24, size=min(batch_size, 24), replace=False))",
             "idx = torch.as_tensor(rng.choice(self.rows, size=min(batch_size, self.rows), replace=False))") \
    + "\n\ndef _describe(self):\n    return {'rows': self.rows}\n\n\nRidge.describe = _describe\n"


def test_a_task_rebuilt_otherwise_than_the_run_is_named_not_silently_evaluated(tmp_path, capsys, monkeypatch):
    # A task whose constructor takes more than (num_clients, seed) and gives no from_config is
    # rebuilt by eval/rebuild with its defaults: its metrics would silently not be the run's.
    d = tmp_path / "mod"
    d.mkdir()
    (d / "sizedtask.py").write_text(SIZED_TASK)
    monkeypatch.syspath_prepend(str(d))
    try:
        import sizedtask
        out = tmp_path / "run"
        hiso.run(sizedtask.Ridge(4, seed=0, rows=12), out, rounds=2, eval_every=1)
        from hiso.tasks.registry import _SPEC_CACHE
        _SPEC_CACHE.pop("sizedtask:Ridge")  # as a new process (hiso eval) knows it: by import, from_config
        code, _, err = run_cli(["eval", str(out)], capsys)
        assert code == 0, err
        assert "hiso: warning:" in err and "rows 24 here, 12 in the run" in err and "from_config" in err
        with pytest.warns(hiso.TaskMismatchWarning, match="the task object given"):  # from Python as well
            hiso.rebuild(out, sizedtask.Ridge(4, seed=0, rows=20))
        with pytest.raises(ValueError, match="rows 20 here, 12 in the run; continuing the run on it would mix"):
            hiso.run(sizedtask.Ridge(4, seed=0, rows=20), out, rounds=3, eval_every=1, resume=True)
        assert json.loads((out / "config.json").read_text())["task_info"] == {"rows": 12}  # the run is as it was
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error", hiso.TaskMismatchWarning)
            hiso.rebuild(out, sizedtask.Ridge(4, seed=0, rows=12))  # the run's own task: no warning
    finally:
        sys.modules.pop("sizedtask", None)


def test_evaluate_and_export_from_python_give_the_runs_model_and_metrics(tmp_path):
    task = TinyTask(num_clients=4, seed=1)
    run = hiso.run(task, tmp_path / "r", algorithm="decomfl", rounds=6, sampled=2, lr=0.05, eval_every=3)
    last = hiso.evaluate(run.dir, task)
    assert last["round"] == 6 and last["metrics"]["eval_loss"] == run.metrics[-1]["eval_loss"]  # the run's own
    mid = hiso.evaluate(run.dir, task, round=3)  # x_3 replayed from the log
    assert mid["round"] == 3 and mid["metrics"]["eval_loss"] == run.metrics[3]["eval_loss"]
    with pytest.raises(ValueError, match="holds its own data"):
        hiso.evaluate(run.dir, task, eval_max=5)
    done = hiso.export(run.dir, tmp_path / "exp", task=task)
    assert done["format"] == "state-dict" and done["round"] == 6
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "exp" / next(f for f in done["files"] if f.endswith(".safetensors")))
    assert _model_equal(saved, run.checkpoint()["model"])
    with pytest.raises(ValueError, match="merged"):
        hiso.export(run.dir, tmp_path / "exp2", format="merged", task=task)


def test_compare_from_python_writes_the_table_and_resumes(tmp_path):
    out = tmp_path / "cmp"
    grid = {"hiso": [0.02, 0.05], "decomfl": [0.05]}
    first = hiso.compare("quadratic", out, lr_grid=grid, seeds=[0], rounds=4, dim=20, eval_every=2, plots=False)
    assert {r["algorithm"] for r in first.rows} >= {"hiso", "decomfl"} and "hiso" in first.table
    chosen = first.selection["arms"]["hiso"]["chosen_lr"]
    assert chosen in grid["hiso"]
    assert first.run("hiso", chosen, 0).summary["rounds_done"] == 4
    log = first.run("decomfl", 0.05, 0).dir / "metrics.jsonl"
    before = log.stat().st_mtime_ns
    again = hiso.compare("quadratic", out, lr_grid=grid, seeds=[0], rounds=4, dim=20, eval_every=2, plots=False)
    assert again.table == first.table and log.stat().st_mtime_ns == before  # finished runs reused, not rerun
    with pytest.raises(TypeError, match="each seed of a comparison builds its own task"):
        hiso.compare(TinyTask(2, 0), out)
