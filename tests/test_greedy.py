"""Greedy: each local step keeps the candidate of largest |g| among its P seeds and sends (index, scalar)."""

import numpy as np
import pytest
import torch
from torch import nn

from hiso.config import load_config
from hiso.core.directions import direction
from hiso.core.messages import MessageError, Uplink, Wire, decode_uplink, encode_uplink
from hiso.core.seeds import round_seeds
from hiso.core.server import Server
from hiso.methods.greedy import CHOICE, Greedy, choices_size, choose, decode_choices, encode_choices
from hiso.runners.simulate import Simulation

from cli_helpers import run_cli
from conftest import TinyTask
from seed_method_checks import LinearTask, assert_run_refused, assert_same_model, late_client


def _zo(lr=0.05, **kw):
    return load_config(None, algorithm="greedy", task="quadratic", lr=lr, **kw).zo()


# ---------------------------------------------------------------- the rule and the wire

def test_a_client_keeps_the_first_candidate_of_largest_magnitude():
    assert choose(np.array([0.5, -2.0, 1.0, 2.0], np.float32)).tolist() == [0.0, -2.0, 0.0, 0.0]
    assert choose(np.zeros(3, np.float32)).tolist() == [0.0, 0.0, 0.0]
    assert Greedy().step_scalars(np.array([0.1, 0.3, -0.2], np.float32)).tolist() == [0.0, np.float32(0.3), 0.0]


def test_an_uplink_is_one_index_byte_and_one_scalar_a_step():
    wire, plain = Wire(2, 8, uplink=CHOICE), Wire(2, 8)
    g = np.zeros((2, 8), np.float32)
    g[0, 5], g[1, 0] = -1.5, 0.25
    data = encode_uplink(Uplink(3, 7, g, 0.5), wire)
    head = 6  # version, kind, flags, client, round, attempt: one byte each here
    assert data[head:head + 2] == bytes([5, 0]) and np.frombuffer(data, "<f4", 2, head + 2).tolist() == [-1.5, 0.25]
    assert len(data) == head + choices_size(2, 8, "float32") + 4 == head + 2 + 8 + 4
    assert len(encode_uplink(Uplink(3, 7, g, 0.5), plain)) == head + 16 * 4 + 4  # the same answer as scalars
    back = decode_uplink(data, wire)
    assert np.array_equal(back.scalars, g) and back.loss == 0.5
    with pytest.raises(ValueError, match="more than one nonzero"):
        encode_uplink(Uplink(3, 7, np.ones((2, 8), np.float32)), wire)
    for bad, words in ((data[:head] + bytes([8]) + data[head + 1:], "index past the 8 columns"),
                       (data[:head] + bytes([5, 3]) + data[head + 2:head + 6] + bytes(4) + data[head + 10:],
                        "zero value at an index other than 0"),
                       (data[:-1], "truncated")):
        with pytest.raises(MessageError, match=words):
            decode_uplink(bad, wire)
    # int8: the tau values are one block (a float32 scale and a code each)
    assert len(encode_uplink(Uplink(3, 7, g), Wire(2, 8, "int8", uplink=CHOICE))) == head + 2 + 4 + 2


@pytest.mark.parametrize("P, width", [(255, 1), (256, 1), (257, 2), (65536, 2)])
def test_an_index_is_one_byte_up_to_p_256_and_two_little_endian_past_it(P, width):
    g = np.zeros((2, P), np.float32)
    g[0, P - 1], g[1, 1] = 0.5, -2.0
    data = encode_choices(g, "float32")
    assert len(data) == choices_size(2, P, "float32") == 2 * width + 8
    assert data[:2 * width] == (P - 1).to_bytes(width, "little") + (1).to_bytes(width, "little")
    assert np.array_equal(decode_choices(data, 0, 2, P, "float32"), g)
    wire = Wire(2, P, uplink=CHOICE)
    assert wire.uplink.size(wire) == 2 * width + 8  # what a run counts for its uplink


def test_the_server_logs_the_mean_of_the_answers_candidate_by_candidate():
    srv = Server(3, 3, 1, 4, seed=0, method=Greedy())
    assert srv.wire.uplink is CHOICE
    plan = srv.plan()
    answers = {0: [2.0, 0, 0, 0], 1: [0, 0, -1.0, 0], 2: [4.0, 0, 0, 0]}
    rec = srv.aggregate([Uplink(c, plan.round, np.array([answers[i]], np.float32), 0.0)
                         for i, c in enumerate(plan.participants)])
    assert rec.scalars.tolist() == [[2.0, 0.0, np.float32(-1 / 3), 0.0]]


# ---------------------------------------------------------------- known answer: a round by hand

_C = [(1.0, 0.5, -0.25, 0.125), (-0.125, 0.25, 1.0, -0.5)]  # every sign pattern gives another |c . u|


class Linear4(LinearTask):
    def build_model(self):
        m = nn.Linear(4, 1, bias=False)
        nn.init.zeros_(m.weight)
        return m


