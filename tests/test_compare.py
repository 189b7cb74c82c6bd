"""hiso compare: lr selection, rounds to reach / speed-up, the table, the plots, resuming, bad options."""

import csv
import json
import math
import sys

import pytest

from cli_helpers import run_cli
from hiso.report.table import (Reach, best_of, build_table, csv_columns, first_reach, human_bytes,
                               load_run_result, rounds_to_own_best, rounds_to_reach, speedup)
from hiso.report.table import ArmResult
from hiso.experiments import compare as cmp
from hiso.experiments.compare import build_plan, parse_cli, select_lr

# a small quadratic: ~50 ms a run
TINY = {"task": "quadratic", "dim": 20, "clients": 4, "sampled": 2, "rounds": 30, "eval_every": 10}
TINY_FLAGS = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2",
              "--rounds", "30", "--eval-every", "10"]


_main = run_cli


def _rows(values, every=10, metric="eval_acc"):
    """Metric rows for rounds 0..every*(n-1), evaluated every ``every`` rounds (others have no metric)."""
    rows = []
    for i, v in enumerate(values):
        for r in range(i * every, i * every + (every if i < len(values) - 1 else 1)):
            row = {"round": r, "train_loss": 1.0}
            if r == i * every:
                row[metric] = v
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- pure functions

def test_select_lr_best_mean_nan_worst_ties_first():
    assert select_lr({1e-3: [0.5, 0.7], 1e-2: [0.8, 0.6], 1e-1: [0.9, math.nan]}, higher=True) == 1e-2
    assert select_lr({1e-3: [0.5, 0.7], 1e-2: [0.8, 0.6], 1e-1: [0.1, 0.2]}, higher=False) == 1e-1
    assert select_lr({1e-1: [math.nan], 1e-3: [5.0]}, higher=False) == 1e-3  # NaN loses even to a bad value
    assert select_lr({3e-3: [0.6], 1e-3: [0.6]}, higher=True) == 3e-3  # tie: first listed
    assert select_lr({1e-3: [math.nan]}, higher=True) == 1e-3


def test_best_and_first_reach_on_hand_made_rows():
    rows = _rows([0.10, 0.50, 0.80, 0.75, 0.90])  # evaluated at 0, 10, 20, 30, 40
    assert best_of(rows, "eval_acc", higher=True) == 0.90
    assert best_of(rows, "eval_acc", higher=False) == 0.10
    assert first_reach(rows, "eval_acc", 0.75, higher=True) == 20
    assert first_reach(rows, "eval_acc", 0.91, higher=True) is None
    assert first_reach(rows, "eval_acc", 0.10, higher=True) == 0
    loss = _rows([3.0, 2.0, 2.5, 1.0], metric="gap")
    assert first_reach(loss, "gap", 2.2, higher=False) == 10
    assert best_of(_rows([math.nan, 0.2, math.nan]), "eval_acc", True) == 0.2
    assert math.isnan(best_of(_rows([math.nan]), "eval_acc", True))


def test_rounds_to_reach_speedup_and_reference_own_best():
    ref = [_rows([0.1, 0.6, 0.7, 0.7]), _rows([0.1, 0.5, 0.8, 0.8])]     # bests 0.7 (round 20), 0.8 (20)
    fast = [_rows([0.1, 0.76, 0.9, 0.9]), _rows([0.1, 0.8, 0.8, 0.9])]    # reach 0.75 at 10, 10
    slow = [_rows([0.1, 0.2, 0.3, 0.75]), _rows([0.1, 0.2, 0.3, 0.4])]    # one seed never reaches

    own = rounds_to_own_best(ref, "eval_acc", higher=True)
    assert own.per_seed == (20, 20) and own.mean == 20
    threshold = (0.7 + 0.8) / 2
    r = rounds_to_reach(fast, "eval_acc", threshold, higher=True)
    assert r.per_seed == (10, 10) and r.mean == 10
    assert speedup(own.mean, r.mean) == 2.0
    s = rounds_to_reach(slow, "eval_acc", threshold, higher=True)
    assert s.per_seed == (30, None) and s.reached == 1 and s.mean is None  # equal counts as reached
    assert speedup(own.mean, s.mean) is None
    assert speedup(20, 0) is None
    assert Reach((10, 15)).mean == 12.5


