"""hiso compare --select-on val|test: lr and each run's reported round chosen on a validation split
held out from the reported examples, the test metric reported at that round; the labels, the
default, compare.json/selection.json, and the one-line refusals.

Most tests write finished runs by hand (config.json as compare would ask for it, metrics.jsonl
with made-up eval_acc / val_acc curves, summary.json) so that validation and test disagree on
purpose; compare then skips every run (nothing trains) and only selects and reports.
"""

import csv
import io
import json

import pytest

from cli_helpers import run_cli
from hiso.config import option_fields
from hiso.report.table import build_table, csv_columns, selected_row, selected_value, val_metric
from hiso.experiments import compare as cmp

ROUNDS, EVERY = 30, 10  # evaluated at rounds 0, 10, 20, 30
FLAGS = ["--task", "mnist", "--clients", "4", "--sampled", "2", "--rounds", str(ROUNDS),
         "--eval-every", str(EVERY), "--algorithms", "hiso,decomfl", "--seeds", "0,1",
         "--lr-grid", "hiso=0.001,0.01", "--lr-grid", "decomfl=0.001"]

# (val_acc, eval_acc) at rounds 0, 10, 20, 30 for seed 0; seed s adds 0.01 * s to every value.
# hiso at lr 0.001 is best on validation (0.8 at round 20, where its test is only 0.6);
# hiso at lr 0.01 is best on test (0.95 at round 10) but worse on validation (0.7).
CURVES = {
    ("hiso", 0.001): ([0.10, 0.76, 0.80, 0.70], [0.10, 0.50, 0.60, 0.90]),
    ("hiso", 0.01): ([0.10, 0.60, 0.70, 0.70], [0.10, 0.95, 0.60, 0.60]),
    ("decomfl", 0.001): ([0.10, 0.40, 0.75, 0.75], [0.10, 0.50, 0.70, 0.80]),
}


def _rows(val, test, seed, with_val=True):
    rows = []
    for r in range(ROUNDS + 1):
        row = {"round": r, "train_loss": 2.0 - r / 100, "wall_s": 0.5 * r, "bytes_up": 8 * r, "bytes_down": 40 * r}
        if r % EVERY == 0:
            i = r // EVERY
            row["eval_acc"] = test[i] + 0.01 * seed
            row["eval_loss"] = 1.0 - row["eval_acc"]
            if with_val:
                row["val_acc"] = val[i] + 0.01 * seed
                row["val_loss"] = 1.0 - row["val_acc"]
        rows.append(row)
    return rows


