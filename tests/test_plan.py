"""hiso plan's byte counts equal measured runs' (three shapes), and its table prints."""

import pytest

from hiso.api import run
from hiso.runners.plan import Deployment, format_plan, plan

SHAPES = [  # (algorithm, clients, sampled, rounds, perturbations, local_steps, dim, snapshot_after)
    ("hiso", 12, 3, 9, 2, 1, 30, None),
    ("decomfl", 40, 4, 25, 3, 2, 8, None),  # a small model: the automatic rule sends snapshots
    ("fedavg", 10, 5, 6, 1, 2, 20, None),
    ("hiso", 30, 2, 20, 1, 1, 50, 4),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}-{s[1]}x{s[2]}" for s in SHAPES])
def test_plan_bytes_equal_a_runs(shape, tmp_path):
    alg, M, m, R, P, tau, dim, snap = shape
    opts = {} if snap is None else {"snapshot_after": snap}
    r = run("quadratic", tmp_path / "run", algorithm=alg, clients=M, sampled=m, rounds=R, perturbations=P,
            local_steps=tau, dim=dim, seed=5, eval_every=R, **opts)
    got = r.summary["communication_per_client"]
    d = r.summary["parameters"]
    row = plan([alg], Deployment(d, M, m, R, local_steps=tau, perturbations=P, snapshot_after=snap, seed=5))[0]
    assert row["up"] == got["bytes_up_mean"] and row["down"] == got["bytes_down_mean"]
    assert row["forwards"] == pytest.approx(r.summary["client"]["forwards_per_round"] * R * m / M)
    if shape[1] == 40 or snap is not None:
        assert row["snapshots"] > 0  # the snapshot rule is in play in these shapes
    text = format_plan([row], Deployment(d, M, m, R))
    assert alg in text and "server s/round" in text


def test_cli_plan_prints_each_method(capsys):
    from hiso.cli import main

    assert main(["plan", "--params", "1000", "--clients", "50", "--sampled", "5", "--rounds", "20",
                 "--methods", "hiso,fedavg", "--forward-s", "0.01", "--bandwidth", "1e6"]) == 0
    out = capsys.readouterr().out
    assert "hiso" in out and "fedavg" in out and "50 clients" in out
    assert main(["plan", "--params", "10", "--clients", "5", "--sampled", "2", "--rounds", "2",
                 "--methods", "fedkseed"]) == 2  # not covered: refused, not guessed
