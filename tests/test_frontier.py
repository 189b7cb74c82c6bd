"""The frontier (hiso.report.frontier): costs to a target and the Pareto marks, on a hand-made table."""

from pathlib import Path

import pytest

from hiso.report.frontier import Cost, forward_equivalents, frontiers, mark_pareto, to_csv, to_markdown, \
    write_frontier
from hiso.report.runs import ArmResult, RunResult
from hiso.report.table import build_table

CLIENTS, SAMPLED = 10, 2  # a round samples a fifth of the clients


def _arm(name, acc, bytes_per_round, fwd, bwd, peak, **config):
    """An arm of one seed evaluated every 10 rounds: ``acc`` at rounds 0, 10, ..., 60; the
    federation's bytes grow by ``bytes_per_round`` a round."""
    rows = [{"round": 10 * i, "eval_acc": a, "bytes_up": 10 * i * bytes_per_round / 2,
             "bytes_down": 10 * i * bytes_per_round / 2, "wall_s": float(i)} for i, a in enumerate(acc)]
    total = 60 * bytes_per_round / CLIENTS
    summary = {"communication_per_client": {"bytes_up_mean": total / 2, "bytes_down_mean": total / 2},
               "client": {"forwards_per_round": fwd, "backwards_per_round": bwd, "s_per_round": 0.1,
                          "peak_bytes": peak}}
    run = RunResult(Path("."), 0, {"clients": CLIENTS, "sampled": SAMPLED, "rounds": 60, "eval_every": 10,
                                   **config}, rows, summary)
    return ArmResult(name, name, 0.1, [run])


ARMS = [
    # the reference: 6 forwards a client-round, its best 0.80 first at round 40
    _arm("decomfl", [0.1, 0.3, 0.5, 0.7, 0.8, 0.8, 0.8], 20, 6, 0, 1e6),
    # first-order, float projections: 0.80 at round 10, 0.90 at round 30; one forward, one backward
    _arm("ferret", [0.1, 0.8, 0.85, 0.9, 0.9, 0.9, 0.9], 100_000, 1, 1, 2e6),
    # first-order, low-bit: 0.80 at round 20, never 0.90
    _arm("sketch", [0.1, 0.5, 0.8, 0.85, 0.85, 0.85, 0.85], 100, 1, 1, 2e6),
    # worse than the reference on every axis: 0.80 at round 60, more bytes, same compute a round
    _arm("slow", [0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.8], 30, 6, 0, 1e6),
    _arm("never", [0.1] * 7, 1, 1, 0, 1e5),  # cheapest at everything, reaches nothing
]


def test_a_backward_counts_as_two_forwards():
    assert forward_equivalents(6, 0) == 6 and forward_equivalents(1, 1) == 3 and forward_equivalents(2, None) == 2
    assert forward_equivalents(None, 1) is None


def test_costs_and_pareto_marks_on_a_hand_made_table():
    table = build_table(ARMS, "decomfl", "eval_acc")
    assert table.threshold == 0.8
    ref, target = frontiers(table, ARMS, target=0.9)
    c = {x.name: x for x in ref.costs}
    # rounds; bytes per client at that round (the federation's over 10 clients); forward-equivalents
    # = (fwd + 2 bwd) per answered round x rounds x 2 / 10 sampled
    assert (c["decomfl"].rounds, c["decomfl"].bytes, c["decomfl"].forward_eq) == (40, 40 * 20 / 10, 6 * 40 * 0.2)
    assert (c["ferret"].rounds, c["ferret"].bytes, c["ferret"].forward_eq) == (10, 10 * 100_000 / 10, 3 * 10 * 0.2)
    assert (c["sketch"].rounds, c["sketch"].bytes, c["sketch"].forward_eq) == (20, 20 * 100 / 10, 3 * 20 * 0.2)
    assert (c["slow"].rounds, c["slow"].forward_eq) == (60, 6 * 60 * 0.2)
    assert c["never"].rounds is None and c["never"].bytes is None and c["never"].forward_eq is None
    # decomfl: fewest bytes and least memory; ferret: fewest rounds and forwards; sketch: between
    # them on rounds and bytes; slow is dominated by decomfl; never reached: off the frontier
    assert {x.name for x in ref.costs if x.pareto} == {"decomfl", "ferret", "sketch"}
    assert ref.axes == ("rounds", "bytes", "forward_eq", "peak_bytes")
    # the user's target 0.90: ferret alone reaches it (round 30), so it alone is on the frontier
    t = {x.name: x for x in target.costs}
    assert t["ferret"].rounds == 30 and t["ferret"].forward_eq == pytest.approx(3 * 30 * 0.2) and t["ferret"].pareto
    assert [x.name for x in target.costs if x.pareto] == ["ferret"]
    assert all(t[n].rounds is None for n in ("decomfl", "sketch", "slow", "never"))
    md = to_markdown([ref, target])
    assert "**To DeComFL's best (80.00%)**" in md and "**To target 90.00%**" in md and "two forwards" in md
    assert "| Sketch | backprop | * | 20 |" in md and "| DeComFL | forwards only | * | 40 |" in md
    assert c["decomfl"].forwards_only and not c["ferret"].forwards_only
    lines = to_csv([ref, target]).splitlines()
    assert lines[0].startswith("target,threshold,algorithm,pareto") and len(lines) == 1 + 2 * len(ARMS)
    assert lines[0].endswith(",forwards_only,base_dtype") and lines[1].endswith(",1,")  # decomfl: no backpropagation


