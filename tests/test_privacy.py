"""Differential privacy of the scalars: clipping by hand, the noise's spread, the accountant
against dp-accounting's own, replicas of DP runs bit-identical, budgets, bad settings."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hiso.core import ModelState
from hiso.methods.hiso_method import hiso
from hiso.methods.privacy import (DPConfig, clip, epsilon_amplified, epsilon_spent, noise, noise_for,
                                  participation_counts, planned_participations, private_answer, private_mean)
from hiso.runners.simulate import Simulation

from conftest import TinyTask

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli  # noqa: E402


def test_clip_scales_to_the_norm_by_hand():
    g = np.array([[3.0, 0.0], [0.0, 4.0]])  # norm 5
    np.testing.assert_allclose(clip(g, 1.0), [[0.6, 0.0], [0.0, 0.8]], rtol=1e-15)
    np.testing.assert_array_equal(clip(g, 5.0), g)  # at the norm: untouched
    np.testing.assert_array_equal(clip(g, 10.0), g)
    assert clip(np.zeros(3), 1.0).tolist() == [0.0, 0.0, 0.0]


def test_noise_has_the_configured_std_and_is_keyed_by_secret_and_round():
    draws = noise(7, 3, 0, (40000,), std=2.5)
    assert abs(draws.std() - 2.5) < 0.05 and abs(draws.mean()) < 0.05
    assert np.array_equal(draws, noise(7, 3, 0, (40000,), std=2.5))  # a resumed run draws the same
    for other in (noise(8, 3, 0, (40000,), 2.5), noise(7, 4, 0, (40000,), 2.5), noise(7, 3, 1, (40000,), 2.5),
                  noise(7, 3, 0, (40000,), 2.5, client=0)):
        assert abs(np.corrcoef(draws, other)[0, 1]) < 0.03


def test_private_mean_is_the_noised_mean_of_the_clipped_answers():
    answers = np.array([[[3.0, 4.0]], [[0.3, 0.4]]])  # norms 5 and 0.5
    cfg = DPConfig(clip=1.0, noise_multiplier=0.0)
    np.testing.assert_allclose(private_mean(answers, cfg, 1, 0), [[(0.6 + 0.3) / 2, (0.8 + 0.4) / 2]])
    cfg = DPConfig(clip=1.0, noise_multiplier=2.0)
    expect = (np.array([[0.9, 1.2]]) + noise(1, 5, 0, (1, 2), 2.0)) / 2
    np.testing.assert_allclose(private_mean(answers, cfg, 1, 5), expect, rtol=0, atol=1e-15)
    local = private_answer(answers[0], cfg, 1, 5, 0, client=3)
    np.testing.assert_allclose(local, np.array([[0.6, 0.8]]) + noise(1, 5, 0, (1, 2), 2.0, client=3), atol=1e-6)


def _dpa_epsilon(event, delta=1e-5):
    """dp-accounting's own RDP epsilon of ``event`` (hiso's order grid, the replace-one relation)."""
    dpa = pytest.importorskip("dp_accounting")
    from hiso.methods.privacy import RDP_ORDERS
    acc = dpa.rdp.RdpAccountant(list(RDP_ORDERS), dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(event)
    return acc.get_epsilon(delta)


def test_accountant_equals_dp_accounting_for_the_same_mechanism_and_schedule():
    dpa = pytest.importorskip("dp_accounting")
    # 40 rounds, 8 of 64 clients sampled without replacement, noise std z C, replace-one sensitivity 2C
    want = _dpa_epsilon(dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(
        64, 8, dpa.GaussianDpEvent(1.5 / 2)), 40))
    assert epsilon_amplified(1.5, 40, 1e-5, clients=64, sampled=8) == want
    # a client in 7 rounds, the sample known: 7 Gaussian mechanisms of multiplier z / 2, composed
    assert epsilon_spent(1.5, 7, 1e-5) == _dpa_epsilon(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.5 / 2), 7))
    # more rounds or less noise spend more; no amplification spends more than amplification
    assert epsilon_amplified(1.5, 80, 1e-5, clients=64, sampled=8) > want
    assert epsilon_amplified(1.0, 40, 1e-5, clients=64, sampled=8) > want
    assert epsilon_spent(1.5, 8, 1e-5) > epsilon_spent(1.5, 7, 1e-5) > epsilon_spent(1.7, 7, 1e-5) > want
    assert epsilon_spent(1.5, 0, 1e-5) == 0.0 and epsilon_spent(0.0, 1, 1e-5) == float("inf")
    z = noise_for(8.0, 7, 1e-5)
    assert epsilon_spent(z, 7, 1e-5) <= 8.0 < epsilon_spent(z * 0.97, 7, 1e-5)


def test_the_worked_example_two_epsilons_against_dp_accounting():
    """Issue 41's worked example: 1,000 clients, 10 a round, z = 1, 500 rounds, delta 1e-5. With
    amplification by sampling (a reader who cannot tell who was sampled) epsilon is ~15.6; the
    client that seed 0's sample puts in the most rounds, 13, has spent ~59 against a reader who
    knows the sample, which every reader of a hiso run may: that is the one a run reports."""
    dpa = pytest.importorskip("dp_accounting")
    amplified = _dpa_epsilon(dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(
        1000, 10, dpa.GaussianDpEvent(0.5)), 500))
    assert amplified == pytest.approx(15.6, abs=0.05)
    assert epsilon_amplified(1.0, 500, 1e-5, clients=1000, sampled=10) == amplified
    counts = participation_counts(0, 1000, 10, 500)
    assert counts.sum() == 5000 and counts.max() == 13 == planned_participations(0, 1000, 10, 500)
    public = _dpa_epsilon(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(0.5), 13))
    assert public == pytest.approx(59.3, abs=0.05)
    assert epsilon_spent(1.0, 13, 1e-5) == public
    # the run's ledger reports that one, for the client sampled 13 times
    from hiso.config import load_config
    from hiso.runners.accounting import PrivacyLedger
    from hiso.core.history import RoundRecord
    cfg = load_config(None, clients=1000, sampled=10, rounds=500, seed=0, dp_clip=1.0, dp_noise_multiplier=1.0,
                      dp_delta=1e-5)
    ledger = PrivacyLedger(cfg)
    from hiso.core.server import client_sampler, sample_clients
    rng = client_sampler(0)
    for r in range(500):
        ledger.record(RoundRecord(r, np.zeros((1, 1), np.uint64), np.zeros((1, 1), np.float32),
                                  sample_clients(rng, 1000, 10)))
    got = ledger.summary()
    assert (got["threat_model"], got["participations_max"], got["epsilon"]) == ("public-sample", 13, public)
    assert counts[got["worst_client"]] == 13


def test_the_planned_sample_is_the_one_the_server_draws():
    """dp_epsilon plans for the run's own sample: participation_counts draws it as the server
    does, so a run's logged participants are counted exactly (no round planned again)."""
    sim = Simulation(TinyTask(num_clients=12), hiso(lr=0.02, perturbations=2, local_steps=1), clients_per_round=3,
                     seed=7, batch_size=8)
    for _ in range(30):
        sim.step()
    logged = np.zeros(12, dtype=np.int64)
    for rec in sim.server.history:
        logged[list(rec.participants)] += 1
    assert np.array_equal(participation_counts(7, 12, 3, 30), logged)
    assert planned_participations(7, 12, 3, 30) == logged.max()