def test_reaching_the_mean_best_tolerates_its_rounding():
    from hiso.report.table import mean_std
    threshold = mean_std([0.1, 0.2])[0]
    assert threshold > 0.15  # 0.15000000000000002: a seed at exactly 0.15 must still count
    assert rounds_to_reach([_rows([0.0, 0.15])], "eval_acc", threshold, higher=True).per_seed == (10,)
    assert rounds_to_reach([_rows([0.0, 0.1499])], "eval_acc", threshold, higher=True).per_seed == (None,)
    assert rounds_to_reach([_rows([1.0, 0.15], metric="gap")], "gap", mean_std([0.1, 0.2])[0] - 3e-17,
                           higher=False).per_seed == (10,)


def test_example_configs_are_valid():
    from pathlib import Path
    confs = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert len(confs) >= 3
    for conf in confs:
        plan = build_plan(conf)
        assert plan.runs(Path("/nonexistent"))  # every run's configuration validated
    mnist = build_plan(Path(__file__).parent.parent / "configs/mnist_compare.toml")
    assert [a.name for a in mnist.arms] == ["hiso", "decomfl"] and mnist.seeds == [0, 1, 2]
    cfg = mnist.config(mnist.arms[0], mnist.arms[0].lrs[0], 0)
    assert (cfg.task, cfg.clients, cfg.sampled, cfg.alpha, cfg.perturbations, cfg.local_steps, cfg.batch_size) == \
        ("mnist", 64, 8, 1.0, 5, 1, 32)
    assert all(len(a.lrs) > 1 for a in mnist.arms)


def _arm(name, per_seed_values, comm=(100.0, 1000.0), metric="eval_acc"):
    from pathlib import Path

    from hiso.report.table import RunResult
    runs = [RunResult(Path("."), s, {"clients": 4, "rounds": 30, "eval_every": 10, "task": "mnist", "sampled": 2},
                      _rows(v, metric=metric),
                      {"communication_per_client": {"bytes_up_mean": comm[0], "bytes_down_mean": comm[1]},
                       "s_per_round": 0.01, "peak_rss_mb": 100.0 + s})
            for s, v in enumerate(per_seed_values)]
    return ArmResult(name, name, 1e-3, runs)


def test_build_table_numbers():
    ref = _arm("decomfl", [[0.1, 0.6, 0.7, 0.7], [0.1, 0.5, 0.8, 0.8]], comm=(1e3, 9e3))
    hiso = _arm("hiso", [[0.1, 0.76, 0.9, 0.9], [0.1, 0.8, 0.8, 0.9]], comm=(1e3, 9e3))
    fedavg = _arm("fedavg", [[0.1, 0.2, 0.3, 0.75], [0.1, 0.2, 0.3, 0.4]], comm=(2.5e8, 2.5e8))
    t = build_table([hiso, ref, fedavg], "decomfl", "eval_acc")
    row = {r.name: r for r in t.rows}
    assert t.threshold == pytest.approx(0.75)
    assert row["hiso"].best_mean == pytest.approx(0.9) and row["hiso"].best_std == pytest.approx(0.0)
    assert row["decomfl"].best_std == pytest.approx(math.sqrt(0.005))
    assert (row["hiso"].rounds, row["hiso"].speedup) == (10, 2.0)
    assert (row["decomfl"].rounds, row["decomfl"].speedup) == (20, 1.0)
    assert row["fedavg"].rounds is None and row["fedavg"].speedup is None
    assert row["fedavg"].bytes_total == 5e8 and row["fedavg"].peak_rss_mb == 101.0
    from hiso.report.table import to_markdown
    md = to_markdown(t)
    assert "| HiSo | 0.001 | 90.00 ± 0.00 | 10 | — | — | 2.00× | 1 KB | 9 KB | 10 KB |" in md  # no wall_s, no bytes rows
    assert "20 (own best)" in md and "— (1/2 seeds)" in md and "500 MB" in md


