"""Options that would not do what they say are refused or named: a task option the task does not
read, a number given as true/false, an abbreviated flag; options the algorithm never reads are
named when the run starts; a comparison's config file also configures one run; Ctrl-C exits 130."""

import json

import numpy as np
import pytest

from cli_helpers import run_cli
from hiso.config import ConfigError, load_config
from hiso.tasks.registry import TASK_OPTIONS, build_task, task_info

TINY = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2", "--rounds", "4",
        "--eval-every", "2", "--quiet"]


@pytest.mark.parametrize("args, needle", [
    (["--task", "mnist", "--lora-r", "8", "--lr", "1e-3"], "lora_r = 8: task mnist does not use it (it is for sst2"),
    (["--data-dir", "/data/mnist"], "did you mean to give --task?"),
    (["--task", "mnist", "--model", "gpt2"], "model = 'gpt2': task mnist does not use it"),
    (["--task", "sst2", "--data-dir", "/d", "--max-new-tokens", "4"], "(it is for squad, instruct)"),
    (["--task", "squad", "--data-dir", "/d", "--label-words", " no, yes"], "label_words"),
    (["--dim", "20", "--eval-max", "5"], "eval_max = 5: task quadratic does not use it"),
])
def test_a_task_option_the_task_does_not_read_is_refused(tmp_path, capsys, args, needle):
    out = tmp_path / "x"
    code, _, err = run_cli(["run", "--out", str(out), "--quiet", *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_every_builtin_task_declares_task_options_only():
    for name in ("quadratic", "mnist", "fashion-mnist", "sst2", "qqp", "squad", "text", "instruct"):
        info = task_info(name)
        assert info.options is not None and info.options <= TASK_OPTIONS
    # and what it declares it reads is accepted (defaults aside, each is a real knob of the task)
    assert {"data_dir", "train_max", "val_fraction"} <= task_info("mnist").options
    assert "lora_r" in task_info("sst2").options and "lora_r" not in task_info("mnist").options


def test_vision_train_max_trains_on_a_seeded_subset():
    full = build_task(load_config(task="mnist", clients=4))
    small = build_task(load_config(task="mnist", clients=4, train_max=300))
    again = build_task(load_config(task="mnist", clients=4, train_max=300))
    other = build_task(load_config(task="mnist", clients=4, train_max=300, seed=1))
    assert small.describe()["n_train"] == 300 < full.describe()["n_train"]
    assert sum(len(p) for p in small.parts) == 300
    assert np.array_equal(small.data.y_train.numpy(), again.data.y_train.numpy())
    assert all(np.array_equal(a, b) for a, b in zip(small.parts, again.parts))
    # the subset's images are images of the full training set
    rows = {bytes(x.numpy()) for x in full.data.x_train}
    assert all(bytes(x.numpy()) in rows for x in small.data.x_train[:50])
    seed1_full = build_task(load_config(task="mnist", clients=4, seed=1))
    rows1 = {bytes(x.numpy()) for x in seed1_full.data.x_train}
    assert all(bytes(x.numpy()) in rows1 for x in other.data.x_train[:50])
    assert not np.array_equal(small.data.y_train.numpy(), other.data.y_train.numpy())


@pytest.mark.parametrize("text, needle", [("rounds = true", "rounds = true: expected an integer"),
                                          ("lr = false", "lr = false: expected a number")])
def test_a_number_given_as_true_or_false_is_refused(tmp_path, capsys, text, needle):
    conf = tmp_path / "c.toml"
    conf.write_text(text + "\n")
    code, _, err = run_cli(["run", "--config", str(conf), "--out", str(tmp_path / "x"), "--quiet"], capsys)
    assert code == 2 and needle in err, err
    with pytest.raises(ConfigError, match="true/false"):
        load_config(conf)


def test_run_reads_the_shared_options_of_a_comparison_config(tmp_path, capsys):
    conf = tmp_path / "cmp.toml"
    conf.write_text('task = "quadratic"\ndim = 30\nclients = 4\nsampled = 2\nrounds = 3\neval_every = 3\n\n'
                    '[compare]\nalgorithms = ["hiso", "decomfl"]\nseeds = [0, 1]\n\n[compare.lr_grid]\nhiso = [0.05]\n')
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--config", str(conf), "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert (saved["task_opts"]["dim"], saved["clients"], saved["rounds"]) == (30, 4, 3)
    conf.write_text('dim = 30\n[compar]\nseeds = [0]\n')  # a misspelled table is still an unknown key
    code, _, err = run_cli(["run", "--config", str(conf), "--out", str(tmp_path / "y"), "--quiet"], capsys)
    assert code == 2 and "compar" in err


def test_an_abbreviated_flag_is_refused(tmp_path, capsys):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), "--round", "5", *TINY], capsys)
    assert code == 2 and "--round" in err
    assert not (tmp_path / "x").exists()


