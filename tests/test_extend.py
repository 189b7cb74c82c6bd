"""Continuing runs to more rounds: ``hiso run --resume DIR --rounds N`` and ``hiso compare`` asked
for a later horizon than its finished runs have. A continued run must be the run that was asked
for N rounds from the start, bit for bit (history, model, H, metrics but wall-clock, summary),
and what cannot be continued (fewer rounds, full-model baselines, a DP budget solved for the
old horizon, a diverged run) is refused or reported, never silently rerun. (One visible trace:
an old horizon that was not an evaluation round keeps the evaluation row it ended with.)"""

import json

import pytest

from cli_helpers import run_cli
from hiso.experiments import compare as cmp
from hiso.experiments.compare import build_plan, parse_cli
from test_resume import QUAD, WALL, _cut, _rows, assert_same_run


@pytest.mark.parametrize("algorithm, extra", [("hiso", []), ("decomfl", ["--local-steps", "2"]),
                                              ("fedkseed", ["--seed-pool", "64"])])
def test_a_run_continued_to_more_rounds_is_the_longer_run(tmp_path, capsys, algorithm, extra):
    args = [*QUAD, "--algorithm", algorithm, *extra]
    if algorithm == "fedkseed":
        args += ["--perturbations", "1"]
    full, short = tmp_path / "full", tmp_path / "short"
    assert run_cli(["run", "--out", str(full), *args, "--rounds", "10", "--quiet"], capsys)[0] == 0
    assert run_cli(["run", "--out", str(short), *args, "--rounds", "4", "--quiet"], capsys)[0] == 0
    kept = (short / "metrics.jsonl").read_text()
    code, _, err = run_cli(["run", "--resume", str(short), "--rounds", "10"], capsys)
    assert code == 0, err
    assert "continuing its 4 rounds to 10" in err
    assert_same_run(full, short)
    assert (short / "metrics.jsonl").read_text().startswith(kept)  # wall_s too: continued, not redone
    assert json.loads((short / "config.json").read_text())["rounds"] == 10
    # finished at the new horizon: nothing more to do
    code, out, _ = run_cli(["run", "--resume", str(short), "--rounds", "10", "--quiet"], capsys)
    assert code == 0 and "finished" in out


def test_out_resume_with_more_rounds_and_a_continuation_killed_midway(tmp_path, capsys):
    full, d = tmp_path / "full", tmp_path / "d"
    assert run_cli(["run", "--out", str(full), *QUAD, "--rounds", "10", "--quiet"], capsys)[0] == 0
    assert run_cli(["run", "--out", str(d), *QUAD, "--rounds", "3", "--quiet"], capsys)[0] == 0
    # the one-command form: `--out DIR --resume` runs, continues or extends, whatever DIR holds
    assert run_cli(["run", "--out", str(d), *QUAD, "--rounds", "6", "--resume", "--quiet"], capsys)[0] == 0
    assert len(_rows(d)) == 7
    # killed while continuing to 10 (after config.json named 10, before its summary): resumed to the end
    cut = tmp_path / "cut"
    _cut(full, cut, 8, 7)
    cfg = json.loads((cut / "config.json").read_text())
    (cut / "summary.json").write_text(json.dumps({"rounds_done": 6, "diverged": None}))  # the old one, left behind
    assert cfg["rounds"] == 10
    assert run_cli(["run", "--resume", str(cut), "--quiet"], capsys)[0] == 0
    assert_same_run(full, cut)