def test_client_memory_names_its_base_dtype_where_a_run_set_one():
    """The same method over an int4 and a float32 base: two clients, each memory named by its base;
    runs that all hold a float32 base (or predate --base-dtype) keep the plain figure."""
    arms = [_arm("decomfl", [0.1, 0.8], 20, 6, 0, 1.4e9, base_dtype="float32"),
            _arm("decomfl-int4", [0.1, 0.8], 20, 6, 0, 0.9e9, base_dtype="int4")]
    ref, = frontiers(build_table(arms, "decomfl", "eval_acc"), arms)
    md = to_markdown([ref])
    assert "| 1.4 GB (float32 base) |" in md and "| 900 MB (int4 base) |" in md
    assert [x.name for x in ref.costs if x.pareto] == ["decomfl-int4"]  # less memory, same rounds and bytes
    assert to_csv([ref]).splitlines()[2].endswith(",900000000.0,1,int4")
    plain = to_markdown(frontiers(build_table(ARMS, "decomfl", "eval_acc"), ARMS))
    assert "base)" not in plain and "| 1 MB |" in plain


def test_pareto_ties_and_missing_axes():
    a = Cost("a", 1, 1, 10, 100, 5, None)
    b = Cost("b", 1, 1, 10, 100, 5, 7)  # equal on the axes they share: neither dominates
    c = Cost("c", 1, 1, 10, 200, 5, 1)  # worse bytes, better memory: memory is not an axis (a lacks it)
    d = Cost("d", 0, 1, None, None, None, 0)
    axes = mark_pareto([a, b, c, d])
    assert axes == ("rounds", "bytes", "forward_eq")
    assert [x.pareto for x in (a, b, c, d)] == [True, True, False, False]
    assert mark_pareto([d]) == () and not d.pareto


def test_write_frontier_makes_the_files(tmp_path):
    pytest.importorskip("matplotlib")
    fronts = frontiers(build_table(ARMS, "decomfl", "eval_acc"), ARMS, target=0.99)  # nobody reaches 0.99
    text = write_frontier(tmp_path, fronts)
    assert (tmp_path / "frontier.md").read_text() == text and (tmp_path / "frontier.png").stat().st_size > 0
    assert "Pareto over: none (no arm reached it)." in text


def test_every_compare_writes_the_frontier_with_a_users_target(tmp_path, capsys):
    from cli_helpers import run_cli
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "--out", str(out), "--algorithms", "decomfl,sketch", "--rounds", "4",
                                 "--eval-every", "2", "--dim", "20", "--clients", "4", "--sampled", "2",
                                 "--threads", "1", "--ferret-k", "8", "--ferret-blocks", "1", "--target", "1e9",
                                 "--quiet"], capsys)
    assert code == 0, err
    md = (out / "frontier.md").read_text()
    assert "## Frontier" in stdout and md in stdout and "**To target 1e+09**" in md
    assert (out / "frontier.csv").exists() and (out / "frontier.png").exists()


def test_a_config_files_target_reaches_the_frontier_and_table_only(tmp_path, capsys):
    from cli_helpers import run_cli
    cfg = tmp_path / "c.toml"
    cfg.write_text('task = "quadratic"\ndim = 20\nclients = 4\nsampled = 2\nrounds = 2\neval_every = 1\nthreads = 1\n'
                   '[compare]\nalgorithms = ["decomfl"]\ntarget = 7e8\n')
    out = tmp_path / "cmp"
    code, _, err = run_cli(["compare", "--config", str(cfg), "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    assert "**To target 7e+08**" in (out / "frontier.md").read_text()
    (out / "frontier.md").unlink()
    code, _, err = run_cli(["compare", "--out", str(out), "--table-only", "--quiet"], capsys)  # from compare.json
    assert code == 0, err
    assert "**To target 7e+08**" in (out / "frontier.md").read_text()
    code, _, err = run_cli(["compare", "--out", str(out), "--table-only", "--target", "3e9", "--quiet"], capsys)
    assert code == 0, err
    assert "**To target 3e+09**" in (out / "frontier.md").read_text()  # the flag wins
