"""Local DP holds against the server, so its ledger counts every answer the server reads (on time,
late, rejected, duplicated), not only the logged ones; central mode counts the record's
participants (hiso.runners.accounting)."""

import json

import numpy as np
import pytest

from cli_helpers import run_cli
from hiso.config import load_config
from hiso.methods.privacy import epsilon_spent

RUN = dict(task="quadratic", dim=20, clients=8, sampled=4, rounds=12, eval_every=4, dp_clip=1.0,
           dp_noise_multiplier=1.0, dp_delta=1e-5, dp_noise_seed=3, late_rate=0.3, duplicate_rate=0.1,
           corrupt_rate=0.1, seed=2)


def _decoded(monkeypatch):
    """Every (round, attempt, client) of an uplink the simulator's server decodes, and the run."""
    import hiso.core.server_rounds as sim  # where the round decodes every uplink
    seen, real = set(), sim.decode_uplink

    def spy(data, wire, **kw):
        up = real(data, wire, **kw)
        seen.add((up.round, up.attempt, up.client))
        return up
    monkeypatch.setattr(sim, "decode_uplink", spy)
    from hiso.runners.faults import Faults, unseal
    damage = Faults.damage

    def damaged(self, data, plan, cid):  # a damaged answer reached the server too (its bits, most of them)
        up = real(unseal(data), sim_wire[0])
        seen.add((up.round, up.attempt, up.client))
        return damage(self, data, plan, cid)
    sim_wire = []
    monkeypatch.setattr(Faults, "damage", damaged)
    return seen, sim, sim_wire


# most answers late and two clients a round: rounds planned again (attempts 1, 2, ...), a client
# answering two attempts of one round, and rows with several unlogged answers of one client
REPLANNED = dict(RUN, clients=4, sampled=2, late_rate=0.6, duplicate_rate=0.1, corrupt_rate=0.1, seed=0)


@pytest.mark.parametrize("run", [RUN, REPLANNED], ids=["faults", "replanned"])
@pytest.mark.parametrize("mode", ["local", "central"])
def test_the_ledger_counts_what_the_server_read(tmp_path, monkeypatch, mode, run):
    from hiso.runners.faults import unseal
    from hiso.runners.rundir import run_to_dir
    seen, sim, sim_wire = _decoded(monkeypatch)
    cfg = load_config(**run, dp_mode=mode)
    runners = []

    def runner(cfg_, task, on_record=None):
        from hiso.runners.rundir import build_simulation
        runners.append(build_simulation(cfg_, task, on_record))
        sim_wire.append(runners[-1].server.wire)
        return runners[-1]
    summary = run_to_dir(cfg, tmp_path / "r", runner=runner)
    s = runners[-1]
    for _, data in s.pending:  # on its way at the end: sent, the server would read it next
        up = sim.decode_uplink(unseal(data), s.server.wire)
        seen.add((up.round, up.attempt, up.client))
    logged = np.zeros(cfg.clients, int)
    from hiso.runners.runfiles import read_run_history
    records = read_run_history(tmp_path / "r", cfg).records
    for rec in records:
        logged[list(rec.participants)] += 1
    if run is REPLANNED:  # the run has what the ledger must tell apart
        rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        assert any(rec.attempt > 0 for rec in records)
        firsts = {(r, c) for r, a, c in seen if a == 0}
        assert any((r, c) in firsts for r, a, c in seen if a > 0)  # one client, two attempts of one round
        if mode == "local":
            assert max(n for r in rows for n in (r.get("dp_unlogged") or {0: 0}).values()) >= 2
    read = np.bincount([c for _, _, c in seen], minlength=cfg.clients)
    want = read if mode == "local" else logged
    assert (read > logged).any()  # the faults made releases the log does not list
    assert list(s.privacy.counts) == list(want)
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilon_spent(1.0, int(want.max()), 1e-5))
    # read back from the files (an export, a report): the same figure
    from hiso.runners.accounting import ledger_of_run
    assert list(ledger_of_run(tmp_path / "r", cfg, cfg.rounds).counts) == list(want)


