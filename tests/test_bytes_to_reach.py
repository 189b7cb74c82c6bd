"""hiso compare's "bytes / client to the reference's best": arms of different bytes per round
(float16 scalars, more perturbations) compared at equal communication."""

from pathlib import Path

import pytest

from hiso.report.table import ArmResult, RunResult, build_table, csv_columns, footer, to_csv, to_markdown


def _run(seed, accs, up_per_round, down_per_round, clients=4, every=10):
    rows = []
    for i, acc in enumerate(accs):
        for r in range(i * every, i * every + (every if i < len(accs) - 1 else 1)):
            row = {"round": r, "wall_s": 0.1 * r, "bytes_up": up_per_round * r, "bytes_down": down_per_round * r}
            if r == i * every:
                row["eval_acc"] = acc
            rows.append(row)
    return RunResult(Path("."), seed, {"clients": clients, "rounds": 30, "eval_every": every, "task": "mnist",
                                       "sampled": 2},
                     rows, {"communication_per_client": {"bytes_up_mean": 1.0, "bytes_down_mean": 1.0},
                            "s_per_round": 0.1})


def test_bytes_to_reach_counts_the_communication_up_to_the_reaching_round():
    # reference: 100 + 300 bytes a round over 4 clients; its own best (0.8) at round 20 on both seeds
    ref = ArmResult("decomfl", "decomfl", 1e-3, [_run(0, [0.1, 0.5, 0.8, 0.8], 100, 300),
                                                 _run(1, [0.1, 0.6, 0.8, 0.8], 100, 300)])
    # half the bytes a round, reaches 0.8 at round 30 on seed 0 and round 20 on seed 1
    half = ArmResult("f16", "decomfl", 1e-3, [_run(0, [0.1, 0.5, 0.7, 0.8], 50, 150),
                                              _run(1, [0.1, 0.6, 0.9, 0.9], 50, 150)])
    never = ArmResult("slow", "decomfl", 1e-3, [_run(0, [0.1, 0.2, 0.3, 0.4], 50, 150),
                                                _run(1, [0.1, 0.2, 0.3, 0.9], 50, 150)])
    t = build_table([ref, half, never], "decomfl", "eval_acc")
    row = {r.name: r for r in t.rows}
    assert row["decomfl"].bytes_to_reach == pytest.approx(20 * 400 / 4)  # 2,000 B per client
    assert row["f16"].bytes_to_reach == pytest.approx((30 * 200 / 4 + 20 * 200 / 4) / 2)  # 1,250 B
    assert row["f16"].rounds == 25 and row["slow"].bytes_to_reach is None
    md = to_markdown(t)
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    i = header.index("bytes / client to DeComFL's best")
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in md.splitlines()[2:]}
    assert cells["DeComFL"][i] == "2 KB" and cells["f16"][i] == "1.25 KB" and cells["slow"][i] == "—"
    j = csv_columns("eval_acc").index("bytes_to_reach_per_client")
    lines = [line.split(",") for line in to_csv(t).splitlines()]
    assert float(lines[2][j]) == pytest.approx(1250.0) and lines[3][j] == ""
    assert "bytes / client to DeComFL's best: the same, in bytes" in footer(t)