def test_what_cannot_be_continued_is_refused_in_one_line(tmp_path, capsys):
    d = tmp_path / "d"
    assert run_cli(["run", "--out", str(d), *QUAD, "--rounds", "5", "--quiet"], capsys)[0] == 0
    files = {f.name: f.read_bytes() for f in d.iterdir()}
    cases = [(["--resume", str(d), "--rounds", "3"], "only a larger --rounds"),  # fewer rounds
             (["--resume", str(d), "--rounds", "8", "--lr", "0.5"], "lr")]  # more rounds and another change
    for args, needle in cases:
        code, _, err = run_cli(["run", *args, "--quiet"], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (args, err)
    assert {f.name: f.read_bytes() for f in d.iterdir()} == files
    # a full-model baseline keeps no log; a DP budget was solved for the old horizon
    for name, extra, needle in [("fedavg", ["--algorithm", "fedavg"], "no log"),
                                ("dp", ["--dp-clip", "1", "--dp-epsilon", "8", "--dp-delta", "1e-5"], "epsilon 8 over 3 rounds")]:
        r = tmp_path / name
        assert run_cli(["run", "--out", str(r), *QUAD, "--rounds", "3", *extra, "--quiet"], capsys)[0] == 0
        files = {f.name: f.read_bytes() for f in r.iterdir()}
        code, _, err = run_cli(["run", "--resume", str(r), "--rounds", "6", "--quiet"], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (name, err)
        assert {f.name: f.read_bytes() for f in r.iterdir()} == files
    # a diverged run is its result at any horizon: reported, exit 1, not rerun
    dv = tmp_path / "diverged"
    args = [*QUAD, "--dim", "20", "--algorithm", "decomfl", "--lr", "2.2", "--rounds", "300"]
    assert run_cli(["run", "--out", str(dv), *args, "--quiet"], capsys)[0] == 1
    files = {f.name: f.read_bytes() for f in dv.iterdir()}
    code, out, _ = run_cli(["run", "--resume", str(dv), "--rounds", "400", "--quiet"], capsys)
    assert code == 1 and "diverged" in out and "nothing to continue" in out
    assert {f.name: f.read_bytes() for f in dv.iterdir()} == files


TINY = {"task": "quadratic", "dim": 20, "clients": 4, "sampled": 2, "eval_every": 4}


def _plan(rounds, arms="hiso,decomfl,fedavg", grid=("hiso=0.05", "decomfl=0.05", "fedavg=0.1")):
    return build_plan(None, {**TINY, "rounds": rounds}, parse_cli(arms, "0", list(grid)))


def test_compare_continues_its_runs_to_a_later_horizon(tmp_path, capsys, monkeypatch):
    """A compare asked for more rounds continues the scalar-only runs from their logs (the
    full-model baseline is rerun: it keeps no log) and gives the runs of a compare asked for the
    larger horizon from the start."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    cmp.compare(_plan(12), ref, quiet=True, plots=False)
    cmp.compare(_plan(4), out, quiet=True, plots=False)
    kept = {s.label: (s.dir / "metrics.jsonl").read_text() for s in _plan(4).runs(out)}
    import hiso.runners.rundir as rundir
    real, calls = rundir.run_to_dir, []

    def spy(cfg, o, *a, **k):
        calls.append((o.parent.parent.name, k.get("resume", False)))
        return real(cfg, o, *a, **k)

    monkeypatch.setattr(rundir, "run_to_dir", spy)
    cmp.compare(_plan(12), out, quiet=False, plots=False)
    said = capsys.readouterr()
    assert "2 runs continue from their log" in said.out + said.err
    assert sorted(calls) == [("decomfl", True), ("fedavg", False), ("hiso", True)]
    for a, b in zip(_plan(12).runs(ref), _plan(12).runs(out)):
        if a.arm.name == "fedavg":
            assert [{k: v for k, v in r.items() if k not in WALL} for r in _rows(a.dir)] == \
                [{k: v for k, v in r.items() if k not in WALL} for r in _rows(b.dir)]
            continue
        assert_same_run(a.dir, b.dir)
        assert (b.dir / "metrics.jsonl").read_text().startswith(kept[b.label])
    # a run cut short is continued too, not redone
    spec = next(s for s in _plan(12).runs(out) if s.arm.name == "hiso")
    (spec.dir / "summary.json").unlink()
    lines = (spec.dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (spec.dir / "metrics.jsonl").write_text("".join(lines[:7]))
    calls.clear()
    cmp.compare(_plan(12), out, quiet=True, plots=False)
    assert calls == [("hiso", True)]
    assert (spec.dir / "metrics.jsonl").read_text().startswith("".join(lines[:7]))
    assert_same_run(next(s for s in _plan(12).runs(ref) if s.arm.name == "hiso").dir, spec.dir)
    # fewer rounds than the runs have: one line, exit 2
    code, _, err = run_cli(["compare", "--out", str(out), "--task", "quadratic", "--dim", "20", "--clients", "4",
                            "--sampled", "2", "--eval-every", "4", "--rounds", "8", "--algorithms", "hiso",
                            "--seeds", "0", "--lr-grid", "hiso=0.05", "--quiet"], capsys)
    assert code == 2 and "not cut to fewer" in err and len(err.strip().splitlines()) == 1


def test_compare_with_jobs_continues_in_its_worker_processes(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    plan = lambda r: _plan(r, "hiso,decomfl", ("hiso=0.05", "decomfl=0.05"))  # noqa: E731
    cmp.compare(plan(12), ref, quiet=True, plots=False)
    cmp.compare(plan(4), out, quiet=True, plots=False)
    kept = {s.label: (s.dir / "metrics.jsonl").read_text() for s in plan(4).runs(out)}
    cmp.compare(plan(12), out, quiet=True, plots=False, jobs=2)
    for a, b in zip(plan(12).runs(ref), plan(12).runs(out)):
        assert_same_run(a.dir, b.dir)
        assert (b.dir / "metrics.jsonl").read_text().startswith(kept[b.label])