def test_dp_epsilon_is_solved_for_the_worst_client_of_the_runs_sample(tmp_path):
    """A budget of epsilon 8 over 40 rounds of 3 of 12 clients: z is the smallest (to 1 %) at which
    the client the run's sample puts in the most rounds spends at most 8 without amplification;
    the run reaches its horizon within the budget, and that client is the one it reports."""
    pytest.importorskip("dp_accounting")
    from hiso.config import load_config
    from hiso.runners.rundir import run_to_dir
    cfg = load_config(None, clients=12, sampled=3, rounds=40, seed=3, dim=10, eval_every=20, dp_clip=10.0,
                      dp_epsilon=8.0, dp_delta=1e-5)
    n = planned_participations(3, 12, 3, 40)
    assert n > 40 * 3 / 12  # above the mean: the worst client, not the typical one
    z = cfg.dp_noise
    assert epsilon_spent(z, n, 1e-5) <= 8.0 < epsilon_spent(z * 0.98, n, 1e-5)
    summary = run_to_dir(cfg, tmp_path / "r")
    p = summary["privacy"]
    assert summary["rounds_done"] == 40 and p["stopped"] is None
    assert p["participations_max"] == n and p["epsilon"] == epsilon_spent(z, n, 1e-5) <= 8.0


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.params, b.params)) and all(
        torch.equal(x, y) for x, y in zip(a.h, b.h))