def test_two_rounds_worked_by_hand():
    lr, P = 0.3, 3
    sim = Simulation(Linear4(_C), _zo(lr=lr, perturbations=P), clients_per_round=2, seed=1, mode="faithful",
                     eval_every=100)
    C = np.array(_C)
    for r in range(2):
        u = np.stack([direction(int(s), [torch.Size([1, 4])])[0].reshape(-1).double().numpy()
                      for s in round_seeds(1, r, 0, 1, P)[0]])
        g = C @ u.T  # (client, candidate): f is linear, so the estimate is c . u
        want = np.zeros(P)
        for i in range(2):  # each client keeps its candidate of largest |g|
            j = int(np.argmax(np.abs(g[i])))
            want[j] += g[i, j] / 2
        assert all(len(set(np.abs(row).round(6))) == P for row in g)  # no tie: the rule alone decides
        w = sim.state.params[0].detach().reshape(-1).double().numpy()
        rec, _ = sim.step()
        assert rec.scalars[0].tolist() == pytest.approx(want.tolist(), rel=1e-5, abs=1e-6)
        assert np.count_nonzero(rec.scalars) <= 2  # the chosen candidates only
        w_next = w - lr * (want / P) @ u  # DeComFL's fold: the others are 0
        assert sim.state.params[0].reshape(-1).tolist() == pytest.approx(w_next.tolist(), rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------- exact replicas, late clients

@pytest.mark.parametrize("local_steps", [1, 2])
def test_replicas_and_clients_that_skipped_many_rounds_match_bit_for_bit(local_steps):
    zo = _zo(lr=0.1, local_steps=local_steps, perturbations=4)
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    rows = list(sim.run(60))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert max(sim.server.round - c.state.round for c in sim.clients.values()) > 10
    assert all(np.count_nonzero(r.scalars, axis=1).max() <= 3 for r in sim.server.history)  # <= one per client
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, zo).state])


# ---------------------------------------------------------------- the command line

RUN = ["--task", "quadratic", "--dim", "30", "--clients", "5", "--sampled", "2", "--lr", "0.2",
       "--eval-every", "2", "--threads", "1", "--algorithm", "greedy", "--perturbations", "8"]


def _model(path):
    return torch.load(path, weights_only=False)


def test_rebuild_and_resume_are_bit_for_bit(tmp_path, capsys):
    from seed_method_checks import resumed_and_rebuilt
    a, b, rebuilt = resumed_and_rebuilt(RUN, tmp_path, capsys)
    assert a["round"] == b["round"] == 8 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["model"][k], rebuilt["model"][k]) for k in a["model"])


def test_what_it_declares_runs_together_and_rebuilds(tmp_path, capsys):
    # int8 (the tau values as one block up, the record as one down), server momentum, lr decay, weights
    d = tmp_path / "r"
    code, _, err = run_cli(["run", "--quiet", *RUN, "--sampled", "3", "--rounds", "10", "--scalar-dtype", "int8",
                            "--momentum", "0.5", "--lr-decay", "10", "--weighted", "--out", str(d)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["rebuild", str(d), "--out", str(tmp_path / "re.pt")], capsys)
    assert code == 0, err
    a, b = _model(d / "model.pt"), _model(tmp_path / "re.pt")
    assert set(a) == {"round", "model", "momentum"}
    assert all(torch.equal(a[p][k], b[p][k]) for p in ("model", "momentum") for k in a[p])


def test_the_uplink_bytes_counted_are_an_index_and_a_scalar(tmp_path, capsys):
    from seed_method_checks import uplink_bytes_of_three_rounds
    up = uplink_bytes_of_three_rounds(RUN, tmp_path, capsys)
    # the hello (4 bytes), then 3 uplinks: header 6, one index byte, one float32 scalar, the float32 loss
    # (P = 8 float32 scalars would be 32 bytes); the downlink's records stay P scalars each
    assert up == 4 + 3 * (6 + 1 + 4 + 4)


def test_the_flower_serverapp_runs_it_as_the_simulator_does(tmp_path, monkeypatch):
    from seed_method_checks import assert_serverapp_runs_it_as_the_simulator
    assert_serverapp_runs_it_as_the_simulator({"algorithm": "greedy", "perturbations": 4, "lr": 0.1},
                                             tmp_path, monkeypatch)


@pytest.mark.slow
def test_hiso_flower_deploys_it_as_hiso_run_runs_it(tmp_path, capsys):
    """``hiso flower``: a SuperLink and two SuperNodes as processes; the run is ``hiso run``'s, bit for bit."""
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from seed_method_checks import flower_and_run
    a, b = flower_and_run(RUN, tmp_path, capsys)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("flags, msg", [
    (["--perturbations", "1"], "greedy chooses among the P = --perturbations candidates a step: needs P >= 2, got 1"),
    (["--aggregate", "median"], "not greedy"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "1"], "differential privacy is for"),
    (["--method-opt", "k=4"], "greedy has no options of its own"),
])
def test_bad_settings_fail_with_one_line(tmp_path, capsys, flags, msg):
    assert_run_refused(tmp_path, capsys, ["--task", "quadratic", "--algorithm", "greedy", *flags], msg)
