"""Simulated faults (lost, late, repeated, damaged answers) and Byzantine clients.

Rounds close with the valid answers; every rejected message is counted by reason; nothing is
applied half-way; every faithful replica stays bit-identical to the server; a fault-free run
is unchanged bit for bit.
"""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from hiso.core import Uplink, decode_uplink, encode_uplink, PreconditionerConfig
from hiso.methods.hiso_method import decomfl, hiso
from hiso.core.messages import MessageError
from hiso.runners.faults import Attackers, ChecksumError, Faults, seal, unseal
from hiso.runners.simulate import Simulation

from cli_helpers import run_cli
from conftest import TinyTask

ZOS = {"hiso": hiso(lr=0.02, perturbations=2, local_steps=2, precond=PreconditionerConfig(source="every")),
       "decomfl": decomfl(lr=0.02, perturbations=2, local_steps=1)}
HEAVY = Faults(drop=0.3, late=0.15, duplicate=0.15, corrupt=0.15, seed=3)


def _sim(zo, mode="faithful", faults=None, attackers=None, rule="mean", M=8, m=4, seed=0):
    return Simulation(TinyTask(num_clients=M), zo, clients_per_round=m, seed=seed, batch_size=8, mode=mode,
                      faults=faults, attackers=attackers, rule=rule, trim=0.25)


def _params(sim):
    return [p.detach().clone() for p in sim.state.params]


@pytest.mark.parametrize("algo", ["hiso", "decomfl"])
def test_faithful_replicas_stay_bit_identical_under_faults(algo):
    sim = _sim(ZOS[algo], faults=HEAVY)
    for _ in range(40):
        sim.step()
    rel = sim.reliability()  # also brings every replica to the server's round and compares
    assert rel["replica_checks"] > 100 and rel["replicas_out_of_sync"] == 0
    inj = rel["injected"]
    assert min(inj["drop"], inj["late"], inj["duplicate"], inj["corrupt"]) > 0
    # every duplicate and every damaged answer is rejected; late ones once they arrive
    assert rel["rejected"]["duplicate"] == inj["duplicate"]
    assert rel["rejected"]["checksum"] == inj["corrupt"]
    assert rel["rejected"]["wrong_round"] == inj["late"] - rel["late_in_flight_at_end"]
    # participants = answers that were neither lost, late, nor damaged
    logged = sum(len(r.participants) for r in sim.server.history)
    sent = sum(inj.values()) - inj["attacked"]
    total_answers = 40 * 4 + 4 * rel["rounds_replanned"]
    assert logged == total_answers - (sent - inj["duplicate"])


def test_a_client_whose_answer_was_lost_is_never_locked_out():
    sim = _sim(ZOS["hiso"], faults=Faults(drop=0.5, seed=1))
    lost_then = {}
    for _ in range(40):
        plan_no = sim.plans
        rec, _ = sim.step()
        for c in sim.server.history[-1].participants:
            lost_then.pop(c, None)
        for c in range(8):
            if sim.faults.fate(plan_no, c) == "drop" and c not in rec.participants:
                lost_then.setdefault(c, rec.round)
    # every client that lost an answer early on was heard from again
    assert all(r > 30 for r in lost_then.values()), lost_then


def test_fast_and_faithful_agree_under_faults_and_attackers():
    att = Attackers(8, 2, "scale,sign-flip", seed=0)
    a = _sim(ZOS["hiso"], "fast", HEAVY, att, rule="trimmed-mean")
    b = _sim(ZOS["hiso"], "faithful", HEAVY, att, rule="trimmed-mean")
    for _ in range(15):
        a.step(), b.step()
    assert all(torch.equal(x, y) for x, y in zip(a.state.params, b.state.params))
    assert all(np.array_equal(x.scalars, y.scalars) and x.participants == y.participants
               for x, y in zip(a.server.history, b.server.history))
    assert a.reliability()["rejected"] == b.reliability()["rejected"]


def test_a_fault_free_run_is_unchanged_bit_for_bit():
    a = _sim(ZOS["hiso"], faults=None)
    b = _sim(ZOS["hiso"], faults=Faults(seed=5))  # all rates 0: draws nothing, same path
    assert not b.unreliable
    for _ in range(10):
        a.step(), b.step()
    assert all(torch.equal(x, y) for x, y in zip(a.state.params, b.state.params))
    assert a.comm.up.tolist() == b.comm.up.tolist()


