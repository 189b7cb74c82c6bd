"""Any round's model from the log: ``hiso rebuild --round R`` is the model a run stopped at R saves."""

import pytest
import torch

from cli_helpers import run_cli

RUN = ["--task", "quadratic", "--dim", "40", "--clients", "6", "--sampled", "2", "--eval-every", "5",
       "--local-steps", "2", "--lr-decay", "4", "--momentum", "0.5", "--quiet"]


def _same(a: dict, b: dict) -> bool:
    return (a["round"] == b["round"] and a.keys() == b.keys()
            and all(a[p].keys() == b[p].keys() and all(torch.equal(a[p][k], b[p][k]) for k in a[p])
                    for p in a if p != "round"))


@pytest.mark.parametrize("algorithm", ["hiso", "decomfl"])
def test_round_r_is_the_model_of_a_run_stopped_at_r(tmp_path, capsys, algorithm):
    short, long = tmp_path / "r7", tmp_path / "r12"
    for out, rounds in ((short, "7"), (long, "12")):
        code, _, err = run_cli(["run", "--out", str(out), "--algorithm", algorithm, "--rounds", rounds, *RUN], capsys)
        assert code == 0, err
    code, stdout, err = run_cli(["rebuild", str(long), "--round", "7", "--out", str(tmp_path / "x7.pt")], capsys)
    assert code == 0 and "round 7" in stdout, err
    at7, stopped = torch.load(tmp_path / "x7.pt"), torch.load(short / "model.pt")
    assert ("h" in at7) == (algorithm == "hiso") and "momentum" in at7
    assert _same(at7, stopped)
    assert not _same(at7, torch.load(long / "model.pt"))  # rounds 8..12 moved it: R is not ignored
    code, _, _ = run_cli(["rebuild", str(long), "--round", "0", "--out", str(tmp_path / "x0.pt")], capsys)
    assert code == 0 and torch.equal(torch.load(tmp_path / "x0.pt")["model"]["x"], torch.zeros(40))


def test_a_round_past_the_log_is_refused_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["run", "--out", str(out), "--rounds", "3", *RUN], capsys)[0] == 0
    for bad in ("4", "-1"):
        code, _, err = run_cli(["rebuild", str(out), "--round", bad, "--out", str(tmp_path / "x.pt")], capsys)
        assert code == 2 and "rounds 0..3" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.pt").exists()


def test_rebuild_never_writes_onto_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["run", "--out", str(out), "--rounds", "6", *RUN], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for target in (out / "model.pt", out / "history.bin", out, tmp_path):
        code, _, err = run_cli(["rebuild", str(out), "--round", "5", "--out", str(target)], capsys)
        assert code == 2 and "run directory" in err and len(err.strip().splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_rebuild_makes_the_missing_parents_of_its_out(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(["run", "--out", str(out), "--rounds", "6", *RUN], capsys)[0] == 0
    nested = tmp_path / "new" / "dir" / "x5.pt"
    code, _, err = run_cli(["rebuild", str(out), "--round", "5", "--out", str(nested)], capsys)
    assert code == 0, err
    assert torch.load(nested)["round"] == 5
    (tmp_path / "afile").write_text("keep")
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "afile" / "x.pt")], capsys)
    assert code == 2 and "not a directory" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "afile").read_text() == "keep"