def test_a_resumed_local_run_counts_as_the_run_that_was_not_cut(tmp_path, capsys):
    args = ["--task", "quadratic", "--dim", "20", "--clients", "8", "--sampled", "4", "--eval-every", "4",
            "--dp-clip", "1", "--dp-noise-multiplier", "1", "--dp-delta", "1e-5", "--dp-noise-seed", "3",
            "--dp-mode", "local", "--late-rate", "0.3", "--seed", "2", "--quiet"]
    full, short = tmp_path / "full", tmp_path / "short"
    assert run_cli(["run", "--out", str(full), *args, "--rounds", "12"], capsys)[0] == 0
    assert run_cli(["run", "--out", str(short), *args, "--rounds", "6"], capsys)[0] == 0
    assert run_cli(["run", "--resume", str(short), "--rounds", "12"], capsys)[0] == 0
    a, b = (json.loads((d / "summary.json").read_text())["privacy"] for d in (full, short))
    assert (a["epsilon"], a["participations_max"]) == (b["epsilon"], b["participations_max"])
    unlogged = [r for r in map(json.loads, (full / "metrics.jsonl").read_text().splitlines()) if "dp_unlogged" in r]
    assert unlogged  # late answers, named in their rounds' rows


@pytest.mark.parametrize("mode", ["local", "central"])
def test_flower_counts_an_answer_it_dropped_in_local_mode(tmp_path, monkeypatch, mode):
    """The ServerApp read an answer and dropped it (here: refused by its decoder): a release in
    local mode, named in its round's row (so a resumed run counts it); nothing in central mode."""
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from hiso.config import RunConfig
    from hiso.core.messages import MessageError
    from hiso.flower.app import Settings, serve
    from hiso.flower.loopback import LoopbackGrid, server_task
    import hiso.core.server_rounds as sa  # where the round decodes every uplink
    real, refused = sa.decode_uplink, []

    def decode(data, wire, expect_round=None):
        up = real(data, wire, expect_round=expect_round)
        if (up.round, up.client) == (1, 2):
            refused.append(up.client)
            raise MessageError("refused by the test")
        return up
    monkeypatch.setattr(sa, "decode_uplink", decode)
    cfg = RunConfig(task="quadratic", clients=3, sampled=3, dim=20, lr=0.05, eval_every=2, rounds=4, threads=1,
                    dp_clip=2.0, dp_noise_multiplier=0.5, dp_delta=1e-3, dp_mode=mode)
    with server_task():
        serve(LoopbackGrid(cfg, tmp_path / "replicas", {100: 0, 101: 1, 102: 2}), cfg,
              Settings(out_dir=str(tmp_path / "f"), round_timeout=0.3, poll_s=0.0, suspect_grace_s=0.0))
    assert refused == [2]
    rows = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    priv = json.loads((tmp_path / "f" / "summary.json").read_text())["privacy"]
    assert [r.get("dp_unlogged") for r in rows[1:]] == ([None, {"2": 1}, None, None] if mode == "local" else [None] * 4)
    assert priv["participations_max"] == 4
    from hiso.runners.accounting import ledger_of_run  # client 2: 3 rounds logged, and the answer dropped
    assert list(ledger_of_run(tmp_path / "f", cfg, 4).counts) == ([4, 4, 4] if mode == "local" else [4, 4, 3])