def test_the_unreliable_path_without_faults_equals_the_strict_one():
    """Partial aggregation with every answer valid is the same round as the strict path."""
    a = _sim(ZOS["hiso"], "faithful")
    b = _sim(ZOS["hiso"], "faithful", attackers=Attackers(8, 0))  # no attacker: still the strict path
    c = _sim(ZOS["hiso"], "faithful")
    c.unreliable = True  # force the unreliable path with nothing going wrong
    for _ in range(10):
        a.step(), b.step(), c.step()
    assert all(torch.equal(x, y) and torch.equal(x, z)
               for x, y, z in zip(a.state.params, b.state.params, c.state.params))


def test_nothing_is_applied_when_no_answer_is_valid():
    sim = _sim(ZOS["hiso"], faults=Faults(drop=0.9, seed=0), m=2)
    for _ in range(15):
        before = sim.server.round
        sim.step()
        assert sim.server.round == before + 1  # a round closes only with a valid answer
    rel = sim.reliability()
    assert rel["rounds_replanned"] > 0 and rel["replicas_out_of_sync"] == 0
    assert sim.server.replanned == rel["rounds_replanned"]


def test_damage_is_caught_by_the_checksum_even_when_it_would_decode():
    up = encode_uplink(Uplink(3, 7, np.arange(6, dtype=np.float32).reshape(2, 3), 0.5))
    f = Faults(corrupt=0.5, seed=0)
    decodable = 0
    for plan in range(200):
        bad = f.damage(seal(up), plan, 3)
        assert bad != seal(up)
        with pytest.raises(ChecksumError):
            unseal(bad)
        try:
            decode_uplink(bad[:-4], expect_shape=(2, 3))
            decodable += 1
        except MessageError:
            pass
    assert decodable > 50  # plenty of damage the decoder alone would take as plausible scalars
    assert unseal(seal(up)) == up


def test_fault_draws_are_seeded_and_follow_the_rates():
    f = Faults(drop=0.2, late=0.05, duplicate=0.05, corrupt=0.05, seed=9)
    fates = Counter(f.fate(p, c) for p in range(500) for c in range(8))
    assert fates == Counter(f.fate(p, c) for p in range(500) for c in range(8))
    n = 4000
    for fate, rate in [("drop", 0.2), ("late", 0.05), ("duplicate", 0.05), ("corrupt", 0.05)]:
        assert abs(fates[fate] / n - rate) < 4 * np.sqrt(rate * (1 - rate) / n), fate
    with pytest.raises(ValueError, match="must leave"):
        Faults(drop=0.6, late=0.4)


def test_attackers_are_seeded_and_lie_as_told():
    a = Attackers(64, 16, "scale,sign-flip,nan,random", scale=100.0, seed=4)
    assert a.attack == Attackers(64, 16, "scale,sign-flip,nan,random", scale=100.0, seed=4).attack
    assert a.attack != Attackers(64, 16, "scale,sign-flip,nan,random", scale=100.0, seed=5).attack
    assert Counter(a.attack.values()) == {"scale": 4, "sign-flip": 4, "nan": 4, "random": 4}
    g = np.array([[1.0, -2.0, 0.5]], dtype=np.float32)
    for c, kind in a.attack.items():
        out = a.lie(c, g, plan=3)
        if kind == "scale":
            np.testing.assert_array_equal(out, 100 * g)
        elif kind == "sign-flip":
            np.testing.assert_array_equal(out, -g)
        elif kind == "nan":
            assert np.isnan(out).all()
        else:
            assert np.isfinite(out).all() and not np.allclose(out, g)
            np.testing.assert_array_equal(out, a.lie(c, g, plan=3))
    with pytest.raises(ValueError, match="unknown attack"):
        Attackers(8, 1, "scale,flip")


def test_per_round_attackers_are_exactly_k_of_each_sample():
    a = Attackers(64, 2, "scale,sign-flip", seed=1, per_round=True)
    assert a.attack == {}
    seen = set()
    for plan in range(50):
        part = tuple(range(plan % 50, plan % 50 + 8))
        liars = a.of_round(plan, part)
        assert len(liars) == 2 and set(liars) <= set(part) and sorted(liars.values()) == ["scale", "sign-flip"]
        assert liars == a.of_round(plan, part)
        seen |= {c - part[0] for c in liars}
    assert len(seen) > 4  # the liars' places in the sample vary


