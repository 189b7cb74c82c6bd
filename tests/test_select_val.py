"""hiso compare selects lr and each run's reported round on a validation split, and reports the
test metric at that round; selecting on the test examples stays possible and is labelled so."""

import json

import pytest

from cli_helpers import run_cli
from hiso.config import ConfigError
from hiso.report.table import build_table, footer, selected_row, selected_value, to_markdown
from hiso.runners import compare as cmp

EVERY = 10


def _rows(val, test):
    """Metrics rows evaluated every EVERY rounds with the given validation and test accuracies."""
    rows = []
    for i, (v, t) in enumerate(zip(val, test)):
        for r in range(i * EVERY - EVERY + 1 if i else 0, i * EVERY + 1):
            row = {"round": r, "train_loss": 1.0, "wall_s": 0.1 * r}
            if r == i * EVERY:
                row.update(val_acc=v, eval_acc=t)
            rows.append(row)
    return rows


def test_the_reported_value_is_the_test_metric_at_the_round_best_on_validation():
    rows = _rows(val=[0.1, 0.7, 0.6, 0.65], test=[0.1, 0.6, 0.8, 0.7])
    assert selected_row(rows, "eval_acc", "val_acc", True)["round"] == 10
    assert selected_value(rows, "eval_acc", "val_acc", True) == 0.6  # not the best test value 0.8
    assert selected_value(rows, "eval_acc", "eval_acc", True) == 0.8  # selecting on test: its best
    tie = _rows(val=[0.1, 0.7, 0.7], test=[0.1, 0.5, 0.9])
    assert selected_value(tie, "eval_acc", "val_acc", True) == 0.5  # ties: the first such round


def _fake_finished_runs(plan, out, curves):
    """Write finished runs of ``plan`` into ``out``: curves[(arm, lr, seed)] = (val, test)."""
    for spec in plan.runs(out):
        val, test = curves[(spec.arm.name, spec.lr, spec.seed)]
        spec.dir.mkdir(parents=True)
        (spec.dir / "config.json").write_text(json.dumps({**json.loads(spec.cfg.model_dump_json()),
                                                          "task_info": {"n_eval": 500, "n_val": 500}}))
        (spec.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(val, test)))
        (spec.dir / "summary.json").write_text(json.dumps({
            "communication_per_client": {"bytes_up_mean": 1.0, "bytes_down_mean": 2.0},
            "s_per_round": 0.1, "peak_rss_mb": 1.0}))


# hiso's lr 0.01 is best on test (0.9) but lr 0.003 is best on validation; per seed
CURVES = {
    ("hiso", 0.003, 0): ([0.1, 0.8, 0.85, 0.8], [0.1, 0.7, 0.75, 0.8]),
    ("hiso", 0.003, 1): ([0.1, 0.75, 0.8, 0.7], [0.1, 0.65, 0.7, 0.85]),
    ("hiso", 0.01, 0): ([0.1, 0.6, 0.7, 0.6], [0.1, 0.9, 0.6, 0.5]),
    ("hiso", 0.01, 1): ([0.1, 0.6, 0.65, 0.6], [0.1, 0.9, 0.6, 0.5]),
    ("decomfl", 0.002, 0): ([0.1, 0.5, 0.6, 0.7], [0.1, 0.5, 0.65, 0.6]),
    ("decomfl", 0.002, 1): ([0.1, 0.5, 0.7, 0.6], [0.1, 0.55, 0.6, 0.7]),
}


def _plan(select_on=None, **shared):
    flags = {"algorithms": ["hiso", "decomfl"], "seeds": [0, 1], "lr_grid": {"hiso": [0.003, 0.01], "decomfl": [0.002]}}
    if select_on:
        flags["select_on"] = select_on
    return cmp.build_plan(None, {"task": "mnist", "clients": 4, "sampled": 2, "rounds": 30, "eval_every": EVERY,
                                 **shared}, flags)


def test_lr_and_round_are_selected_on_validation_and_the_table_reports_test(tmp_path):
    plan = _plan()  # the default where the task has a validation split
    assert plan.select_on == "val" and plan.select_metric == "val_acc" and plan.shared["val_fraction"] == 0.5
    _fake_finished_runs(plan, tmp_path, CURVES)
    cmp.compare(plan, tmp_path, quiet=True, plots=False)
    sel = json.loads((tmp_path / "selection.json").read_text())
    assert sel["select_metric"] == "val_acc" and sel["arms"]["hiso"]["chosen_lr"] == 0.003
    table = (tmp_path / "table.md").read_text()
    header = table.splitlines()[0]
    assert "eval accuracy (%) at the round best on validation" in header
    hiso_row = next(line for line in table.splitlines() if line.startswith("| HiSo"))
    # seed 0: test 0.75 at round 20 (val 0.85); seed 1: test 0.70 at round 20 (val 0.80)
    assert "72.50 ± 3.54" in hiso_row
    assert "selected on validation" in table and json.loads((tmp_path / "compare.json").read_text())["select_on"] == "val"


def test_selecting_on_test_is_the_old_rule_and_says_so(tmp_path):
    plan = _plan(select_on="test", val_fraction=0.5)
    _fake_finished_runs(plan, tmp_path, CURVES)
    cmp.compare(plan, tmp_path, quiet=True, plots=False)
    assert json.loads((tmp_path / "selection.json").read_text())["arms"]["hiso"]["chosen_lr"] == 0.01
    table = (tmp_path / "table.md").read_text()
    assert "best eval accuracy (%), selected on test" in table.splitlines()[0]
    assert "90.00 ± 0.00" in next(line for line in table.splitlines() if line.startswith("| HiSo"))
    assert "selected on the test examples themselves" in table


def test_validation_asked_for_where_there_is_none_is_refused_and_the_default_says_why(tmp_path, capsys):
    with pytest.raises(ConfigError, match="val_fraction = 0"):
        _plan(select_on="val", val_fraction=0)
    assert _plan(val_fraction=0).select_on == "test"
    code, _, err = run_cli(["compare", "--out", str(tmp_path / "q"), "--task", "quadratic", "--select-on", "val",
                            "--rounds", "2"], capsys)
    assert code == 2 and "no validation split" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()
    plan = cmp.build_plan(None, {"task": "quadratic", "dim": 10, "clients": 3, "sampled": 2, "rounds": 4,
                                 "eval_every": 2}, {"algorithms": ["hiso", "decomfl"]})
    assert plan.select_on == "test" and "no validation split" in plan.select_note
    cmp.compare(plan, tmp_path / "q2", quiet=True, plots=False)
    assert "no validation split" in (tmp_path / "q2" / "table.md").read_text()
