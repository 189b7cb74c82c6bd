"""An option a run is given changes what it computes or is refused in one line naming the method,
whatever the method declares (hiso.methods.honour): every registered method with each option
group, methods made to declare what they do not honour, and a user's method."""

import dataclasses
import json
import textwrap

import pytest

from hiso.config import ConfigError, load_config
from hiso.methods import registry as R

from cli_helpers import run_cli

# a capability -> options that need it (a valid run of a method that honours it)
RECIPES = {
    "dp": {"dp_clip": 1.0, "dp_noise_multiplier": 1.0, "dp_delta": 1e-5},
    "secagg": {"secagg": True},
    "momentum": {"momentum": 0.9},
    "step_norm": {"step_norm": "std"},
    "lr_decay": {"lr_decay": 10.0},
    "grad_clip": {"grad_clip": 1.0},
    "int8": {"scalar_dtype": "int8"},
    "lowbit": {"scalar_dtype": "int4"},
    "structured": {"directions": "sparse"},
    "refresh": {"directions": "lowrank", "direction_refresh": 2},
    "robust": {"aggregate": "median"},
    "weighted": {"weighted": True},
    "faults": {"late_rate": 0.1},
}
# a capability -> the other runs that need it (local DP noises every scalar a client sends)
MORE = {"dp": [{**RECIPES["dp"], "dp_mode": "local"}]}
BASE = {"task": "quadratic", "dim": 20, "clients": 6, "sampled": 3, "rounds": 4}
SCALAR = [n for n in R.method_names() if R.method_info(n).family == "scalar"]


def _recipes(cap):
    return [RECIPES[cap], *MORE.get(cap, [])]


def _runs(cfg, out):
    """Two rounds of ``cfg`` run to ``out``: an accepted option must not fail once training starts."""
    from hiso.runners.rundir import run_to_dir
    summary = run_to_dir(cfg.model_copy(update={"rounds": 2, "eval_every": 2}), out)
    assert summary["rounds_done"] == 2


def test_every_recipe_names_a_capability():
    assert set(RECIPES) <= R.CAPABILITIES


@pytest.mark.parametrize("name", SCALAR)
def test_every_declared_capability_is_honoured(name, tmp_path):
    info = R.method_info(name)
    for cap in sorted(info.can & set(RECIPES)):
        if cap == "dp" and "secagg" in info.can:  # both at once as well (central DP over the secure sum)
            load_config(algorithm=name, **BASE, **RECIPES["dp"], secagg=True)
        for i, options in enumerate(_recipes(cap)):  # refused here would be a false declaration
            _runs(load_config(algorithm=name, **BASE, **options), tmp_path / f"{cap}-{i}")


@pytest.fixture
def declare(monkeypatch):
    def add(name, cap):
        info = R._REGISTRY[name]
        monkeypatch.setitem(R._REGISTRY, name, dataclasses.replace(info, can=info.can | {cap}))
    return add


@pytest.mark.parametrize("name", SCALAR)
def test_declaring_what_a_method_does_not_do_is_refused_by_name(name, declare, tmp_path):
    """Each capability a registered method lacks, declared for it: the run it needs is refused in
    one line naming the method, or builds with the option in what it computes and trains."""
    from hiso.methods.honour import unhonoured
    for cap in sorted(set(RECIPES) - R.method_info(name).can):
        declare(name, cap)
        for i, options in enumerate(_recipes(cap)):
            try:
                cfg = load_config(algorithm=name, **BASE, **options)
            except ConfigError as e:
                assert name in str(e) and "\n" not in str(e), (cap, str(e))
                continue
            assert unhonoured(cfg, cfg.zo()) is None, cap
            _runs(cfg, tmp_path / f"{cap}-{i}")


