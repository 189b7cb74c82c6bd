"""hiso compare's report: each run's own time, a refused compare writes nothing, round progress
with --jobs, time to accuracy, lr-at-the-edge warnings, and the single-seed footer."""

import json
import re
import sys

import pytest

from cli_helpers import run_cli
from hiso.report.table import ArmResult, RunResult, build_table, csv_columns, footer, to_csv, to_markdown
from hiso.experiments import compare as cmp

TINY_FLAGS = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2",
              "--rounds", "30", "--eval-every", "10"]
GRID = ["--lr-grid", "hiso=0.02,0.05", "--lr-grid", "decomfl=0.05"]


_main = run_cli


class FakeBar:
    """Records what compare does with its tqdm bar."""

    made: list["FakeBar"] = []

    def __init__(self, total=None, initial=0, unit="it", disable=False, **_):
        self.total, self.n, self.unit = total, initial, unit
        self.updates, self.writes, self.postfixes = [], [], []
        FakeBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)
        self.n += n

    def write(self, s, *a, **k):
        self.writes.append(s)

    def set_postfix_str(self, s, *a, **k):
        self.postfixes.append(s)

    def set_postfix(self, *a, **k):
        pass

    def close(self):
        pass


def _own_times(lines):
    """{run label: seconds} from the '[k/N] label: best ..., T s' lines."""
    out = {}
    for line in lines:
        m = re.match(r"\[\d+/\d+\] (.+): best \S+ \S+, ([\d.]+) s$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# --------------------------------------------------------------------------- running

@pytest.mark.parametrize("jobs", [1, 2])
def test_each_run_prints_its_own_time_and_parallel_runs_report_rounds(tmp_path, monkeypatch, capsys, jobs):
    FakeBar.made = []
    monkeypatch.setattr("tqdm.tqdm", FakeBar)
    out = tmp_path / "cmp"
    code, _, err = _main(["compare", "--out", str(out), *TINY_FLAGS, "--seeds", "0", *GRID,
                          "--jobs", str(jobs)], capsys)
    assert code == 0
    bar = FakeBar.made[0]
    times = _own_times(bar.writes)
    specs = cmp.build_plan(None, {"task": "quadratic", "dim": 20, "clients": 4, "sampled": 2, "rounds": 30,
                                  "eval_every": 10},
                           cmp.parse_cli(seeds="0", lr_grid=["hiso=0.02,0.05", "decomfl=0.05"])).runs(out)
    assert set(times) == {s.label for s in specs}
    for s in specs:  # the run's own time (its summary), not the time since it was queued
        own = json.loads((s.dir / "summary.json").read_text())["wall_s_total"]
        assert times[s.label] == pytest.approx(own, abs=0.051)
    if jobs == 1:
        assert bar.unit == "run" and bar.n == 3
        return
    # --jobs 2: the bar counts rounds, fed by the workers as they go, not once per finished run
    assert bar.unit == "round" and bar.total == 3 * 30 and sum(bar.updates) == 90
    assert len(bar.updates) > 3 and 1 in bar.updates, bar.updates  # round 1 of a run arrived on its own
    assert any("--jobs 1 is faster" in w for w in bar.writes)  # start-up cost is said
    assert re.search(r"--jobs 2: [\d.]+ s elapsed for 3 runs taking [\d.]+ s by themselves", err)


def test_a_refused_compare_rewrites_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--out", str(out), *TINY_FLAGS, "--seeds", "0", "--lr-grid", "hiso=0.05",
            "--lr-grid", "decomfl=0.05", "--quiet"]
    assert _main(args, capsys)[0] == 0
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert json.loads((out / "compare.json").read_text())["shared"]["rounds"] == 30
    code, _, err = _main([*args, "--rounds", "20"], capsys)  # over finished 30-round runs (more would extend them)
    assert code == 2 and "rounds = 30, not 20" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # compare.json included


# --------------------------------------------------------------------------- the table