def test_options_the_algorithm_never_reads_are_named(tmp_path, capsys):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "a"), "--algorithm", "decomfl", "--nu", "0.5",
                            "--server-lr", "2", *TINY], capsys)
    assert code == 0
    assert "decomfl does not use nu (HiSo's preconditioner); server_lr" in err and "no effect" in err
    code, _, err = run_cli(["run", "--out", str(tmp_path / "b"), "--algorithm", "hiso", "--nu", "0.5", *TINY], capsys)
    assert code == 0 and "does not use" not in err
    cfg = load_config(algorithm="fedadam", server_lr=0.1, beta1=0.5, seed_pool=64)
    assert cfg.unused_options() == {"seed_pool": "fedkseed's"}
    # ferret and the first-order baselines take no zeroth-order estimate: P, mu, the difference
    cfg = load_config(algorithm="ferret", perturbations=8, mu=1e-2, difference="central")
    assert cfg.unused_options() == dict.fromkeys(["perturbations", "mu", "difference"], "the zeroth-order estimate's")
    assert load_config(algorithm="fedavg", mu=1e-2).unused_options() == {"mu": "the zeroth-order estimate's"}
    assert load_config(algorithm="fedzo", perturbations=8, mu=1e-2).unused_options() == {}
    assert load_config(algorithm="feedsign", mu=1e-2).unused_options() == {}
    # options that act only with another: an attack without attackers, a trim without the trimmed mean, ...
    cfg = load_config(attack="sign-flip", byzantine_per_round=True, trim=0.3, secagg_bits=8)
    assert cfg.unused_options() == {"byzantine_per_round": "with byzantine only", "attack": "with byzantine only",
                                    "trim": "with aggregate trimmed-mean only", "secagg_bits": "with secagg only"}
    assert load_config(attack="sign-flip", byzantine=1, aggregate="trimmed-mean", trim=0.3).unused_options() == {}


def test_a_robust_rule_that_cannot_act_is_named_when_the_run_starts(tmp_path, capsys):
    """floor(0.25 x 3) = 0: a trimmed mean of 3 answers is the plain mean; 2 attackers of 4 a round
    outnumber what either robust rule outvotes. A run that could act says nothing."""
    def weak(**kw):
        return load_config(**{"clients": 8, **kw}).weak_aggregation()
    (note,) = weak(sampled=3, aggregate="trimmed-mean")
    assert "drops floor(0.25 x 3) = 0" in note and "give trim >= 0.334" in note
    assert weak(sampled=3, aggregate="trimmed-mean", trim=0.334) == []
    assert weak(sampled=4, aggregate="trimmed-mean") == weak(sampled=3) == []
    per_round = dict(sampled=4, byzantine=2, byzantine_per_round=True, attack="sign-flip")
    assert "outnumber the 1 answer trimmed-mean drops" in weak(aggregate="trimmed-mean", **per_round)[0]
    assert "the median is not robust" in weak(aggregate="median", **per_round)[0]
    assert weak(aggregate="median", **{**per_round, "sampled": 5}) == []
    code, _, err = run_cli(["run", "--out", str(tmp_path / "a"), *TINY, "--sampled", "3",
                            "--aggregate", "trimmed-mean"], capsys)
    assert code == 0 and "it is the plain mean here" in err


def test_out_and_resume_together_name_both(tmp_path, capsys):
    code, _, err = run_cli(["run", "--out", str(tmp_path / "a"), "--resume", str(tmp_path / "b"), *TINY], capsys)
    assert code == 2 and "give one of them" in err


def test_ctrl_c_exits_130_and_says_where_the_rounds_are(tmp_path, capsys, monkeypatch):
    from hiso.runners import rundir

    def interrupted(cfg, out, *a, **k):
        out.mkdir(parents=True)
        raise KeyboardInterrupt
    monkeypatch.setattr(rundir, "run_to_dir", interrupted)
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), *TINY], capsys)
    assert code == 130 and f"{out} holds every round logged so far" in err and "Traceback" not in err


def test_a_comparison_arm_with_an_option_its_algorithm_ignores_is_refused(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text('task = "quadratic"\ndim = 20\nclients = 4\nsampled = 2\nrounds = 2\nnu = 0.1\n\n'
                    '[compare]\nalgorithms = ["hiso", "dc"]\n[compare.variants]\n'
                    'dc = { algorithm = "decomfl", nu = 0.2 }\n')
    out = tmp_path / "cmp"
    code, _, err = run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)
    assert code == 2 and "dc: decomfl does not use nu (HiSo's preconditioner)" in err, err
    assert not out.exists()
    # a shared option one arm reads and the other ignores is fine (nu = 0.1 above, for hiso)
    conf.write_text(conf.read_text().replace(", nu = 0.2", ""))
    code, _, err = run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)
    assert code == 0, err


