"""The command line: runs, rebuilds bit for bit, composes config files and flags, fails cleanly."""

import json

import pytest
import torch

from cli_helpers import run_cli

TINY = ["--task", "quadratic", "--dim", "50", "--clients", "6", "--sampled", "2", "--rounds", "30",
        "--eval-every", "10", "--quiet"]


_run = run_cli


@pytest.mark.parametrize("algorithm", ["hiso", "decomfl"])
def test_run_writes_the_run_directory_and_rebuild_is_bit_identical(tmp_path, capsys, algorithm):
    out = tmp_path / "run"
    code, stdout, _ = _run(["run", "--out", str(out), "--algorithm", algorithm, "--local-steps", "2", *TINY], capsys)
    assert code == 0 and "results in" in stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algorithm"] == algorithm and cfg["local_steps"] == 2 and cfg["task_opts"]["dim"] == 50
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(31))
    assert all({"train_loss", "bytes_up", "bytes_down", "wall_s"} <= r.keys() for r in rows)
    assert [r["round"] for r in rows if "eval_loss" in r] == [0, 10, 20, 30]
    assert rows[-1]["bytes_up"] > rows[1]["bytes_up"] > 0
    summary = json.loads((out / "summary.json").read_text())
    comm = summary["communication_per_client"]
    assert comm["bytes_up_mean"] * 6 == rows[-1]["bytes_up"] and comm["bytes_down_mean"] * 6 == rows[-1]["bytes_down"]
    assert summary["final"]["gap"] < rows[0]["gap"]

    rebuilt = tmp_path / "rebuilt.pt"
    code, stdout, _ = _run(["rebuild", str(out), "--out", str(rebuilt)], capsys)
    assert code == 0
    a, b = torch.load(out / "model.pt"), torch.load(rebuilt)
    assert a["round"] == b["round"] == 30
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert ("h" in a) == (algorithm == "hiso")
    if algorithm == "hiso":
        assert all(torch.equal(a["h"][k], b["h"][k]) for k in a["h"])
    # the run really moved the model, so equality above is not trivial
    assert not torch.equal(a["model"]["x"], torch.zeros(50))


def test_config_file_and_flags_compose(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text('algorithm = "decomfl"\nlr = 0.02\nrounds = 5\ndim = 20\n')
    out = tmp_path / "run"
    code, _, _ = _run(["run", "--config", str(conf), "--out", str(out), "--rounds", "7", "--quiet"], capsys)
    assert code == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["algorithm"], cfg["lr"], cfg["rounds"], cfg["task_opts"]["dim"]) == ("decomfl", 0.02, 7, 20)