def _rows(values, every=10, s_per_round=0.1, metric="eval_acc"):
    rows = []
    for i, v in enumerate(values):
        for r in range(i * every, i * every + (every if i < len(values) - 1 else 1)):
            row = {"round": r, "train_loss": 1.0, "wall_s": r * s_per_round}
            if r == i * every:
                row[metric] = v
            rows.append(row)
    return rows


def _arm(name, per_seed_values, s_per_round=0.1, lr=1e-3, grid=None, seeds=None, metric="eval_acc"):
    from pathlib import Path
    seeds = seeds if seeds is not None else list(range(len(per_seed_values)))
    runs = [RunResult(Path("."), s, {"clients": 4, "rounds": 30, "eval_every": 10, "task": "mnist", "sampled": 2},
                      _rows(v, s_per_round=s_per_round * (1 + s), metric=metric),
                      {"communication_per_client": {"bytes_up_mean": 10.0, "bytes_down_mean": 20.0},
                       "s_per_round": s_per_round, "peak_rss_mb": 100.0})
            for s, v in zip(seeds, per_seed_values)]
    return ArmResult(name, name, lr, runs, grid=grid or {})


def test_time_to_reach_the_references_best():
    ref = _arm("decomfl", [[0.1, 0.6, 0.7, 0.7], [0.1, 0.5, 0.8, 0.8]], s_per_round=0.5)  # own best at 20, 20
    fast = _arm("hiso", [[0.1, 0.76, 0.9, 0.9], [0.1, 0.5, 0.8, 0.9]], s_per_round=0.2)   # reach 0.75 at 10, 20
    never = _arm("fedavg", [[0.1, 0.2, 0.3, 0.75], [0.1, 0.2, 0.3, 0.4]])
    t = build_table([fast, ref, never], "decomfl", "eval_acc")
    row = {r.name: r for r in t.rows}
    # seed s trains at s_per_round * (1 + s) seconds a round; wall_s at the first reaching round
    assert row["hiso"].reach.seconds == pytest.approx((10 * 0.2, 20 * 0.4))
    assert row["hiso"].seconds == pytest.approx((2.0 + 8.0) / 2)
    assert row["decomfl"].seconds == pytest.approx((20 * 0.5 + 20 * 1.0) / 2)  # its own best
    assert row["fedavg"].seconds is None and row["fedavg"].reach.seconds == (pytest.approx(3.0), None)
    md = to_markdown(t)
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    i = header.index("time to DeComFL's best")
    assert header[i - 1].startswith("rounds to DeComFL's best")
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in md.splitlines()[2:]}
    assert cells["HiSo"][i] == "5 s" and cells["DeComFL"][i] == "15 s" and cells["FedAvg"][i] == "—"
    csv_rows = [line.split(",") for line in to_csv(t).splitlines()]
    j = csv_columns("eval_acc").index("seconds_to_reach")
    assert float(csv_rows[1][j]) == pytest.approx(5.0) and csv_rows[3][j] == ""
    assert "time to DeComFL's best: the same, in seconds of training" in footer(t)


def test_the_footer_names_an_arm_evaluated_on_another_grid():
    ref = _arm("decomfl", [[0.1, 0.6, 0.7, 0.7]])
    fine = _arm("hiso", [[0.1, 0.76, 0.9, 0.9]])
    text = footer(build_table([fine, ref], "decomfl", "eval_acc"))
    assert "evaluated every 10 rounds;" in text and "each arm its own" not in text
    for run in fine.runs:
        run.config = run.config | {"eval_every": 2, "rounds": 20}
    text = footer(build_table([fine, ref], "decomfl", "eval_acc"))
    assert "evaluated every 10 rounds (HiSo every 2 rounds over 20);" in text
    assert "(resolution: 10 rounds, each arm its own evaluation grid)" in text