@pytest.mark.parametrize("mode", ["central", "local"])
def test_dp_run_replicas_are_bit_identical_and_apply_only_the_noised_record(mode):
    dp = DPConfig(clip=0.5, noise_multiplier=1.0, mode=mode)
    zo = hiso(lr=0.02, perturbations=3, local_steps=1, dp=dp)
    task = TinyTask(num_clients=12)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000, dp_seed=42)
    plain = Simulation(TinyTask(num_clients=12), hiso(lr=0.02, perturbations=3, local_steps=1), clients_per_round=3,
                       seed=1, batch_size=8, mode="faithful", eval_every=1000)
    for _ in range(25):
        rec, _ = sim.step()
        ref, _ = plain.step()
    assert not np.allclose(rec.scalars, ref.scalars)  # the noise is in the log
    sim.sync_all()
    for c in sim.clients.values():
        assert _same(c.state, sim.state), f"client {c.cid} drifted"
    # a replica fed only the logged (noised) records lands on the server's model
    rebuilt = ModelState(task.build_model(), zo)
    rebuilt.replay(list(sim.server.history))
    assert _same(rebuilt, sim.state)
    # the same secret gives the same run; another secret another one
    again = Simulation(TinyTask(num_clients=12), zo, clients_per_round=3, seed=1, batch_size=8, dp_seed=42)
    other = Simulation(TinyTask(num_clients=12), zo, clients_per_round=3, seed=1, batch_size=8, dp_seed=43)
    for _ in range(25):
        ra, _ = again.step()
        rb, _ = other.step()
    assert np.array_equal(ra.scalars, rec.scalars) and not np.array_equal(rb.scalars, rec.scalars)


@pytest.mark.parametrize("sim_mode", ["fast", "faithful"])
@pytest.mark.parametrize("mode", ["central", "local", None])
def test_under_dp_no_uplink_carries_the_clients_loss(monkeypatch, mode, sim_mode):
    """Every uplink the simulator's clients encode (what a transport would carry), decoded again:
    under DP in either mode it has no loss field (the bytes are those of the same answer encoded
    without a loss: no loss flag, no loss value), so nothing unnoised of a client's data leaves
    it; the round reports no mean loss. Without DP (None) the loss is there, as before."""
    import hiso.core.server_rounds as protocol  # where the round decodes every uplink
    from hiso.core.messages import Uplink, decode_uplink, encode_uplink
    sent = []

    def spy(data, *a, **k):
        sent.append(bytes(data))
        return decode_uplink(data, *a, **k)

    monkeypatch.setattr(protocol, "decode_uplink", spy)
    dp = None if mode is None else DPConfig(clip=0.5, noise_multiplier=1.0, mode=mode)
    sim = Simulation(TinyTask(num_clients=8), hiso(lr=0.02, perturbations=3, local_steps=2, dp=dp),
                     clients_per_round=3, seed=1, batch_size=8, mode=sim_mode, dp_seed=5)
    losses = [sim.step()[1] for _ in range(3)]
    assert len(sent) == 9
    wire = sim.server.wire
    for data in sent:
        up = decode_uplink(data, wire)
        bare = encode_uplink(Uplink(up.client, up.round, up.scalars, None, up.attempt), wire)
        if dp is None:
            assert up.loss is not None and len(data) > len(bare)
        else:
            assert up.loss is None and data == bare
    assert all((x is None) == (dp is not None) for x in losses)


