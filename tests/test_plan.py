"""hiso plan's byte counts equal measured runs' (every method family, several shapes), and its table prints."""

import pytest

from hiso.api import run
from hiso.runners.plan import Deployment, format_plan, plan

SHAPES = [  # (algorithm, clients, sampled, rounds, local_steps, dim, options)
    ("hiso", 12, 3, 9, 1, 30, {"perturbations": 2, "difference": "central"}),
    ("decomfl", 40, 4, 25, 2, 8, {"perturbations": 3}),  # a small model: the automatic rule sends snapshots
    ("fedavg", 10, 5, 6, 2, 20, {"perturbations": 1}),
    ("hiso", 30, 2, 20, 1, 50, {"perturbations": 1, "snapshot_after": 4}),
    ("feedsign", 12, 3, 9, 2, 30, {}),  # P = 1, central differences, sign bits up
    ("fedkseed", 20, 4, 12, 2, 40, {"seed_pool": 64, "seed_sampling": "uniform"}),
    ("ferret", 15, 3, 10, 2, 30, {"ferret_k": 4, "ferret_blocks": 2}),
    ("sketch", 30, 2, 20, 1, 50, {"ferret_k": 8, "ferret_blocks": 3, "sketch_bits": 2, "snapshot_after": 4}),
    ("sketch", 8, 2, 6, 1, 10, {"ferret_k": 5, "ferret_blocks": 1, "scalar_dtype": "sign"}),
    ("greedy", 30, 2, 20, 2, 50, {"perturbations": 8, "snapshot_after": 4}),  # one (index, scalar) a step up
    ("conmezo", 30, 2, 20, 1, 50, {"snapshot_after": 4}),  # its snapshots carry m beside x
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}-{s[1]}x{s[2]}" for s in SHAPES])
def test_plan_bytes_equal_a_runs(shape, tmp_path):
    alg, M, m, R, tau, dim, opts = shape
    r = run("quadratic", tmp_path / "run", algorithm=alg, clients=M, sampled=m, rounds=R, local_steps=tau, dim=dim,
            seed=5, eval_every=R, **opts)
    got, client, d = r.summary["communication_per_client"], r.summary["client"], r.summary["parameters"]
    dep = Deployment(d, M, m, R, local_steps=tau, seed=5, **opts)
    row = plan([alg], dep)[0]
    assert row["up"] == got["bytes_up_mean"] and row["down"] == got["bytes_down_mean"]
    assert row["forwards"] == pytest.approx(client["forwards_per_round"] * R * m / M)
    assert row["backwards"] == pytest.approx(client["backwards_per_round"] * R * m / M)
    if M == 40 or "snapshot_after" in opts:
        assert row["snapshots"] > 0  # the snapshot rule is in play in these shapes
    text = format_plan([row], dep)
    assert alg in text and "server s/round" in text


@pytest.mark.parametrize("sampling", ["uniform", "weighted"])
def test_fedkseed_materialisations_are_a_faithful_runs(sampling):
    """Uniform draws: plan's pool directions equal what every client's replica materialised; weighted: a bound."""
    from hiso.config import RunConfig
    from hiso.runners.inprocess import FedKSeedSimulation
    from hiso.tasks.registry import build_task

    cfg = RunConfig(task="quadratic", algorithm="fedkseed", clients=20, sampled=4, rounds=12, local_steps=2, dim=40,
                    seed=5, seed_pool=64, seed_sampling=sampling, mode="faithful")
    sim = FedKSeedSimulation(build_task(cfg), cfg)
    for _ in range(cfg.rounds):
        sim.step()
    got = sum(rep.regenerations for rep, _ in sim.clients.values())
    row = plan(["fedkseed"], Deployment(40, 20, 4, 12, local_steps=2, seed=5, seed_pool=64, seed_sampling=sampling))[0]
    materialised = (row["drawn"] - row["perturbed"]) * 20
    assert row["perturbed"] == pytest.approx(12 * 4 / 20 * (2 * 2 + 1))  # central: 2 a step, one local step folded
    if sampling == "uniform":
        assert materialised == pytest.approx(got) and "distinct seeds drawn" in row["note"]
    else:
        assert materialised >= got and "not exact" in row["note"]


def test_cli_plan_prints_each_method(capsys):
    from hiso.cli import main

    methods = "hiso,decomfl,feedsign,fedkseed,ferret,sketch,fedavg,fedzo"
    assert main(["plan", "--params", "1000", "--clients", "50", "--sampled", "5", "--rounds", "20",
                 "--methods", methods, "--forward-s", "0.01", "--bandwidth", "1e6", "--ferret-k", "16"]) == 0
    out = capsys.readouterr().out
    assert all(m in out for m in methods.split(",")) and "50 clients" in out and "K=16 projections" in out
    assert "a backward counted as two forwards" in out
    for bad in (["--methods", "sketch", "--sketch-bits", "3"], ["--methods", "feedsign", "--scalar-dtype", "int8"],
                ["--methods", "nope"]):
        assert main(["plan", "--params", "10", "--clients", "5", "--sampled", "2", "--rounds", "2", *bad]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 3  # one line each
