"""A finished run whose history.bin was cut afterwards says so: rebuild and eval name the round
they read back, and --resume continues from the log to the run's horizon, bit for bit."""

import os
import shutil

from cli_helpers import run_cli

ARGS = ["--dim", "16", "--clients", "4", "--sampled", "2", "--eval-every", "2", "--threads", "1"]


def test_a_cut_log_is_named_on_rebuild_and_eval_and_resumed_to_the_horizon(tmp_path, capsys):
    full, cut = tmp_path / "full", tmp_path / "cut"
    code, _, err = run_cli(["run", "--quiet", *ARGS, "--rounds", "6", "--out", str(full)], capsys)
    assert code == 0, err
    shutil.copytree(full, cut)
    log = cut / "history.bin"
    os.truncate(log, log.stat().st_size - 5)  # mid-record: round 6's record is torn, 5 rounds remain
    code, out, err = run_cli(["rebuild", str(cut), "--out", str(tmp_path / "r.pt")], capsys)
    assert code == 0 and "rebuilt round 5" in out
    assert "holds 5 rounds but summary.json reports 6" in err and "what is read back is round 5" in err
    code, out, err = run_cli(["eval", str(cut)], capsys)
    assert code == 0 and "holds 5 rounds but summary.json reports 6" in err
    code, _, err = run_cli(["run", "--quiet", "--resume", str(cut)], capsys)
    assert code == 0 and "continuing from round 5" in err
    assert log.read_bytes() == (full / "history.bin").read_bytes()
    assert (cut / "model.pt").read_bytes() == (full / "model.pt").read_bytes()
    code, out, err = run_cli(["rebuild", str(cut), "--out", str(tmp_path / "r.pt")], capsys)
    assert code == 0 and "rebuilt round 6" in out and "summary.json reports" not in err