def test_central_noise_is_added_after_clipping_the_answers():
    dp = DPConfig(clip=1e-3, noise_multiplier=0.0)  # clip hard, no noise: every answer has norm <= C
    zo = hiso(lr=0.02, perturbations=3, local_steps=1, dp=dp)
    sim = Simulation(TinyTask(num_clients=12), zo, clients_per_round=3, seed=1, batch_size=8, dp_seed=0)
    for _ in range(5):
        rec, _ = sim.step()
        assert np.sqrt(np.sum(rec.scalars.astype(np.float64) ** 2)) <= 1e-3 * (1 + 1e-6)


def _quad(tmp_path, name, *extra):
    return ["run", "--rounds", "6", "--eval-every", "3", "--out", str(tmp_path / name), "--quiet", *extra]


def test_dp_run_reports_epsilon_keeps_its_secret_and_rebuilds(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    code, _, err = run_cli(_quad(tmp_path, "r", "--dp-clip", "10", "--dp-noise-multiplier", "1.0", "--dp-delta", "1e-5"),
                           capsys)
    assert code == 0, err
    out = tmp_path / "r"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    eps = [r["dp_epsilon"] for r in rows if "dp_epsilon" in r]
    assert [r["round"] for r in rows if "dp_epsilon" in r] == [3, 6] and eps[0] < eps[1]
    # the epsilon reported is the worst client's, without amplification: each client's rounds
    # counted from the log (which anyone reading it has), not the sampling rate's
    from hiso.core.history import read_history
    counts = np.zeros(20, dtype=np.int64)
    most = []
    for rec in read_history(out / "history.bin")[2]:
        counts[list(rec.participants)] += 1
        most.append(int(counts.max()))
    assert [r["dp_participations_max"] for r in rows if "dp_epsilon" in r] == [most[2], most[5]]
    assert eps == [epsilon_spent(1.0, most[2], 1e-5), epsilon_spent(1.0, most[5], 1e-5)]
    assert eps[1] > epsilon_amplified(1.0, 6, 1e-5, clients=20, sampled=4)
    cfg = json.loads((out / "config.json").read_text())
    secret = json.loads((out / "dp_secret.json").read_text())["noise_seed"]
    assert cfg["dp_noise_seed"] is None and str(secret) not in (out / "config.json").read_text()
    summary = json.loads((out / "summary.json").read_text())
    p = summary["privacy"]
    assert (p["threat_model"], p["epsilon"], p["participations_max"]) == ("public-sample", eps[1], most[5])
    assert counts[p["worst_client"]] == most[5] and "not the server" in p["holds_against"]
    # nothing unnoised of a client in the metrics: no training loss in any row (none was sent)
    assert [r["train_loss"] for r in rows] == [None] * 7 and summary["final_train_loss"] is None
    assert p["train_loss"].startswith("withheld")
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = torch.load(out / "model.pt"), torch.load(tmp_path / "rb.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # a released model says what privacy it was trained under, at the round exported
    code, _, err = run_cli(["export", str(out), "--out", str(tmp_path / "exp"), "--round", "3"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "exp" / "hiso.json").read_text())
    assert meta["privacy"] == {"mode": "central", "clip": 10.0, "noise_multiplier": 1.0, "delta": 1e-5,
                               "threat_model": "public-sample", "epsilon": eps[0], "participations_max": most[2]}
    assert f"({eps[0]:.3g}, 1e-05)-DP at round 3" in (tmp_path / "exp" / "README.md").read_text()


def test_without_dp_the_rows_keep_the_training_loss(tmp_path, capsys):
    """(What a user sees outside DP is unchanged: the participants' mean loss in every row.)"""
    code, _, err = run_cli(_quad(tmp_path, "plain"), capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train_loss"] is None and all(isinstance(r["train_loss"], float) for r in rows[1:])
    assert not any(k.startswith("dp_") for r in rows for k in r)


def test_the_budget_refuses_the_round_that_would_take_a_client_past_it():
    pytest.importorskip("dp_accounting")
    from hiso.config import load_config
    from hiso.core.history import RoundRecord
    from hiso.runners.accounting import PrivacyLedger
    cfg = load_config(None, clients=4, sampled=2, rounds=6, dp_clip=10.0, dp_noise_multiplier=2.0, dp_delta=1e-5,
                      dp_epsilon=None)
    budget = epsilon_spent(2.0, 3, 1e-5)  # three rounds for any one client
    cfg = cfg.model_copy(update={"dp_epsilon": budget})
    ledger = PrivacyLedger(cfg)
    for r, who in enumerate([(0, 1), (0, 2), (1, 2)]):
        assert ledger.refusal(who) is None
        ledger.record(RoundRecord(r, np.zeros((1, 1), np.uint64), np.zeros((1, 1), np.float32), who))
    assert ledger.refusal((1, 3)) is None and ledger.refusal((2, 3)) is None  # 1 and 2 have had 2 rounds
    ledger.record(RoundRecord(3, np.zeros((1, 1), np.uint64), np.zeros((1, 1), np.float32), (0, 3)))  # 0: 3 rounds
    assert ledger.refusal((1, 3)) is None
    why = ledger.refusal((0, 1))
    assert why is not None and "budget" in why and "client 0 to 4 rounds" in why
    assert ledger.worst() == (0, 3) and ledger.epsilon() == budget


def test_a_budget_stops_the_run_with_its_state_saved(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    from hiso.config import load_config
    from hiso.runners.rundir import build_simulation, run_to_dir
    cfg = load_config(None, rounds=6, dp_clip=10.0, dp_epsilon=5.0, dp_delta=1e-5, eval_every=3)
    # a run whose next round would pass its budget (a guard: the noise is solved for the run's own
    # sample, so only rounds planned again get here) stops there with its state saved

    def runner(c, task, on_record):
        sim = build_simulation(c, task, on_record)
        sim.privacy.refusal = lambda who: "privacy budget spent" if sim.server.round >= 3 else None
        return sim

    summary = run_to_dir(cfg, tmp_path / "b", runner=runner)
    assert summary["rounds_done"] == 3 and "budget" in summary["privacy"]["stopped"]
    assert torch.load(tmp_path / "b" / "model.pt")["round"] == 3


@pytest.mark.parametrize("args,msg", [
    (["--dp-clip", "-1", "--dp-noise-multiplier", "1"], "dp_clip"),
    (["--dp-clip", "1", "--dp-epsilon", "3"], "dp_delta"),
    (["--dp-clip", "1", "--dp-epsilon", "3", "--dp-delta", "1e-5", "--dp-noise-multiplier", "1"], "exactly one"),
    (["--dp-clip", "1"], "exactly one"),
    (["--dp-noise-multiplier", "1"], "dp_clip"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "1", "--aggregate", "median"], "mean"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "1", "--algorithm", "fedavg"], "hiso and decomfl"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "0", "--dp-delta", "1e-5"], "no finite epsilon"),
])
def test_bad_dp_settings_are_one_line_exit_2(tmp_path, capsys, args, msg):
    code, _, err = run_cli(_quad(tmp_path, "bad", *args), capsys)
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad").exists()


def test_a_comparison_table_names_each_private_arms_guarantee(tmp_path, capsys):
    pytest.importorskip("dp_accounting")
    conf = tmp_path / "c.toml"
    conf.write_text('task = "quadratic"\ndim = 20\nclients = 4\nsampled = 2\nrounds = 4\neval_every = 2\n\n'
                    '[compare]\nalgorithms = ["hiso", "hiso-dp"]\n[compare.variants]\n'
                    '"hiso-dp" = { algorithm = "hiso", dp_clip = 10.0, dp_noise_multiplier = 1.0, dp_delta = 1e-5 }\n')
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    priv = json.loads((out / "runs" / "hiso-dp" / "lr0.05" / "seed0" / "summary.json").read_text())["privacy"]
    spent, n = priv["epsilon"], priv["participations_max"]
    lines = [x for x in stdout.splitlines() if x.startswith("- privacy:")]
    assert lines == [f"- privacy: hiso-dp ran with central differential privacy: scalars clipped at 10, noise "
                     f"multiplier 1; ({spent:.3g}, 1e-05)-DP over the run for its most-sampled client ({n} rounds), "
                     "against a reader who knows who took part."]
    assert lines[0] in (out / "table.md").read_text()