def test_compare_force_leaves_no_file_of_the_old_run(tmp_path, capsys):
    args = ["compare", "--out", str(tmp_path / "cmp"), "--algorithms", "hiso", "--lr-grid", "hiso=0.05", *TINY]
    assert run_cli(args, capsys)[0] == 0
    run = next((tmp_path / "cmp" / "runs").glob("hiso/*/seed0"))
    (run / "rejections.log").write_text("from another configuration\n")
    (run / "eval.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    assert run_cli([*args, "--force"], capsys)[0] == 0
    assert not (run / "rejections.log").exists() and not (run / "eval.json").exists()
    assert (run / "notes.txt").read_text() == "mine" and (run / "summary.json").is_file()


def test_table_only_says_it_does_not_read_the_config(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text('task = "quadratic"\ndim = 20\nclients = 4\nsampled = 2\nrounds = 2\n'
                    '[compare]\nalgorithms = ["hiso"]\n[compare.lr_grid]\nhiso = [0.05]\n')
    out = tmp_path / "cmp"
    assert run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)[0] == 0
    code, text, err = run_cli(["compare", "--config", str(conf), "--out", str(out), "--table-only"], capsys)
    assert code == 0 and f"{conf} is not read" in err and "hiso" in text


def test_a_closed_pipe_ends_quietly(tmp_path, capsys):
    """`hiso compare ... | head`: the reader is gone before hiso prints its table; no traceback,
    exit 141 (SIGPIPE's)."""
    import subprocess
    import sys
    out = tmp_path / "cmp"
    assert run_cli(["compare", "--out", str(out), "--algorithms", "hiso", "--lr-grid", "hiso=0.05", *TINY],
                   capsys)[0] == 0
    p = subprocess.Popen([sys.executable, "-m", "hiso", "compare", "--out", str(out), "--table-only", "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader leaves at once
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_compare_progress_goes_to_stderr_and_the_table_to_stdout(tmp_path, capsys):
    args = ["compare", "--out", str(tmp_path / "cmp"), "--algorithms", "hiso", "--lr-grid", "hiso=0.05",
            *[a for a in TINY if a != "--quiet"]]
    assert run_cli(args, capsys)[0] == 0
    code, text, err = run_cli(args, capsys)  # again: every run is skipped, and says so
    assert code == 0 and "already finished" in err and "already finished" not in text
    assert text.lstrip().startswith("#") or text.lstrip().startswith("|"), text[:200]


def test_a_run_recorded_with_options_that_did_nothing_still_loads_as_it_ran(tmp_path, capsys):
    """Runs made before the refusal (--lora-r on MNIST, a --train-max MNIST ignored) rebuild and
    evaluate as they ran: those options are read back at their defaults."""
    from hiso.runners.rundir import saved_config
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--task", "mnist", "--clients", "4", "--sampled", "2",
                            "--rounds", "2", "--eval-every", "2", "--eval-max", "50", "--quiet"], capsys)
    assert code == 0, err
    path = out / "config.json"
    raw = json.loads(path.read_text())
    n_train = raw["task_info"]["n_train"]
    raw.update(lora_r=8, train_max=n_train - 1)  # as an older hiso recorded them, to no effect
    path.write_text(json.dumps(raw))
    cfg, _ = saved_config(out)
    assert cfg.lora_r is None and cfg.train_max is None
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "m.pt")], capsys)
    assert code == 0, err
    raw.update(lora_r=None, train_max=n_train)  # a train_max the run did not cut by is kept
    path.write_text(json.dumps(raw))
    assert saved_config(out)[0].train_max == n_train


def test_a_models_own_default_lr_comes_before_the_tasks():
    lm = dict(task="sst2", data_dir="/d", lora_r=8)
    assert load_config(**lm).lr == 1e-2  # SmolLM2 (the default model): the task's LoRA lr
    assert load_config(**lm, model="gemma3-270m").lr == 1e-3  # Gemma-3's, measured apart
    assert load_config(**lm, model="gemma3-270m", algorithm="decomfl").lr == 1e-3
    assert load_config(task="sst2", data_dir="/d", model="gemma3-270m").lr == 5e-6  # full parameters: the task's
    assert load_config(**lm, model="gemma3-270m", lr=0.02).lr == 0.02