def test_human_bytes_decimal():
    assert [human_bytes(x) for x in (0, 999, 1000, 51_234, 999_700, 2.5e9, 3e12)] == \
        ["0 B", "999 B", "1 KB", "51.2 KB", "1 MB", "2.5 GB", "3 TB"]


# --------------------------------------------------------------------------- end to end

def test_compare_chooses_the_lr_that_learns(tmp_path, capsys):
    # 1e-6 barely moves, 5.0 diverges (its best is the initial gap), 0.05 learns
    out = tmp_path / "cmp"
    code, stdout, _ = _main(["compare", "--out", str(out), *TINY_FLAGS, "--seeds", "0,1",
                             "--lr-grid", "hiso=1e-6,0.05,5", "--lr-grid", "decomfl=5,1e-6,0.05",
                             "--quiet"], capsys)
    assert code == 0
    sel = json.loads((out / "selection.json").read_text())
    assert sel["metric"] == "gap" and sel["higher_is_better"] is False
    for arm in ("hiso", "decomfl"):
        assert sel["arms"][arm]["chosen_lr"] == 0.05
        grid = {g["lr"]: g for g in sel["arms"][arm]["grid"]}
        assert set(grid) == {1e-6, 0.05, 5.0} and set(grid[0.05]["best_per_seed"]) == {"0", "1"}
        assert grid[0.05]["mean_best"] < grid[1e-6]["mean_best"]
    # the table is printed, and written with the right columns, one row per arm
    assert "| HiSo | 0.05 |" in stdout and "| DeComFL | 0.05 |" in stdout
    with open(out / "table.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == csv_columns("gap")
    assert [r["algorithm"] for r in rows] == ["hiso", "decomfl"]
    assert [r["reference"] for r in rows] == ["0", "1"] and rows[1]["speedup"] == "1.0"
    assert float(rows[0]["bytes_total_per_client"]) == pytest.approx(
        float(rows[0]["bytes_up_per_client"]) + float(rows[0]["bytes_down_per_client"]))
    summ = json.loads((out / "runs/hiso/lr0.05/seed1/summary.json").read_text())
    assert float(rows[0]["bytes_up_per_client"]) == pytest.approx(
        (summ["communication_per_client"]["bytes_up_mean"] +
         json.loads((out / "runs/hiso/lr0.05/seed0/summary.json").read_text())["communication_per_client"]["bytes_up_mean"]) / 2)
    md = (out / "table.md").read_text()
    assert md.splitlines()[0].startswith("| algorithm | lr | best optimality gap, selected on test | rounds to DeComFL's best")
    assert "selected on test" in md and "task quadratic has no validation split" in md  # the label and why
    assert "speed-up" in md and "uplink / client" in md and "peak memory" in md and "1 KB = 1000 B" in md
    if sys.platform == "linux":  # peak memory measured per run, not the process's lifetime peak
        assert summ["peak_rss_mb_run"] > 0
    # the plots
    for name in ("curves_rounds.png", "curves_comm.png", "curves_time.png", "h_hist.png", "lr_sweep.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_resume_skips_finished_runs_and_refuses_a_changed_config(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    plan = build_plan(None, dict(TINY), parse_cli(seeds="0,1", lr_grid=["hiso=0.01,0.05", "decomfl=0.05"]))
    assert len(plan.runs(out)) == 6
    cmp.compare(plan, out, quiet=True, plots=False)
    assert all((s.dir / "summary.json").is_file() for s in plan.runs(out))

    import hiso.runners.rundir as rundir
    real, calls = rundir.run_to_dir, []

    def spy(cfg, o, *a, **k):
        calls.append(str(o))
        return real(cfg, o, *a, **k)

    monkeypatch.setattr(rundir, "run_to_dir", spy)
    interrupted = cmp.run_dir(out, "hiso", 0.05, 1)
    (interrupted / "summary.json").unlink()  # as if killed mid-run
    cmp.compare(plan, out, quiet=True, plots=False)
    assert calls == [str(interrupted)]
    assert (interrupted / "summary.json").is_file()
    cmp.compare(plan, out, quiet=True, plots=False)
    assert len(calls) == 1  # all finished: nothing runs
    cmp.compare(plan, out, force=True, quiet=True, plots=False)
    assert len(calls) == 7  # --force reruns all 6

    # asking for a different configuration in the same directory is refused (one line, exit 2)
    # (more rounds continue the runs: tests/test_extend.py)
    code, _, err = _main(["compare", "--out", str(out), *TINY_FLAGS, "--mu", "0.02", "--seeds", "0,1",
                          "--lr-grid", "hiso=0.01,0.05", "--lr-grid", "decomfl=0.05", "--quiet"], capsys)
    assert code == 2 and "mu = 0.001, not 0.02" in err and len(err.strip().splitlines()) == 1
    code, _, err = _main(["compare", "--out", str(out), *TINY_FLAGS, "--rounds", "20", "--seeds", "0,1",
                          "--lr-grid", "hiso=0.01,0.05", "--lr-grid", "decomfl=0.05", "--quiet"], capsys)
    assert code == 2 and "rounds = 30, not 20" in err and "not cut to fewer" in err
    assert len(err.strip().splitlines()) == 1


def test_variants_and_overrides_from_toml(tmp_path):
    conf = tmp_path / "ablation.toml"
    conf.write_text("""
task = "quadratic"
dim = 20
clients = 4
sampled = 2
rounds = 20
eval_every = 10
lr = 0.02

[compare]
algorithms = ["decomfl", "hiso", "hiso-nu0.5"]
reference = "hiso"

[compare.lr_grid]
hiso = [0.01, 0.05]
"hiso-nu0.5" = [0.03]

[compare.overrides.hiso]
nu = 0.2
h_max = 100.0

[compare.variants]
"hiso-nu0.5" = { algorithm = "hiso", nu = 0.5 }
""")
    plan = build_plan(conf, {"rounds": 10}, parse_cli(algorithms=None))
    arms = {a.name: a for a in plan.arms}
    assert [a.name for a in plan.arms] == ["decomfl", "hiso", "hiso-nu0.5"] and plan.reference == "hiso"
    assert arms["decomfl"].lrs == (0.02,) and arms["hiso"].lrs == (0.01, 0.05) and arms["hiso-nu0.5"].lrs == (0.03,)
    cfg = plan.config(arms["hiso-nu0.5"], 0.03, 0)
    assert (cfg.algorithm, cfg.method_opts["nu"], cfg.method_opts["h_max"], cfg.lr, cfg.rounds) == (
        "hiso", 0.5, 100.0, 0.03, 10)
    assert plan.config(arms["hiso"], 0.01, 0).method_opts["nu"] == 0.2
    assert plan.config(arms["decomfl"], 0.02, 0).method_opts == {}  # hiso's overrides stay with hiso
    # a variant without its own grid inherits its algorithm's
    with pytest.raises(cmp.ConfigError, match="reference: 'hiso' is not one of"):
        build_plan(conf, {}, parse_cli(algorithms="hiso-nu0.5"))
    plan2 = build_plan(conf, {}, parse_cli(algorithms="hiso-nu0.5,hiso", lr_grid=["hiso=0.07"],
                                           reference="hiso-nu0.5"))
    assert plan2.arms[0].lrs == (0.03,) and plan2.arms[1].lrs == (0.07,)  # a variant's own grid wins
    # a grid asked for that no compared arm uses is refused (the file's unused hiso grid is not)
    with pytest.raises(cmp.ConfigError, match="--lr-grid hiso: no compared arm uses it"):
        build_plan(conf, {}, parse_cli(algorithms="hiso-nu0.5", lr_grid=["hiso=0.07"], reference="hiso-nu0.5"))
    assert build_plan(conf, {}, parse_cli(algorithms="hiso-nu0.5", reference="hiso-nu0.5")).arms[0].lrs == (0.03,)
    conf.write_text(conf.read_text().replace('"hiso-nu0.5" = [0.03]\n', ""))
    plan3 = build_plan(conf, {}, parse_cli(algorithms="hiso-nu0.5,hiso"))
    assert plan3.arms[0].lrs == (0.01, 0.05) and plan3.reference == "hiso"
    plan4 = build_plan(conf, {}, parse_cli(algorithms="hiso-nu0.5", lr_grid=["hiso=0.07"], reference="hiso-nu0.5"))
    assert plan4.arms[0].lrs == (0.07,)  # used: the variant inherits it
    cmp.compare(plan, tmp_path / "out", quiet=True, plots=False)
    saved = json.loads((tmp_path / "out/runs/hiso-nu0.5/lr0.03/seed0/config.json").read_text())
    assert saved["method_opts"]["nu"] == 0.5 and saved["algorithm"] == "hiso"
    assert load_run_result(tmp_path / "out/runs/hiso-nu0.5/lr0.03/seed0").summary["rounds"] == 10


@pytest.mark.parametrize("args, toml, needle", [
    (["--algorithms", "hiso,sgd"], None, "unknown algorithm 'sgd'"),
    (["--algorithms", "hiso,,decomfl"], None, "comma-separated"),
    (["--algorithms", "hiso,hiso"], None, "listed twice"),
    (["--seeds", "0,x"], None, "--seeds"),
    (["--seeds", "1,1"], None, "distinct"),
    (["--lr-grid", "hiso"], None, "NAME=LR"),
    (["--lr-grid", "hiso=0.1,-1"], None, "positive"),
    (["--lr-grid", "nope=0.1"], None, "neither an algorithm nor a variant"),
    (["--lr-grid", "decomfl=0.1", "--algorithms", "hiso"], None, "--lr-grid decomfl: no compared arm uses it"),
    (["--lr-grid", "fedavg=0.1"], None, "--lr-grid fedavg: no compared arm uses it"),
    (["--reference", "fedavg"], None, "not one of the compared"),
    (["--metric", "eval_acc"], None, "reports gap, eval_loss"),
    (["--algorithm", "hiso"], None, "unrecognized"),
    (["--lr", "0"], None, "lr: Input should be greater than 0"),
    ([], "seed = 3\n", "[compare] seeds"),
    ([], "[compare]\nalgorithms = 'hiso'\n", "compare.algorithms"),
    ([], "[compare]\nbogus = 1\n", "compare.bogus"),
    ([], "[compare.variants]\nhiso = {algorithm = 'hiso', nu = 0.1}\n", "cannot be named after"),
    ([], "[compare.variants]\nv1 = {nu = 0.1}\n", "needs an algorithm"),
    ([], "[compare.variants]\nv1 = {algorithm = 'hiso', lr = 0.1}\n", "lr_grid"),
    ([], "[compare.variants]\nv1 = {algorithm = 'hiso', nuu = 0.1}\n", "unknown option 'nuu'"),
    ([], "[compare.overrides.hiso]\nnu = 2.0\n", "hiso: nu"),
    ([], "[compare]\nalgorithms = ['v1']\n[compare.variants]\nv1 = {algorithm = 'hiso', nu = -1.0}\n", "v1: nu"),
    (["--config", "/nonexistent/c.toml"], None, "config file not found"),
])
def test_bad_compare_options_give_one_line_and_exit_2(tmp_path, capsys, args, toml, needle):
    extra = []
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
        extra = ["--config", str(tmp_path / "c.toml")]
    code, out, err = _main(["compare", "--out", str(tmp_path / "x"), *TINY_FLAGS, "--quiet", *extra, *args],
                           capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hiso: error:") and needle in lines[0], err
    assert not (tmp_path / "x").exists()  # nothing ran


def test_parallel_jobs_give_the_same_runs_as_sequential(tmp_path, capsys):
    """--jobs 2 only changes where runs execute, not what they compute."""
    args = [*TINY_FLAGS, "--seeds", "0", "--lr-grid", "hiso=0.02,0.05", "--lr-grid", "decomfl=0.05", "--quiet"]
    assert _main(["compare", "--out", str(tmp_path / "seq"), *args], capsys)[0] == 0
    assert _main(["compare", "--out", str(tmp_path / "par"), "--jobs", "2", *args], capsys)[0] == 0
    for run in ("hiso/lr0.02/seed0", "hiso/lr0.05/seed0", "decomfl/lr0.05/seed0"):
        a = (tmp_path / "seq/runs" / run / "history.bin").read_bytes()
        b = (tmp_path / "par/runs" / run / "history.bin").read_bytes()
        assert a == b and len(a) > 100
    assert (tmp_path / "par/table.csv").read_text().splitlines()[0] == (tmp_path / "seq/table.csv").read_text().splitlines()[0]
    code, _, err = _main(["compare", "--out", str(tmp_path / "bad"), "--jobs", "0", *args], capsys)
    assert code == 2 and "--jobs" in err


def test_table_only_reports_the_finished_runs_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    flags = ["compare", "--out", str(out), *TINY_FLAGS, "--seeds", "0,1", "--lr-grid", "hiso=0.01,0.05",
             "--lr-grid", "decomfl=0.05", "--quiet"]
    assert _main(flags, capsys)[0] == 0
    cut = cmp.run_dir(out, "hiso", 0.05, 1)
    (cut / "summary.json").unlink()  # as if still running
    before = {f.name: f.read_bytes() for f in cut.iterdir()}
    code, stdout, err = _main([*flags[:-1], "--table-only"], capsys)
    assert code == 0, err
    assert "hiso: lr=0.05 (seed 1)" in err
    assert {f.name: f.read_bytes() for f in cut.iterdir()} == before  # nothing ran
    grid = [e["lr"] for e in json.loads((out / "selection.json").read_text())["arms"]["hiso"]["grid"]]
    assert grid == [0.01] and "HiSo" in stdout
    # the reference with nothing finished: one line, exit 2; --force with it: refused
    for d in out.glob("runs/decomfl/*/seed1"):
        (d / "summary.json").unlink()
    code, _, err = _main(flags + ["--table-only"], capsys)
    assert code == 2 and "reference decomfl" in err and len(err.strip().splitlines()) == 1
    code, _, err = _main(flags + ["--table-only", "--force"], capsys)
    assert code == 2 and "choose one" in err


def _csv_rows(path):
    return {r["algorithm"]: r for r in csv.DictReader(path.read_text().splitlines())}


def test_table_only_at_round_tabulates_runs_as_they_stood(tmp_path, capsys):
    """--table-only --at-round R: every run, finished or still going, cut at round R, equals a
    compare of R rounds (metrics, rounds to reach, bytes per client, client work); 'latest' is the
    last round every run going has logged (a torn last line is not read); what has not reached R
    is listed and left out; the final table is never replaced; bad uses are one line."""
    base = [*TINY_FLAGS[:-4], "--eval-every", "10", "--seeds", "0", "--lr-grid", "hiso=0.05",
            "--lr-grid", "decomfl=0.05", "--quiet"]
    out, short = tmp_path / "cmp", tmp_path / "short"
    assert _main(["compare", "--out", str(out), *base, "--rounds", "30"], capsys)[0] == 0
    assert _main(["compare", "--out", str(short), *base, "--rounds", "20"], capsys)[0] == 0
    final = (out / "table.md").read_bytes()
    going = cmp.run_dir(out, "hiso", 0.05, 0)
    (going / "summary.json").unlink()  # hiso still going: logged up to round 25, writing round 26
    lines = (going / "metrics.jsonl").read_text().splitlines()
    (going / "metrics.jsonl").write_text("\n".join(lines[:26]) + "\n" + lines[26][:15])

    code, stdout, err = _main(["compare", "--out", str(out), "--table-only", "--at-round", "20", "--quiet"], capsys)
    assert code == 0, err
    cut, want = _csv_rows(out / "round20/table.csv"), _csv_rows(short / "table.csv")
    same = ["best_gap_mean", "rounds_to_reach", "speedup", "bytes_up_per_client", "bytes_down_per_client",
            "bytes_to_reach_per_client", "client_forwards_per_round", "last_gap_mean"]
    assert {a: [r[k] for k in same] for a, r in cut.items()} == {a: [r[k] for k in same] for a, r in want.items()}
    assert "as they stood at round 20 of the 30 planned" in stdout
    assert json.loads((out / "round20/selection.json").read_text())["at_round"] == 20
    assert (out / "round20/curves_rounds.png").is_file() and (out / "table.md").read_bytes() == final

    code, stdout, err = _main(["compare", "--out", str(out), "--table-only", "--at-round", "latest"], capsys)
    assert code == 0, err
    assert (out / "round25/table.csv").is_file() and "round25" in stdout and "left out" not in err
    code, stdout, err = _main(["compare", "--out", str(out), "--table-only", "--at-round", "28"], capsys)
    assert code == 0, err
    assert "hiso: lr=0.05 (seed 0 at round 25, not yet 28)" in err and set(_csv_rows(out / "round28/table.csv")) == {"decomfl"}
    ref = cmp.run_dir(out, "decomfl", 0.05, 0)
    (ref / "summary.json").unlink()  # the reference going too, at round 30: 31 is reached by none
    for args, needle in ((["--at-round", "31"], "reference decomfl"), (["--at-round", "x"], "'latest'"),
                         (["--at-round", "-1"], "'latest'")):
        code, _, err = _main(["compare", "--out", str(out), "--table-only", *args, "--quiet"], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], err
    code, _, err = _main(["compare", "--out", str(tmp_path / "new"), *base, "--at-round", "5"], capsys)
    assert code == 2 and "--table-only" in err and not (tmp_path / "new").exists()


def test_table_only_reads_the_plan_recorded_in_the_directory(tmp_path, capsys):
    """--table-only tabulates DIR by its compare.json: no config or flags needed, a config whose
    rounds the runs were since extended past still works, flags narrow it, and a directory
    without a compare is one line."""
    conf = tmp_path / "c.toml"
    conf.write_text('task = "quadratic"\ndim = 20\nclients = 4\nsampled = 2\nrounds = 30\neval_every = 10\n'
                    '[compare]\nseeds = [0, 1]\n[compare.lr_grid]\nhiso = [0.01, 0.05]\ndecomfl = [0.05]\n')
    out = tmp_path / "cmp"
    assert _main(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)[0] == 0
    assert _main(["compare", "--config", str(conf), "--out", str(out), "--rounds", "40", "--quiet"], capsys)[0] == 0
    ran = json.loads((out / "selection.json").read_text())
    for args in (["--out", str(out)], ["--config", str(conf), "--out", str(out)]):  # the file says 30 rounds
        (out / "selection.json").unlink()
        code, stdout, err = _main(["compare", *args, "--table-only", "--quiet"], capsys)
        assert code == 0, err
        assert json.loads((out / "selection.json").read_text()) == ran and "HiSo" in stdout
    # flags narrow it: the recorded reference (decomfl) left out, hiso is the reference
    code, _, err = _main(["compare", "--out", str(out), "--table-only", "--algorithms", "hiso", "--seeds", "1",
                          "--lr-grid", "hiso=0.05", "--quiet"], capsys)
    assert code == 0, err
    sel = json.loads((out / "selection.json").read_text())
    assert (sel["reference"], list(sel["arms"]), sel["seeds"]) == ("hiso", ["hiso"], [1])
    assert [e["lr"] for e in sel["arms"]["hiso"]["grid"]] == [0.05]
    # an option the runs were not made with: one line naming it; no compare there: one line
    for args, needle in ((["--out", str(out), "--rounds", "30"], "drop --rounds"),
                         (["--out", str(tmp_path / "none")], "holds no compare (no compare.json)")):
        code, _, err = _main(["compare", *args, "--table-only", "--quiet"], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("hiso: error:") and needle in lines[0], err
    assert not (tmp_path / "none").exists()


def test_the_recorded_plan_rebuilds_the_same_plan(tmp_path):
    """compare.json holds all --table-only needs: every example config's plan (variants,
    per-algorithm overrides, grids, select_on) comes back the same from it."""
    from pathlib import Path

    from hiso.experiments.compare_plan import table_plan
    for conf in sorted((Path(__file__).parent.parent / "configs").glob("*.toml")):
        plan = build_plan(conf)
        (tmp_path / "compare.json").write_text(json.dumps(plan.to_json()))
        again = table_plan(tmp_path)
        assert again.to_json() == plan.to_json(), conf.name
        assert again.runs(tmp_path) == plan.runs(tmp_path), conf.name