@pytest.mark.parametrize("mode", ["local", "central", None])
def test_under_dp_no_clients_seconds_or_memory_enter_the_files(tmp_path, capsys, mode):
    """A client's compute time and transient memory depend on its data (padding to the longest
    prompt): under DP the rows carry no client_s and summary.json no seconds or transient peak;
    the data-independent counts stay. Without DP all are there."""
    dp = [] if mode is None else ["--dp-clip", "1", "--dp-noise-multiplier", "1", "--dp-mode", mode]
    code, _, err = run_cli(["run", "--quiet", "--task", "quadratic", "--dim", "20", "--clients", "4", "--sampled", "2",
                            "--rounds", "3", "--out", str(tmp_path / "r"), *dp], capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    client = json.loads((tmp_path / "r" / "summary.json").read_text())["client"]
    assert all(r["client_answers"] == 2 * r["round"] for r in rows[1:])
    timed = mode is None
    assert all(("client_s" in r) == timed for r in rows[1:])
    assert (client["s_per_round"] is not None) == timed and client["forwards_per_round"] > 0
    if client["memory_measured_by"] != "torch profiler without allocation events":
        assert (client["transient_peak_bytes"] is not None) == timed
    from hiso.report.runs import summary_at  # a report read from the rows: no seconds either
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (summary_at(tmp_path / "r", config, rows, None)["client"]["s_per_round"] is not None) == timed


def test_play_round_checks_the_budget_before_every_plan_of_a_round():
    """``before(plan)`` (the DP budget's check) runs for a re-plan as for a round's first plan:
    each attempt's sample releases answers."""
    from types import SimpleNamespace

    from hiso.core.round import PlainTransport, play_round

    class Rounds:
        n = 0

        def plan(self):
            self.n += 1
            return SimpleNamespace(round=4, participants=(self.n,), attempt=self.n - 1)

        def downlink(self, client):
            return b"down"

        def decode(self, client, reply, plan):
            return reply

        def close(self, answers, partial):
            return "record" if self.n == 3 else None  # the first two plans close with nothing

        def rejections(self):
            return []

        def commit(self, record):
            pass

    class Transport(PlainTransport):
        def exchange(self, plan, downlink, tally):
            return [(c, downlink(c)) for c in plan.participants]

    checked = []
    played = play_round(Rounds(), Transport(), partial=True, before=checked.append)
    assert [(p.attempt, p.participants) for p in checked] == [(0, (1,)), (1, (2,)), (2, (3,))]
    assert played.replanned == 2


def test_the_budget_holds_on_every_attempt_of_a_replanned_round(tmp_path, monkeypatch):
    """Local DP, 60 % of answers late, two of six clients a round: rounds are planned again and
    each attempt's sample releases answers the server reads. Every attempt is checked against
    the budget, so the run stops with no client past it; here (seed 0) the plan refused is a
    re-plan (a check on a round's first plan only ends this run at epsilon 20.8 > 20)."""
    pytest.importorskip("dp_accounting")
    import hiso.runners.simulate as simulate
    from hiso.runners.accounting import ledger_of_run
    from hiso.runners.rundir import run_to_dir
    real, checked = simulate.play_round, []

    def play_round(*a, before, **kw):
        def check(plan):
            checked.append(plan.attempt)
            before(plan)
        return real(*a, before=check, **kw)
    monkeypatch.setattr(simulate, "play_round", play_round)
    cfg = load_config(task="quadratic", dim=10, clients=6, sampled=2, rounds=30, eval_every=30, dp_clip=1.0,
                      dp_epsilon=20.0, dp_delta=1e-5, dp_mode="local", dp_noise_seed=1, late_rate=0.6, seed=0)
    summary = run_to_dir(cfg, tmp_path / "r")
    priv = summary["privacy"]
    assert "budget" in priv["stopped"] and summary["reliability"]["rounds_replanned"] > 0
    assert checked[-1] > 0  # the plan the budget refused was a re-plan
    assert priv["epsilon"] <= 20.0
    assert priv["epsilon"] == pytest.approx(epsilon_spent(priv["noise_multiplier"], priv["participations_max"], 1e-5))
    assert ledger_of_run(tmp_path / "r", cfg, summary["rounds_done"]).epsilon() == priv["epsilon"]