def write_runs(out, argv, with_val=True):
    """Finished runs of the plan ``argv`` asks for, with CURVES as their metrics."""
    args = _parse(argv)
    plan = cmp.build_plan(None, {k: v for k, v in vars(args).items() if k in option_fields()},
                          cmp.parse_cli(args.algorithms, args.seeds, args.lr_grid, args.reference, args.metric,
                                        args.select_on))
    for spec in plan.runs(out):
        spec.dir.mkdir(parents=True)
        cfg = spec.cfg.model_dump()
        n_val = 500 if spec.cfg.val_fraction > 0 else 0
        (spec.dir / "config.json").write_text(json.dumps({**cfg, "task_info": {"n_eval": 1000 - n_val, "n_val": n_val}}))
        val, test = CURVES[(spec.arm.name, spec.lr)]
        rows = _rows(val, test, spec.seed, with_val)
        (spec.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (spec.dir / "summary.json").write_text(json.dumps({
            "communication_per_client": {"bytes_up_mean": 240.0, "bytes_down_mean": 1200.0},
            "s_per_round": 0.5, "wall_s_total": 15.0, "best": {"eval_acc": max(test)}}))
    return plan


def _parse(argv):
    from hiso.cli import build_parser
    return build_parser().parse_args(["compare", "--out", "unused", *argv])


def _table(out):
    rows = list(csv.DictReader(io.StringIO((out / "table.csv").read_text())))
    return {r["algorithm"]: r for r in rows}


# --------------------------------------------------------------------------- pure functions

def test_selected_row_is_the_first_best_validation_round_not_the_best_test_round():
    rows = _rows(*CURVES[("hiso", 0.001)], seed=0)
    assert selected_row(rows, "eval_acc", "val_acc", True)["round"] == 20
    assert selected_value(rows, "eval_acc", "val_acc", True) == pytest.approx(0.60)  # not the best test, 0.90
    assert selected_value(rows, "eval_acc", "eval_acc", True) == pytest.approx(0.90)  # selecting on test
    tie = _rows([0.1, 0.8, 0.8, 0.8], [0.1, 0.3, 0.9, 0.2], seed=0)
    assert selected_row(tie, "eval_acc", "val_acc", True)["round"] == 10  # ties: the first round
    loss = _rows([0.9, 0.5, 0.2, 0.4], [0.9, 0.1, 0.3, 0.2], seed=0)
    assert selected_value(loss, "eval_acc", "val_acc", False) == pytest.approx(0.3)  # lower is better
    assert val_metric("eval_loss") == "val_loss"
    with pytest.raises(ValueError, match="no validation counterpart"):
        val_metric("gap")


# --------------------------------------------------------------------------- compare end to end

def test_select_on_val_picks_the_lr_best_on_validation_and_reports_test_at_that_round(tmp_path, capsys):
    out = tmp_path / "cmp"
    write_runs(out, [*FLAGS, "--val-fraction", "0.5"])
    code, stdout, err = run_cli(["compare", *FLAGS, "--val-fraction", "0.5", "--select-on", "val",
                                 "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    sel = json.loads((out / "selection.json").read_text())
    assert sel["select_on"] == "val" and sel["select_metric"] == "val_acc"
    assert sel["arms"]["hiso"]["chosen_lr"] == 0.001  # best on validation; on test 0.01 would win
    grid = {g["lr"]: g for g in sel["arms"]["hiso"]["grid"]}
    assert grid[0.001]["mean_best"] == pytest.approx(0.805) and grid[0.01]["mean_best"] == pytest.approx(0.705)
    assert grid[0.001]["eval_acc_at_selected_per_seed"] == pytest.approx({"0": 0.60, "1": 0.61})
    plan = json.loads((out / "compare.json").read_text())
    assert plan["select_on"] == "val" and plan["select_metric"] == "val_acc"

    t = _table(out)
    col = "eval_acc_pct_at_best_val_acc"
    assert list(next(iter(t.values())).keys()) == csv_columns("eval_acc", "val_acc")
    # test accuracy at the round best on validation (round 20): 0.60 / 0.61, not the best test 0.90
    assert float(t["hiso"][f"{col}_mean"]) == pytest.approx(60.5)
    assert float(t["hiso"][f"{col}_std"]) == pytest.approx(0.7071, abs=1e-3)
    assert float(t["decomfl"][f"{col}_mean"]) == pytest.approx(70.5)  # at its round 20, not its best 80.5
    # rounds to reach on validation: T = DeComFL's mean best val_acc 0.755; HiSo's val reaches it at
    # round 10 (0.76, 0.77); DeComFL's own row: its selected round, 20
    assert t["decomfl"]["rounds_to_reach"] == "20" and t["hiso"]["rounds_to_reach"] == "10"
    assert float(t["hiso"]["speedup"]) == pytest.approx(2.0)
    assert float(t["hiso"]["seconds_to_reach"]) == pytest.approx(5.0)  # wall_s at round 10

    md = (out / "table.md").read_text()
    head = md.splitlines()[0]
    assert "eval accuracy (%) at best validation accuracy round" in head and "selected on test" not in head
    assert "rounds to DeComFL's best validation accuracy (75.50%)" in head
    assert "60.50 ± 0.71" in md and "20 (selected round)" in md
    assert "selected on validation (500 held-out examples, apart from the 500 reported)" in md
    assert "selected on test" not in md and stdout.startswith(head)


def test_select_on_test_reproduces_the_selection_on_the_reported_examples(tmp_path, capsys):
    out = tmp_path / "cmp"
    write_runs(out, [*FLAGS, "--val-fraction", "0.5"])
    code, _, err = run_cli(["compare", *FLAGS, "--val-fraction", "0.5", "--select-on", "test",
                            "--out", str(out), "--quiet"], capsys)
    assert code == 0, err  # the same finished runs, reported the other way: nothing reruns
    sel = json.loads((out / "selection.json").read_text())
    assert sel["select_on"] == "test" and sel["select_metric"] == "eval_acc"
    assert sel["arms"]["hiso"]["chosen_lr"] == 0.01  # best test: 0.95, 0.96
    assert json.loads((out / "compare.json").read_text())["select_on"] == "test"
    t = _table(out)
    assert list(next(iter(t.values())).keys()) == csv_columns("eval_acc")  # the columns of before
    assert float(t["hiso"]["best_eval_acc_pct_mean"]) == pytest.approx(95.5)
    assert float(t["decomfl"]["best_eval_acc_pct_mean"]) == pytest.approx(80.5)
    # T = 0.805 on test: DeComFL's own best at round 30; HiSo's test reaches it at round 10
    assert t["decomfl"]["rounds_to_reach"] == "30" and t["hiso"]["rounds_to_reach"] == "10"
    assert float(t["hiso"]["speedup"]) == pytest.approx(3.0)
    md = (out / "table.md").read_text()
    assert "best eval accuracy (%), selected on test" in md.splitlines()[0]
    assert "30 (own best)" in md and "selected on test: lr and each run's reported round are chosen on the very " \
        "examples reported" in md
    # the same numbers as the table without any selection metric (the behaviour before --select-on)
    arms, _ = cmp.collect(cmp.build_plan(None, {"task": "mnist", "clients": 4, "sampled": 2, "rounds": ROUNDS,
                                                "eval_every": EVERY, "val_fraction": 0.5},
                                         {"algorithms": ["hiso", "decomfl"], "seeds": [0, 1], "select_on": "test",
                                          "lr_grid": {"hiso": [0.001, 0.01], "decomfl": [0.001]}}), out)
    old = build_table(arms, "decomfl", "eval_acc")
    assert [(r.lr, r.best_mean, r.rounds) for r in old.rows] == [
        (float(t[n]["lr"]), float(t[n]["best_eval_acc_pct_mean"]) / 100, float(t[n]["rounds_to_reach"]))
        for n in ("hiso", "decomfl")]


def test_default_is_val_with_a_validation_split_else_test_with_a_note(tmp_path, capsys):
    val_flags = [*FLAGS, "--val-fraction", "0.5"]
    assert cmp.build_plan(None, *_flags(val_flags)).select_on == "val"
    plan = cmp.build_plan(None, *_flags(FLAGS))  # val_fraction 0: no split
    assert plan.select_on == "test" and "--val-fraction" in plan.select_note
    lang = {"task": "sst2", "val_fraction": 0.5}  # the language tasks have one too
    assert cmp.build_plan(None, lang, {}).select_on == "val"
    quad = cmp.build_plan(None, {"task": "quadratic"}, {})
    assert quad.select_on == "test" and "has no validation split" in quad.select_note
    toml = tmp_path / "c.toml"
    toml.write_text('task = "mnist"\nval_fraction = 0.5\n[compare]\nselect_on = "test"\n')
    assert cmp.build_plan(toml).select_on == "test"  # the file's choice
    assert cmp.build_plan(toml, None, {"select_on": "val"}).select_on == "val"  # the flag replaces it

    out = tmp_path / "cmp"
    write_runs(out, FLAGS, with_val=False)
    code, stdout, err = run_cli(["compare", *FLAGS, "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    assert "selected on test" in stdout and "val_fraction = 0: no validation split" in stdout
    assert json.loads((out / "selection.json").read_text())["select_note"].startswith("val_fraction = 0")


def _flags(argv):
    args = _parse(argv)
    return ({k: v for k, v in vars(args).items() if k in option_fields()},
            cmp.parse_cli(args.algorithms, args.seeds, args.lr_grid, args.reference, args.metric, args.select_on))


@pytest.mark.parametrize("argv, needle", [
    ([*FLAGS, "--select-on", "val"], "val_fraction = 0 leaves no validation split to select on; give --val-fraction"),
    (["--task", "quadratic", "--select-on", "val"], "task quadratic has no validation split"),
])
def test_select_on_val_without_a_validation_split_is_refused_in_one_line(tmp_path, capsys, argv, needle):
    out = tmp_path / "cmp"
    write_runs(out, FLAGS, with_val=False)  # an earlier compare's finished runs and compare.json
    (out / "compare.json").write_text("earlier")
    code, _, err = run_cli(["compare", *argv, "--out", str(out), "--quiet"], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert (out / "compare.json").read_text() == "earlier"  # a refused compare rewrites nothing


def test_runs_without_val_metrics_are_refused_in_one_line(tmp_path, capsys):
    """A task that declares a validation split but whose runs report no val_* metric."""
    out = tmp_path / "cmp"
    write_runs(out, [*FLAGS, "--val-fraction", "0.5"], with_val=False)
    code, _, err = run_cli(["compare", *FLAGS, "--val-fraction", "0.5", "--out", str(out), "--quiet"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'val_acc' not in" in err and "--select-on test" in err


def test_plots_mark_the_reported_points_and_sweep_the_validation_metric(tmp_path, monkeypatch):
    from hiso.report import plots

    out = tmp_path / "cmp"
    plan = write_runs(out, [*FLAGS, "--val-fraction", "0.5"])
    seen = {}
    real_sweep, real_curves = plots.plot_lr_sweep, plots.plot_curves
    monkeypatch.setattr(plots, "plot_lr_sweep", lambda arms, o, metric, **k: seen.setdefault(
        "sweep", metric) and real_sweep(arms, o, metric, **k))
    monkeypatch.setattr(plots, "plot_curves", lambda *a: seen.setdefault("curves", []).append(a[-1]) or real_curves(*a))
    cmp.compare(plan, out, quiet=True, plots=True)
    assert seen["sweep"] == "val_acc" and seen["curves"] == ["val_acc"] * 3
    assert plots._selected_point(load_one(out), "eval_acc", "val_acc", "round") == (20.0, pytest.approx(0.60))
    assert plots._selected_point(load_one(out), "eval_acc", "val_acc", "time") == (10.0, pytest.approx(0.60))
    assert (out / "curves_rounds.png").stat().st_size > 0 and (out / "lr_sweep.png").stat().st_size > 0


def load_one(out):
    from hiso.report.table import load_run_result
    return load_run_result(out / "runs/hiso/lr0.001/seed0")


@pytest.mark.slow
def test_a_real_compare_on_a_vision_task_selects_on_validation_by_default(tmp_path, capsys):
    """Real runs (a tiny synthetic MNIST): val_* reach metrics.jsonl and the table says so."""
    from test_vision_data import make_idx_dir

    data = tmp_path / "data"
    data.mkdir()
    make_idx_dir(data, n_train=200, n_test=40)
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "--task", "mnist", "--data-dir", str(data), "--val-fraction", "0.5",
                                 "--clients", "3", "--sampled", "2", "--rounds", "4", "--eval-every", "2",
                                 "--batch-size", "8", "--perturbations", "1", "--threads", "1",
                                 "--algorithms", "hiso,decomfl", "--lr-grid", "hiso=0.001,0.002",
                                 "--lr-grid", "decomfl=0.001", "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "runs/hiso/lr0.001/seed0/metrics.jsonl").read_text().splitlines()]
    assert {"val_acc", "eval_acc"} <= set(rows[0])
    assert json.loads((out / "runs/hiso/lr0.001/seed0/config.json").read_text())["task_info"]["n_val"] == 20
    sel = json.loads((out / "selection.json").read_text())
    assert sel["select_on"] == "val"
    means = {g["lr"]: g["mean_best"] for g in sel["arms"]["hiso"]["grid"]}
    best_val = {lr: max(json.loads(x).get("val_acc", -1) for x in
                        (out / f"runs/hiso/lr{lr!r}/seed0/metrics.jsonl").read_text().splitlines()) for lr in means}
    assert means == pytest.approx(best_val)
    assert "at best validation accuracy round" in stdout