@pytest.mark.parametrize("chosen, warning", [
    (3e-3, None),
    (1e-2, "HiSo's lr 0.01 is the largest of its grid (0.001, 0.003, 0.01): the best lr may lie above it"),
    (1e-3, "HiSo's lr 0.001 is the smallest of its grid (0.001, 0.003, 0.01): the best lr may lie below it"),
])
def test_warns_when_the_chosen_lr_is_at_the_edge_of_its_grid(tmp_path, chosen, warning):
    from hiso.report.table import write_table
    grid = {1e-2: [0.5, 0.5], 1e-3: [0.5, 0.5], 3e-3: [0.5, 0.5]}  # listing order is not grid order
    hiso = _arm("hiso", [[0.1, 0.9], [0.1, 0.9]], lr=chosen, grid=grid)
    ref = _arm("decomfl", [[0.1, 0.8], [0.1, 0.8]], lr=1e-3, grid={1e-3: [0.8, 0.8]})
    text = write_table(tmp_path, build_table([hiso, ref], "decomfl", "eval_acc"))
    foot = (tmp_path / "table.md").read_text().split("\n\n", 1)[1]
    assert text.endswith(foot)  # printed and in table.md alike
    edge = [line for line in foot.splitlines() if "of its grid" in line]
    assert edge == ([] if warning is None else [f"- warning: {warning}; extend the grid."])
    assert "- lr not tuned (a one-point grid) for DeComFL." in foot.splitlines()
    assert "DeComFL's lr" not in foot  # a one-point grid is "not tuned", not "at the edge"


def test_one_seed_says_no_spread_and_several_show_mean_and_std():
    one = build_table([_arm("hiso", [[0.1, 0.9]], seeds=[3]), _arm("decomfl", [[0.1, 0.8]], seeds=[3])],
                      "decomfl", "eval_acc")
    md, foot = to_markdown(one), footer(one)
    assert "±" not in md and "1 seed: no spread" in foot and "± sample std" not in foot
    two = build_table([_arm("hiso", [[0.1, 0.9], [0.1, 0.7]]), _arm("decomfl", [[0.1, 0.8], [0.1, 0.8]])],
                      "decomfl", "eval_acc")
    assert "80.00 ± 14.14" in to_markdown(two)
    assert "no spread" not in footer(two) and "mean ± sample std over seeds" in footer(two)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the workers")