def test_nan_attackers_are_rejected_and_robust_rules_resist_scaling():
    att = Attackers(8, 2, "nan", seed=0)
    sim = _sim(ZOS["hiso"], attackers=att)
    for _ in range(20):
        rec, _ = sim.step()
        assert not set(rec.participants) & set(att.attack)
    rel = sim.reliability()
    assert rel["rejected"]["non_finite"] == rel["injected"]["attacked"] > 0
    assert rel["replicas_out_of_sync"] == 0

    def final_loss(rule, attackers):
        s = _sim(ZOS["decomfl"], "fast", attackers=attackers, rule=rule)
        try:
            for _ in range(30):
                s.step()
        except FloatingPointError:  # the honest clients' loss itself blew up: diverged
            return float("inf")
        return s.task.evaluate(s.state.model)["eval_loss"]

    scaler = Attackers(8, 1, "scale", scale=1e4, seed=2)
    clean = final_loss("mean", None)
    assert final_loss("mean", scaler) > 10 * clean or not np.isfinite(final_loss("mean", scaler))
    for rule in ("median", "trimmed-mean"):
        assert final_loss(rule, scaler) < 3 * clean, rule  # finite and near the clean run's (mean: > 10x)


def test_cli_records_faults_and_reports_them(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--rounds", "12", "--clients", "8", "--sampled", "4", "--dim", "20",
                            "--mode", "faithful", "--drop-rate", "0.2", "--late-rate", "0.1",
                            "--duplicate-rate", "0.1", "--corrupt-rate", "0.1", "--byzantine", "1",
                            "--byzantine-per-round", "--attack", "nan", "--aggregate", "median",
                            "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["drop_rate"], cfg["corrupt_rate"], cfg["byzantine"], cfg["aggregate"]) == (0.2, 0.1, 1, "median")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(1 <= r["participants"] <= 4 for r in rows)
    summary = json.loads((out / "summary.json").read_text())["reliability"]
    assert summary["replicas_out_of_sync"] == 0 and summary["rounds_completed"] == 12
    per_round = Counter()
    for r in rows:
        per_round.update(r["rejected"])
    assert dict(per_round) == summary["rejected"]
    log = (out / "rejections.log").read_text().splitlines()
    assert len(log) == summary["rejected_total"] > 0
    assert summary["byzantine"] == {"per_round": 1, "attacks": ["nan"]}
    inj = summary["injected"]  # a duplicated lie is rejected twice
    assert 0 < summary["rejected"]["non_finite"] <= inj["attacked"] + inj["duplicate"]
    # interrupted before its summary: resumed, it ends as it did (tests/test_resume.py cuts deeper)
    before = {f: (out / f).read_bytes() for f in ("summary.json", "rejections.log", "history.bin")}
    (out / "summary.json").unlink()
    code, _, err = run_cli(["run", "--resume", str(out), "--quiet"], capsys)
    assert code == 0, err
    after = json.loads((out / "summary.json").read_text())
    assert after["reliability"] == json.loads(before["summary.json"])["reliability"]
    assert (out / "rejections.log").read_bytes() == before["rejections.log"]
    assert (out / "history.bin").read_bytes() == before["history.bin"]


@pytest.mark.parametrize("args,msg", [
    (["--drop-rate", "0.6", "--late-rate", "0.5"], "must be < 1"),
    (["--byzantine", "30", "--clients", "20"], "cannot exceed clients"),
    (["--attack", "flip"], "unknown attack"),
    (["--trim", "0.5"], "trim"),
    (["--algorithm", "fedavg", "--drop-rate", "0.1"],
     "seed-and-scalar methods (hiso, decomfl, feedsign, ferret, fedkrso, conmezo), not fedavg"),
])
def test_bad_reliability_options_are_refused_in_one_line(tmp_path, capsys, args, msg):
    code, _, err = run_cli(["run", "--rounds", "2", *args, "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert code != 0 and msg in err and len(err.strip().splitlines()) <= 2