def test_greedy_declaring_dp_is_refused_for_local_noise_before_training(declare, tmp_path, capsys):
    """Greedy's uplink carries one (index, value) pair a row: a local DP client's noised answer
    has every value nonzero, so the run would fail at its first round; refused before it."""
    declare("greedy", "dp")
    code, _, err = run_cli(["run", "--quiet", "--task", "quadratic", "--dim", "20", "--rounds", "2",
                            "--algorithm", "greedy", "--dp-clip", "1", "--dp-noise-multiplier", "1",
                            "--dp-delta", "1e-5", "--dp-mode", "local", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("hiso: error: greedy: dp_mode local ") and "uplink cannot carry" in err and "'dp'" in err, err
    assert not (tmp_path / "r" / "history.bin").exists()


def test_ferret_declaring_dp_is_refused_in_one_line_exit_2(declare, tmp_path, capsys):
    """The issue's case: with dp declared, Ferret's ZOConfig would drop it (history.bin byte for
    byte the run without DP, summary.json an epsilon)."""
    declare("ferret", "dp")
    code, out, err = run_cli(["run", "--quiet", "--task", "quadratic", "--dim", "20", "--rounds", "2",
                              "--algorithm", "ferret", "--dp-clip", "1", "--dp-noise-multiplier", "1",
                              "--dp-delta", "1e-5", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "ferret" in err and "dp_clip" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r" / "history.bin").exists()


USER = '''
import numpy as np
import torch
from dataclasses import dataclass
from hiso.core import exact
from hiso.core.chain import SGD, check_record, round_lr
from hiso.core.method import Method

@dataclass(frozen=True)
class OwnStep(Method):
    """Declares momentum, but replaces the fold's step by plain SGD."""
    can = ("momentum", "dp")
    def stages(self, chain):
        return [SGD]

@dataclass(frozen=True)
class OwnFold(Method):
    """Declares momentum, step_norm and lr_decay, but folds every record itself at the base lr."""
    can = ("momentum", "step_norm", "lr_decay")

    @torch.no_grad()
    def apply_(self, state, record):
        check_record(state, record)
        for i, p in enumerate(state.params):
            for k in range(record.seeds.shape[0]):
                u = state.gen.combine(i, p.shape, record.seeds[k], record.scalars[k], None, p.device)
                exact.axpy_(p, -state.cfg.lr, u)
        state.round += 1
        return True


@dataclass(frozen=True)
class OwnFoldDecays(OwnFold):
    """Folds every record itself, reading the round's lr (lr_decay and step_norm's stage) as the chain does."""
    can = ("step_norm", "lr_decay")

    @torch.no_grad()
    def apply_(self, state, record):
        check_record(state, record)
        lr = round_lr(state, record)
        for i, p in enumerate(state.params):
            for k in range(record.seeds.shape[0]):
                u = state.gen.combine(i, p.shape, record.seeds[k], record.scalars[k], None, p.device)
                exact.axpy_(p, -lr, u)
        state.round += 1
        return True


@dataclass(frozen=True)
class OwnVote(Method):
    """Declares dp, robust and weighted, but combines by its own unweighted vote."""
    can = ("dp", "robust", "weighted")
    def combine(self, g, w, rule, trim):
        return np.sign(g.mean(axis=0))
'''


@pytest.fixture
def user(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent(USER))
    return lambda cls: f"{path}:{cls}"


@pytest.mark.parametrize("cls, options, option", [
    ("OwnStep", {"momentum": 0.9}, "momentum"),
    ("OwnVote", RECIPES["dp"], "dp_mode central"),
    ("OwnVote", {"aggregate": "median"}, "aggregate median"),
    ("OwnVote", {"weighted": True}, "weighted"),
    ("OwnFold", {"momentum": 0.9}, "momentum"),
    ("OwnFold", {"lr_decay": 2.0}, "lr_decay"),
    ("OwnFold", {"step_norm": "std"}, "step_norm"),
])
def test_a_users_method_that_drops_a_declared_option_is_refused(user, cls, options, option):
    with pytest.raises(ConfigError) as e:
        load_config(algorithm=user(cls), **BASE, **options)
    assert str(e.value).startswith(f"{user(cls)}: {option} ") and cls in str(e.value) and "\n" not in str(e.value)


def test_a_users_dp_run_it_honours_differs_and_reports_its_noises_epsilon(user, tmp_path, capsys):
    """Local DP on a user's method (its answers noised by the client, whatever its hooks): the
    log differs from the run without DP and the epsilon is the one that run's noise gives."""
    from hiso.methods.privacy import epsilon_spent
    base = ["run", "--quiet", "--algorithm", user("OwnStep"), "--task", "quadratic", "--dim", "20", "--clients", "4",
            "--sampled", "2", "--rounds", "3", "--eval-every", "3", "--lr", "0.01"]
    dp = ["--dp-clip", "1", "--dp-noise-multiplier", "2", "--dp-delta", "1e-5", "--dp-mode", "local"]
    for out, extra in (("plain", []), ("dp", dp)):
        code, _, err = run_cli([*base, *extra, "--out", str(tmp_path / out)], capsys)
        assert code == 0, err
    assert (tmp_path / "plain" / "history.bin").read_bytes() != (tmp_path / "dp" / "history.bin").read_bytes()
    priv = json.loads((tmp_path / "dp" / "summary.json").read_text())["privacy"]
    assert priv["epsilon"] == pytest.approx(epsilon_spent(2.0, priv["participations_max"], 1e-5))


@pytest.mark.parametrize("options", [{"lr_decay": 2.0}, {"step_norm": "std"}])
def test_a_users_own_fold_that_reads_the_option_runs_and_the_option_changes_the_model(user, tmp_path, options):
    from hiso.runners.rundir import run_to_dir
    cfg = load_config(algorithm=user("OwnFoldDecays"), **BASE, lr=0.05)
    run_to_dir(cfg, tmp_path / "plain")
    run_to_dir(load_config(algorithm=user("OwnFoldDecays"), **BASE, lr=0.05, **options), tmp_path / "opt")
    assert (tmp_path / "plain" / "model.pt").read_bytes() != (tmp_path / "opt" / "model.pt").read_bytes()
