"""The command line's manners: a typo names its file and the nearest option, a flag of another
command says whose it is, and a stopped run says how to continue it."""

import signal
import subprocess
import sys

from cli_helpers import run_cli
from conftest import wait_exit, wait_until


def test_a_toml_typo_names_the_file_and_the_nearest_option(tmp_path, capsys):
    conf = tmp_path / "run.toml"
    conf.write_text("lrr = 0.1\n")
    code, _, err = run_cli(["run", "--config", str(conf), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and err.strip() == f"hiso: error: {conf}: lrr: not an option (did you mean lr?)"
    conf.write_text("zzzzzz = 1\n")  # nothing near: no guess
    code, _, err = run_cli(["run", "--config", str(conf), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and err.strip() == f"hiso: error: {conf}: zzzzzz: not an option"


def test_an_unknown_flag_names_the_nearest_flag_and_the_commands_that_take_it(tmp_path, capsys):
    code, _, err = run_cli(["run", "--lrr", "0.1", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "unrecognized arguments: --lrr 0.1 (did you mean --lr?)" in err
    code, _, err = run_cli(["run", "--round", "3", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "(--round is for hiso rebuild, export, eval) (did you mean --rounds?)" in err
    assert len(err.strip().splitlines()) == 1


def test_a_run_stopped_by_sigterm_says_how_to_continue_it(tmp_path):
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "hiso.cli", "run", "--rounds", "1000000", "--dim", "2000",
                             "--eval-every", "1", "--out", str(out), "--quiet"], stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:  # rounds logged (an event), however slow the machine; bounded, and the process stopped whatever fails
        wait_until(lambda: proc.poll() is not None or (metrics.exists() and metrics.read_text().count("\n") > 2),
                   "two logged rounds", 300)
        proc.send_signal(signal.SIGTERM)
        assert wait_exit(proc) == 128 + signal.SIGTERM
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert f"holds every round logged so far (continue it: hiso run --resume {out})" in err


def test_the_progress_names_its_stage_and_shows_round_0_and_the_summary_says_seconds(tmp_path, capsys):
    code, out, err = run_cli(["run", "--out", str(tmp_path / "r"), "--rounds", "2", "--eval-every", "1"], capsys)
    assert code == 0, err
    assert "building the model, evaluating round 0" in err  # what the bar waits on before round 1
    assert "round 0: eval_loss=" in err  # round 0's evaluation, shown as it comes
    line = out.strip().splitlines()[-1]
    assert " s/round;" in line and "ms/round" not in line


def test_v_and_log_level_set_what_hisos_log_says(tmp_path, capsys):
    """A damaged answer is logged at info: said with -v (or --log-level info), not by default."""
    args = ["run", "--rounds", "2", "--corrupt-rate", "0.5", "--quiet", "--force"]
    code, _, err = run_cli([*args, "--out", str(tmp_path / "a")], capsys)
    assert code == 0 and "rejected (checksum)" not in err
    code, _, err = run_cli(["-v", *args, "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "hiso: INFO: row 1 (round 0): rejected (checksum)" in err
    code, _, err = run_cli(["--log-level", "info", *args, "--out", str(tmp_path / "c")], capsys)
    assert code == 0 and "rejected (checksum)" in err
    code, _, err = run_cli(["--log-level", "error", *args, "--out", str(tmp_path / "d")], capsys)
    assert code == 0 and "rejected (checksum)" not in err


def test_an_own_task_refuses_an_option_it_does_not_declare(tmp_path, capsys):
    f = tmp_path / "mytask.py"
    body = ("import torch\nimport hiso\n\nclass Mine(hiso.Task):\n    metrics = {'eval_loss': 'min'}\n{opts}"
            "    def build_model(self):\n        return torch.nn.Linear(2, 1)\n"
            "    def batch(self, c, r, k, n):\n        return torch.ones(n, 2)\n"
            "    def loss(self, model, b):\n        return model(b).square().mean()\n"
            "    def evaluate(self, model):\n        return {'eval_loss': float(model(torch.ones(1, 2)).square())}\n")
    f.write_text(body.replace("{opts}", ""))
    code, _, err = run_cli(["run", "--task", f"{f}:Mine", "--data-dir", str(tmp_path), "--rounds", "2", "--quiet",
                            "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and f"data_dir = '{tmp_path}': task {f}:Mine does not use it" in err
    assert "add 'data_dir' to its class's `options`" in err and len(err.strip().splitlines()) == 1
    g = tmp_path / "declared.py"  # (another file: a task's class is read once per process)
    g.write_text(body.replace("{opts}", "    options = frozenset({'data_dir'})\n"))
    code, _, err = run_cli(["run", "--task", f"{g}:Mine", "--data-dir", str(tmp_path), "--rounds", "2", "--quiet", "--lr", "0.01",
                            "--out", str(tmp_path / "r2")], capsys)
    assert code == 0, err


def test_v_and_q_are_taken_after_the_command_too(tmp_path, capsys):
    args = ["run", "--rounds", "2", "--corrupt-rate", "0.5", "--force"]
    code, _, err = run_cli([*args, "-q", "--out", str(tmp_path / "a")], capsys)
    assert code == 0 and "rejected (checksum)" not in err and "round 0" not in err  # -q: no progress
    code, _, err = run_cli([*args, "-q", "-v", "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "hiso: INFO: row 1 (round 0): rejected (checksum)" in err


def test_a_size_that_is_not_a_size_is_refused_before_any_network_call(capsys, monkeypatch):
    import transformers

    def no_network(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_network)
    for bad in ("8X", "1.5G"):
        code, _, err = run_cli(["plan", "--params-model", bad, "--clients", "4", "--sampled", "2", "--rounds", "5"],
                               capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "is not a size" in err, err


def test_a_damaged_history_says_what_to_do(tmp_path, capsys):
    run = tmp_path / "r"
    assert run_cli(["run", "--rounds", "2", "--dim", "5", "-q", "--out", str(run)], capsys)[0] == 0
    log = run / "history.bin"
    log.write_bytes(b"XXXX" + log.read_bytes()[4:])
    for cmd in (["rebuild", str(run), "--out", str(tmp_path / "m.pt")], ["run", "--resume", str(run), "--rounds", "3"]):
        code, _, err = run_cli(cmd, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "not a hiso history file" in err and "restore history.bin from a copy" in err, err


def test_compare_says_where_a_methods_options_go(tmp_path, capsys):
    code, _, err = run_cli(["compare", "--algorithms", "decomfl,examples/clip_method.py:ScalarClip", "--method-opt",
                            "c=0.5", "--rounds", "2", "--dim", "5", "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "[compare.variants]" in err, err
    assert "method_opts" in err and not (tmp_path / "c").exists()


def test_an_interrupted_flower_run_gets_one_resume_hint_its_own(tmp_path, capsys, monkeypatch):
    """hiso flower says how to continue (with the federation's work directory) before the
    interrupt reaches the command line, which then adds no hiso run hint of its own."""
    import hiso.cli

    def stopped(args):
        print(f"hiso flower: ...; to continue: hiso flower --resume {args.out} --workdir W", file=sys.stderr)
        raise KeyboardInterrupt

    monkeypatch.setattr(hiso.cli, "cmd_flower", stopped)
    (tmp_path / "fl").mkdir()
    code, _, err = run_cli(["flower", "--out", str(tmp_path / "fl")], capsys)
    assert code == 130 and err.count("--resume") == 1 and "hiso flower --resume" in err, err