@pytest.mark.parametrize("args, needle", [
    (["--task", "nope"], "unknown task"),
    (["--algorithm", "sgd"], "unknown algorithm"),
    (["--clients", "3", "--sampled", "5"], "cannot exceed"),
    (["--lr", "0"], "lr"),
    (["--mu", "-1"], "mu"),
    (["--config", "/nonexistent/c.toml"], "config file not found"),
    (["--rounds", "ten"], "invalid int"),
    (["--h-min", "2", "--h-max", "1"], "h_max"),
    (["--bogus-flag", "1"], "unrecognized"),
])
def test_bad_options_give_one_line_and_exit_2(tmp_path, capsys, args, needle):
    code, out, err = _run(["run", "--out", str(tmp_path / "x"), "--quiet", *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hiso: error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_bad_toml_and_existing_run_dir(tmp_path, capsys):
    conf = tmp_path / "c.toml"
    conf.write_text("lr = = 3\n")
    code, _, err = _run(["run", "--config", str(conf), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "not valid TOML" in err
    conf.write_text("learning_rate = 3\n")
    code, _, err = _run(["run", "--config", str(conf), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "learning_rate" in err
    out = tmp_path / "run"
    assert _run(["run", "--out", str(out), "--rounds", "2", "--dim", "10", "--quiet"], capsys)[0] == 0
    code, _, err = _run(["run", "--out", str(out), "--rounds", "2", "--quiet"], capsys)
    assert code == 2 and "--force" in err
    code, _, err = _run(["rebuild", str(tmp_path / "missing"), "--out", str(tmp_path / "m.pt")], capsys)
    assert code == 2 and "config.json" in err


def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for out in (afile, afile / "run"):
        code, _, err = _run(["run", "--out", str(out), "--rounds", "2", "--dim", "10", "--quiet"], capsys)
        assert code == 2 and f"{afile} is a file, not a directory" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert afile.read_text() == "keep"


def test_force_removes_every_file_of_the_old_run_and_keeps_the_users(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["--out", str(out), "--rounds", "3", "--dim", "10", "--quiet"]
    code, _, err = _run(["run", *small, "--drop-rate", "0.3", "--dp-clip", "1", "--dp-noise-multiplier", "0.1"], capsys)
    assert code == 0, err
    assert _run(["eval", str(out)], capsys)[0] == 0
    (out / "notes.txt").write_text("mine")
    old = {"rejections.log", "dp_secret.json", "eval.json"}
    assert old <= {p.name for p in out.iterdir()}  # the old run wrote them: their removal is the point
    code, _, err = _run(["run", *small, "--force"], capsys)
    assert code == 0, err
    assert not old & {p.name for p in out.iterdir()}
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["drop_rate"] == 0


@pytest.mark.parametrize("algorithm", ["decomfl", "fedavg"])
def test_a_diverging_run_keeps_its_rows_and_says_so(tmp_path, capsys, algorithm):
    out = tmp_path / "run"
    code, _, err = _run(["run", "--out", str(out), "--algorithm", algorithm, "--lr", "1e30", *TINY], capsys)
    assert code == 1 and "diverged" in err and "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"]["round"] == summary["rounds_done"] + 1 <= 30
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == summary["rounds_done"] + 1
    state = torch.load(out / "model.pt")
    assert all(torch.isfinite(v).all() for v in state["model"].values())


# --------------------------------------------------------------------------- --help

def _help(args, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no wrapping inside words or flags
    code, out, _ = _run(args, capsys)
    assert code == 0
    return out


def _option_line(text, flag):
    """An option's entry in --help: its flag line and the help argparse may put on the next line."""
    entries = []
    for line in text.splitlines():
        if line.startswith("  -"):
            entries.append(line.strip())
        elif entries and line.startswith("   "):
            entries[-1] += " " + line.strip()
    found = [e for e in entries if e.startswith((flag + " ", flag + ","))]
    assert len(found) == 1, (flag, found)
    return found[0]


def _run_options(run_config) -> dict:
    """RunConfig's fields with the built-in tasks' options by their own names (flags), not task_opts."""
    from hiso.tasks.options import option_fields
    return {**{k: f for k, f in run_config.model_fields.items() if k != "task_opts"}, **option_fields()}


def test_every_run_option_has_a_description():
    from hiso.config import RunConfig
    missing = [name for name, f in _run_options(RunConfig).items() if not (f.description or "").strip()]
    assert not missing, f"RunConfig fields without Field(description=...): {missing}"


def test_run_help_shows_choices_and_a_meaning_for_every_option(capsys, monkeypatch):
    from typing import Literal, get_args, get_origin

    from hiso.cli import shown_default
    from hiso.config import ALGORITHMS, RunConfig, task_names
    text = _help(["run", "--help"], capsys, monkeypatch)
    for name, field in _run_options(RunConfig).items():
        flag = "--method-opt" if name == "method_opts" else "--" + name.replace("_", "-")  # KEY=VALUE, repeated
        line = _option_line(text, flag)
        assert field.description in line, (name, line)
        if "default:" not in field.description:  # the default is shown unless the meaning says it
            default = field.get_default(call_default_factory=True)
            assert f"(default: {shown_default(None if default == {} else default)})" in line, (name, line)
            assert "None" not in line, (name, line)
        ann = field.annotation
        for a in (ann, *get_args(ann)):
            if get_origin(a) is Literal:
                assert "{" + ",".join(get_args(a)) + "}" in line, (name, line)
    assert _option_line(text, "--task").startswith("--task {" + ",".join(task_names()) + ",module:Class,file.py:Class}")
    assert _option_line(text, "--algorithm").startswith("--algorithm {" + ",".join(ALGORITHMS) + ",module:Class,file.py:Class}")
    assert "finite-difference step of the ZO estimate" in _option_line(text, "--mu")
    assert "weight of the new value in H's moving average" in _option_line(text, "--nu")
    assert "{iid,dirichlet,dirichlet-prior}" in _option_line(text, "--partition")
    assert "{auto,bf16,none}" in _option_line(text, "--autocast")
    assert "default: per task and algorithm (each task's default_lr" in _option_line(text, "--lr")
    assert "(default: 300)" in _option_line(text, "--rounds")


def test_compare_help_shows_the_shared_run_options(capsys, monkeypatch):
    from hiso.config import RunConfig
    text = _help(["compare", "--help"], capsys, monkeypatch)
    for name, field in _run_options(RunConfig).items():
        flag = "--method-opt" if name == "method_opts" else "--" + name.replace("_", "-")
        if name in ("algorithm", "seed"):  # per run: --algorithms, --seeds
            assert not any(line.strip().startswith(flag + " ") for line in text.splitlines())
            continue
        assert field.description in _option_line(text, flag)
    assert "slower than serial" in " ".join(_option_line(text, "--jobs").split())


def test_choices_are_validated_by_the_config_not_by_argparse(tmp_path, capsys):
    # the same one-line error for a flag and a TOML key, naming the field
    code, _, err = _run(["run", "--out", str(tmp_path / "x"), "--difference", "backward", "--quiet"], capsys)
    assert code == 2 and err.startswith("hiso: error: difference:") and "forward" in err


def test_version_names_the_package_version(capsys):
    import hiso
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"hiso {hiso.__version__}"