def test_killing_compare_does_not_leave_its_workers_running(tmp_path):
    """SIGKILL of a `hiso compare --jobs 2` takes its worker processes with it within seconds."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    from hiso.patience import Patience

    cmd = [sys.executable, "-m", "hiso.cli", "compare", "--out", str(tmp_path / "c"), "--jobs", "2", "--quiet",
           "--task", "quadratic", "--dim", "20000", "--clients", "4", "--sampled", "2", "--rounds", "100000",
           "--eval-every", "1000", "--algorithms", "hiso,decomfl", "--threads", "1"]
    parent = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(Path(cmp.__file__).parents[2])})

    def children():
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == parent.pid and "spawn_main" in (d / "cmdline").read_bytes().decode(errors="ignore"):
                    out.append(int(d.name))
        return out

    workers: list[int] = []
    try:
        clock = Patience(120)  # (seconds at the speed the machine offers: hiso.patience)
        while len(workers := children()) < 2 and not clock.spent():
            time.sleep(0.5)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    def running(pid: int) -> bool:
        try:  # the test session adopts orphans (a subreaper, conftest): reap a worker that exited
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    # a worker checks its parent every second once it has started; a loaded machine can take tens
    # of seconds to finish starting it (importing torch), so the bound is generous
    clock = Patience(90)
    while any(running(w) for w in workers) and not clock.spent():
        time.sleep(0.2)
    alive = [w for w in workers if running(w)]
    for w in alive:  # whatever the outcome, nothing is left running
        os.kill(w, signal.SIGKILL)
    assert len(workers) == 2, "the compare never started its two workers"
    assert not alive, "workers outlived their compare"



@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="stop signals and /proc")
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_stopping_a_parallel_compare_prints_no_traceback(tmp_path, spawned, sig, code):
    """Ctrl-C (or SIGTERM) of `hiso compare --jobs 2` with runs still queued: the tidy lines
    only. The pool's manager thread used to fail the queued runs' futures after compare had
    cancelled them, printing an InvalidStateError traceback."""
    import signal

    from conftest import rows_logged, wait_exit, wait_progress

    out = tmp_path / "c"
    # 8 runs, 2 at a time: some are still queued (not yet handed to a worker) when the signal comes
    proc = spawned.hiso("compare", "--out", str(out), "--jobs", "2", "--task", "quadratic", "--dim", "20000",
                        "--clients", "4", "--sampled", "2", "--rounds", "100000", "--eval-every", "1000",
                        "--algorithms", "hiso,decomfl", "--seeds", "0,1,2,3", "--threads", "1")
    wait_progress(lambda: sum(rows_logged(d) > 0 for d in out.glob("runs/*/*/seed0")), 2,
                  "both workers running", proc)
    proc.send_signal(getattr(signal, sig))
    assert wait_exit(proc, 120) == code
    log = proc.log.read_text(errors="replace")
    assert "Traceback" not in log and "InvalidStateError" not in log, log[-3000:]
    assert "stopped: 0 of 8 runs are finished and kept" in log
    assert "hiso: stopped by SIGTERM" in log if sig == "SIGTERM" else "hiso: interrupted;" in log


def test_a_compare_worker_draws_progress_bars_without_a_semaphore(monkeypatch):
    """tqdm's default lock is a multiprocessing semaphore, which a worker stopped with its compare
    never unregisters: Python's resource tracker printed "leaked semaphore objects" after every
    stopped compare of a language task (its evaluation draws a bar in the worker)."""
    import multiprocessing.synchronize as mps

    from hiso.experiments import compare_run
    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    for cls, name in ((tqdm, "_lock"), (TqdmDefaultWriteLock, "mp_lock")):  # as in a fresh worker
        monkeypatch.setattr(cls, name, None, raising=False)
        monkeypatch.delattr(cls, name)
    monkeypatch.setattr(compare_run, "_PROGRESS", None)
    made = []
    init = mps.SemLock.__init__

    def counted_init(self, *a, **k):
        made.append(type(self))
        init(self, *a, **k)

    monkeypatch.setattr(mps.SemLock, "__init__", counted_init)
    compare_run._init_worker(None)
    assert sum(tqdm(range(3), desc="eval", disable=True)) == 3
    assert made == []


def test_warns_when_an_arm_ends_below_what_it_reports():
    # gains from 0.5: held 0.40 of 0.40 / ended 0.55 of 0.30 gained (17 % kept) / lost a quarter exactly
    holds = _arm("hiso", [[0.5, 0.9, 0.88, 0.9], [0.5, 0.8, 0.9, 0.9]])
    falls = _arm("decomfl", [[0.5, 0.8, 0.6, 0.55], [0.5, 0.8, 0.7, 0.55]])
    edge = _arm("fedzo", [[0.5, 0.9, 0.8, 0.8], [0.5, 0.9, 0.8, 0.8]])  # kept 0.75: no warning
    t = build_table([holds, falls, edge], "decomfl", "eval_acc")
    row = {r.name: r for r in t.rows}
    assert row["decomfl"].kept == pytest.approx(1 / 6) and row["decomfl"].last_mean == pytest.approx(0.55)
    assert row["hiso"].kept == pytest.approx(1.0) and row["fedzo"].kept == pytest.approx(0.75)
    warned = [line for line in footer(t).splitlines() if "ended below what it reports" in line]
    assert warned == ["- warning: DeComFL ended below what it reports: eval accuracy 55.00% at the last evaluation "
                      "against 80.00% reported (mean over seeds), 83% of its gain since round 0 lost after the "
                      "reported round: the final model is not the reported one (hiso export RUN --round R --out DIR "
                      "rebuilds that round's); a smaller lr or --lr-decay for runs that hold their best."]
    j = csv_columns("eval_acc").index("last_eval_acc_pct_mean")
    last = {line.split(",")[0]: line.split(",")[j] for line in to_csv(t).splitlines()[1:]}
    assert float(last["decomfl"]) == pytest.approx(55.0) and float(last["hiso"]) == pytest.approx(90.0)


def test_ending_below_counts_for_metrics_where_lower_is_better():
    from hiso.report.reach import kept_share
    assert kept_share(1.0, 0.2, 0.6, higher=False) == pytest.approx(0.5)  # a gap: 1.0 -> 0.2, then back to 0.6
    assert kept_share(1.0, 0.2, 1.4, higher=False) == pytest.approx(-0.5)  # worse than it started
    assert kept_share(0.5, 0.5, 0.1, higher=True) is None  # nothing gained, nothing to keep
    assert kept_share(float("nan"), 0.9, 0.8, higher=True) is None


def test_a_single_run_that_ends_below_its_best_says_which_round_to_export(tmp_path, capsys):
    from hiso.cli import _ending_note
    from hiso.config import RunConfig
    from hiso.report.table import run_ending_note
    falls = _rows([0.5, 0.8, 0.9, 0.6, 0.55])
    note = run_ending_note(falls, "eval_acc", True, "runs/a")
    assert note == ("note: eval_acc ended at 0.55, below its best 0.9 at round 20 (87% of its gain lost): the last "
                    "model is not the best one (hiso export runs/a --round 20 --out DIR rebuilds that one; a smaller "
                    "lr or --lr-decay for runs that hold their best)")
    assert "hiso export" not in run_ending_note(falls, "eval_acc", True)  # a run without a log to rebuild from
    assert run_ending_note(_rows([0.5, 0.8, 0.9, 0.85]), "eval_acc", True, "runs/a") is None  # kept 7/8
    gap = _rows([1.0, 0.2, 0.9], metric="gap")  # lower is better: back up to 0.9 from its best 0.2
    assert "gap ended at 0.9, below its best 0.2 at round 10" in run_ending_note(gap, "gap", False, "r")
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _rows([20.0, 2.0, 15.0], metric="gap")))
    _ending_note(RunConfig(task="quadratic", algorithm="hiso"), tmp_path)  # the line `hiso run` ends with
    assert f"hiso export {tmp_path} --round 10 --out DIR" in capsys.readouterr().out
    for algorithm, rebuilt in (("fedkseed", True), ("fedavg", False)):  # FedKSeed's pool log rebuilds a round too
        _ending_note(RunConfig(task="quadratic", algorithm=algorithm), tmp_path)
        assert ("hiso export" in capsys.readouterr().out) == rebuilt, algorithm
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _rows([20.0, 2.0, 2.5], metric="gap")))
    _ending_note(RunConfig(task="quadratic", algorithm="hiso"), tmp_path)
    assert capsys.readouterr().out == ""


def test_a_run_says_so_while_its_held_out_loss_climbs_past_round_0s(tmp_path, capsys):
    from hiso.report.table import RISE_WARN, loss_rise_note
    assert loss_rise_note(1.0, {"round": 10, "eval_loss": RISE_WARN * 0.99}, 1e-2) is None
    note = loss_rise_note(1.0, {"round": 10, "eval_loss": RISE_WARN}, 1e-2)
    assert note and "round 10" in note and "1.5x round 0's" in note and "the lr (0.01)" in note
    assert loss_rise_note(None, {"round": 10, "eval_loss": 9.0}, 1e-2) is None  # no round-0 evaluation
    assert loss_rise_note(1.0, {"round": 10}, 1e-2) is None  # not an evaluated round
    quad = ["--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2", "--rounds", "6",
            "--eval-every", "2", "--quiet"]
    code, _, err = run_cli(["run", "--out", str(tmp_path / "a"), *quad, "--lr", "1.0"], capsys)  # too large
    assert code == 0 and err.count("is likely too large") == 1, err  # said once
    code, _, err = run_cli(["run", "--out", str(tmp_path / "b"), *quad, "--lr", "0.05"], capsys)
    assert code == 0 and "too large" not in err


def test_the_ending_warning_counts_every_seed_and_prints_consistent_numbers():
    # gap (lower is better). Seed 0 improves and keeps most of it; seed 1 never improves and ends worse:
    # from the means (start 27.5, reported 25.75, last 30.5) the arm lost all it gained, and says so
    arm = _arm("hiso", [[20.0, 16.5, 17.0], [35.0, 36.0, 44.0]], metric="gap")
    t = build_table([arm], "hiso", "gap")
    row = t.rows[0]
    assert row.first_mean == pytest.approx(27.5) and row.last_mean == pytest.approx(30.5)
    assert row.kept == pytest.approx((27.5 - 30.5) / (27.5 - row.best_mean))
    warned = [line for line in footer(t).splitlines() if "ended below what it reports" in line]
    assert len(warned) == 1 and f"{1 - row.kept:.0%} of its gain" in warned[0], footer(t)
    # an arm whose reported value is its round 0 (no gain at all) and that ends worse: its own warning
    flat = _arm("hiso", [[20.0, 25.0, 29.0], [35.0, 36.0, 44.0]], metric="gap")
    text = footer(build_table([flat], "hiso", "gap"))
    assert "ended worse than it started" in text and "at round 0 (means over seeds)" in text, text


def test_a_comparison_table_names_each_arms_rule_attackers_and_faults(tmp_path, capsys):
    """A median arm under attack beside a plain one: the footer says what each was put through."""
    conf = tmp_path / "c.toml"
    conf.write_text('task = "quadratic"\ndim = 20\nclients = 6\nsampled = 4\nrounds = 4\neval_every = 2\n\n'
                    '[compare]\nalgorithms = ["hiso", "hiso-robust"]\n[compare.variants]\n'
                    '"hiso-robust" = { algorithm = "hiso", aggregate = "trimmed-mean", trim = 0.3, byzantine = 1, '
                    'byzantine_per_round = true, attack = "sign-flip,random", attack_scale = 10.0, drop_rate = 0.2 }\n')
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    lines = [x for x in stdout.splitlines() if x.startswith("- reliability:")]
    assert lines == ["- reliability: HiSo: plain mean, no attackers or faults.",
                     "- reliability: hiso-robust: aggregate trimmed-mean (trim 0.3); 1 Byzantine of each round's "
                     "sampled (attack sign-flip,random x 10); answers 20% lost."]
    assert all(x in (out / "table.md").read_text() for x in lines)
    from hiso.report.table import _reliability_of
    assert _reliability_of({"aggregate": "trimmed-mean", "sampled": 3}) == (
        "aggregate trimmed-mean (trim 0.25, which drops none of 3 answers: the plain mean)")
    conf.write_text(conf.read_text().split("[compare.variants]")[0].replace(', "hiso-robust"', ""))
    code, stdout, err = run_cli(["compare", "--config", str(conf), "--out", str(tmp_path / "plain"), "--quiet"], capsys)
    assert code == 0 and "- reliability:" not in stdout


def test_the_plots_title_names_p_tau_and_rounds_only_where_every_arm_shares_them():
    from hiso.report.plots import _setup_title
    ref, other = _arm("decomfl", [[0.1, 0.6]]), _arm("hiso", [[0.1, 0.7]])
    for arm in (ref, other):
        for run in arm.runs:
            run.config = run.config | {"perturbations": 5, "local_steps": 1}
    assert "P = 5, τ = 1, 30 rounds" in _setup_title([ref, other])
    for run in other.runs:
        run.config = run.config | {"perturbations": 64, "rounds": 20}
    title = _setup_title([ref, other])
    assert "P =" not in title and "rounds —" not in title and "τ = 1" in title
