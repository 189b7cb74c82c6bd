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
