"""FeedSign: one sign bit per client-step on the wire, the majority vote logged and replayed."""

import json

import numpy as np
import pytest
import torch

from hiso.config import load_config
from hiso.core.directions import direction
from hiso.core.history import read_history
from hiso.core.messages import MessageError, Uplink, Wire, decode_uplink, encode_uplink
from hiso.core.seeds import round_seeds
from hiso.core.server import Server
from hiso.methods.feedsign import SIGNS, FeedSign, pack, unpack
from hiso.runners.simulate import Simulation

from cli_helpers import run_cli
from conftest import TinyTask
from seed_method_checks import LinearTask, assert_run_refused, assert_same_model, late_client


def _zo(**kw):
    return load_config(None, algorithm="feedsign", task="quadratic", lr=kw.pop("lr", 0.02), **kw).zo()


# ---------------------------------------------------------------- the wire: 8 signs a byte

def test_signs_pack_eight_to_a_byte_least_significant_bit_first():
    s = [1, -1, -1, 1, 1, 1, -1, -1, 1]
    # byte 0: bits 1,0,0,1,1,1,0,0 (LSB first) = 0b00111001; byte 1: bit 1
    assert pack(s) == bytes([0x39, 0x01])
    assert unpack(pack(s), 0, 9).tolist() == s
    with pytest.raises(ValueError, match="pad bits"):
        unpack(bytes([0x39, 0x03]), 0, 9)


@pytest.mark.parametrize("tau, P", [(9, 1), (3, 4), (1, 5), (2, 3), (2, 4)])
def test_the_sign_decoder_accepts_exactly_the_bytes_an_encoder_makes(tau, P):
    """Every value of the last payload byte (the one with the pad bits, where n = tau P is not a
    multiple of 8): the decoder takes those some signs encode to, and refuses the rest."""
    wire, n = Wire(tau, P, uplink=SIGNS), tau * P
    k = n - 8 * ((n - 1) // 8)  # the signs in the last byte
    made = set()
    for v in range(2 ** k):  # every choice of the last byte's signs (the others +1)
        s = np.ones(n, np.float32)
        s[n - k:] = [1.0 if v >> j & 1 else -1.0 for j in range(k)]
        made.add(encode_uplink(Uplink(3, 5, s.reshape(tau, P)), wire))
    base = next(iter(made))
    accepted = set()
    for last in range(256):
        data = base[:-1] + bytes([last])
        try:
            up = decode_uplink(data, wire)
        except MessageError as e:
            assert "pad bits" in str(e)
            continue
        accepted.add(data)
        assert encode_uplink(up, wire) == data  # the bytes of the signs it read
    assert accepted == made and len(made) == 2 ** k


def test_uplink_payload_is_one_bit_per_client_step():
    signs = np.array([[1], [-1], [-1], [1], [1], [1], [-1], [-1], [1]], np.float32)  # tau = 9, P = 1
    packed, plain = Wire(9, 1, uplink=SIGNS), Wire(9, 1)
    up = Uplink(3, 5, signs)
    a, b = encode_uplink(up, packed), encode_uplink(up, plain)
    head = 6  # version, kind, flags, client, round, attempt: one byte each here
    assert len(a) == head + 2 and a[head:] == bytes([0x39, 0x01])
    assert len(b) == head + 9 * 4  # the same uplink as float32 scalars
    back = decode_uplink(a, packed)
    assert np.array_equal(back.scalars, signs) and back.client == 3 and back.round == 5
    with_loss = encode_uplink(Uplink(3, 5, signs, 0.5), packed)
    assert len(with_loss) == head + 2 + 4 and decode_uplink(with_loss, packed).loss == 0.5
    with pytest.raises(ValueError, match="signs"):
        encode_uplink(Uplink(3, 5, signs * 0.5), packed)
    with pytest.raises(MessageError):
        decode_uplink(a[:-1], packed)


def test_server_logs_the_majority_vote_and_a_tie_is_no_step():
    srv = Server(3, 3, 2, 1, seed=0, method=FeedSign())  # all three clients answer
    plan = srv.plan()
    s = {0: [[1], [-1]], 1: [[1], [1]], 2: [[-1], [-1]]}
    rec = srv.aggregate([Uplink(c, plan.round, np.array(s[c], np.float32), 0.0) for c in plan.participants])
    assert rec.scalars.tolist() == [[1.0], [-1.0]]  # 2 of 3 say +, then 2 of 3 say -
    srv2 = Server(2, 2, 1, 1, seed=0, method=FeedSign())
    p2 = srv2.plan()
    tie = srv2.aggregate([Uplink(c, p2.round, np.array([[1.0 if c == 0 else -1.0]], np.float32), 0.0)
                          for c in p2.participants])
    assert tie.scalars.tolist() == [[0.0]]  # one for, one against: no step


@pytest.mark.parametrize("n, signs", [(6, [1, 1, 1, -1, -1, -1]), (6, [-1, -1, -1, 1, 1, 1]),
                                      (10, [1] * 5 + [-1] * 5), (12, [-1] * 6 + [1] * 6)])
def test_a_tie_is_no_step_whatever_the_number_of_clients(n, signs):
    # the mean of +-1 over 6, 10 or 12 clients sums six 1/6 in float64 and is not exactly 0:
    # the vote must come from the sum of the signs, which is
    srv = Server(n, n, 1, 1, seed=0, method=FeedSign())
    plan = srv.plan()
    rec = srv.aggregate([Uplink(c, plan.round, np.array([[signs[i]]], np.float32), 0.0)
                         for i, c in enumerate(plan.participants)])
    assert rec.scalars.tolist() == [[0.0]]


# ---------------------------------------------------------------- known answer: two rounds by hand

_C = [(1.0, 0.0), (0.0, 1.0), (-1.0, -2.0)]  # f_i(w) = c_i . w: the derivative along z is c_i . z exactly


def test_two_rounds_worked_by_hand():
    # the run's directions (Philox Rademacher, run seed 0): z_0 = (-1, -1), z_1 = (1, -1)
    z = [direction(int(round_seeds(0, r, 0, 1, 1)[0, 0]), [torch.Size([1, 2])])[0].tolist() for r in range(2)]
    assert z == [[[-1.0, -1.0]], [[1.0, -1.0]]]
    # round 0: c.z = -1, -1, 3 -> signs -, -, + -> vote -1 -> w1 = 0 - 0.1 (-1) z_0 = (-0.1, -0.1)
    # round 1: c.z = 1, -1, 1 -> signs +, -, + -> vote +1 -> w2 = w1 - 0.1 z_1 = (-0.2, 0.0)
    sim = Simulation(LinearTask(_C), _zo(lr=0.1), clients_per_round=3, seed=0, mode="faithful", eval_every=100)
    r0, _ = sim.step()
    r1, _ = sim.step()
    assert r0.scalars.tolist() == [[-1.0]] and r1.scalars.tolist() == [[1.0]]
    w = sim.state.params[0].detach()
    assert w.tolist() == [[np.float32(-0.2), 0.0]]
    assert all(torch.equal(c.state.params[0], w) for c in sim.clients.values() if c.state.round == 2)


# ---------------------------------------------------------------- exact replicas, late clients

def test_replicas_and_a_client_that_skipped_every_round_match_bit_for_bit():
    zo = _zo(local_steps=2)
    assert zo.uplink is SIGNS and zo.shape == (2, 1) and zo.difference == "central"
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    rows = list(sim.run(80))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert {float(v) for r in sim.server.history for v in r.scalars.ravel()} <= {-1.0, 0.0, 1.0}
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, zo).state])


# ---------------------------------------------------------------- the command line

TINY = ["--task", "quadratic", "--dim", "50", "--clients", "6", "--sampled", "3", "--rounds", "30",
        "--eval-every", "10", "--quiet"]


def test_cli_run_records_the_defaults_and_rebuild_is_bit_identical(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--algorithm", "feedsign", *TINY], capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["algorithm"], cfg["perturbations"], cfg["difference"]) == ("feedsign", 1, "central")
    tau, P, records = read_history(out / "history.bin")  # the logged scalars are the votes
    assert (tau, P, len(records)) == (1, 1, 30)
    assert {float(r.scalars[0, 0]) for r in records} <= {-1.0, 0.0, 1.0}
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = torch.load(out / "model.pt"), torch.load(tmp_path / "rb.pt")
    assert torch.equal(a["model"]["x"], b["model"]["x"]) and not torch.equal(a["model"]["x"], torch.zeros(50))


@pytest.mark.parametrize("flags, msg", [
    (["--perturbations", "3"], "perturbations must be 1"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "1"], "not feedsign"),
])
def test_bad_settings_fail_with_one_line(tmp_path, capsys, flags, msg):
    assert_run_refused(tmp_path, capsys, ["--algorithm", "feedsign", *TINY, *flags], msg)


# ---------------------------------------------------------------- resume and faults: a vote is not a sign

def test_a_run_whose_log_holds_a_tie_resumes_to_the_uninterrupted_run(tmp_path):
    """Resuming counts each logged round's uplink bytes from the logged record, whose vote may be 0
    (a tie), which no client sends: the count must not refuse it."""
    import shutil

    from hiso.runners.rundir import run_to_dir
    cfg = load_config(None, algorithm="feedsign", task="quadratic", dim=30, clients=4, sampled=2, rounds=8,
                      eval_every=2, seed=4)
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_to_dir(cfg, full)
    shutil.copytree(full, cut)
    lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)
    (cut / "metrics.jsonl").write_text("".join(lines[:7]))  # rounds 0..6: records 0..5 are replayed
    _, _, records = read_history(full / "history.bin")
    assert 0.0 in [float(r.scalars[0, 0]) for r in records[:6]]
    for f in ("summary.json", "model.pt"):
        (cut / f).unlink()
    run_to_dir(cfg, cut, resume=True)
    a, b = torch.load(full / "model.pt"), torch.load(cut / "model.pt")
    assert a["round"] == b["round"] == 8 and torch.equal(a["model"]["x"], b["model"]["x"])
    sa, sb = (json.loads((d / "summary.json").read_text())["communication_per_client"] for d in (full, cut))
    assert sa == sb


def test_dropped_answers_in_fast_mode_count_the_bytes_faithful_mode_counts(tmp_path):
    from hiso.runners.rundir import run_to_dir
    kw = dict(algorithm="feedsign", task="quadratic", dim=30, clients=6, sampled=3, rounds=10, eval_every=5, seed=1,
              drop_rate=0.3)
    for mode in ("fast", "faithful"):
        run_to_dir(load_config(None, mode=mode, **kw), tmp_path / mode)
    assert (tmp_path / "fast" / "history.bin").read_bytes() == (tmp_path / "faithful" / "history.bin").read_bytes()
    sa, sb = (json.loads((tmp_path / m / "summary.json").read_text())["communication_per_client"]
              for m in ("fast", "faithful"))
    assert sa == sb and sa["bytes_up_mean"] > 0


def test_attacks_a_sign_cannot_carry_are_refused_and_a_lying_sign_moves_the_run(tmp_path):
    """A scaled sign is the same sign and a NaN packs as -1: both would run as something other than
    the attack named (scale: no attack at all). Sign-flip and random lies change the logged votes."""
    kw = dict(algorithm="feedsign", task="quadratic", dim=30, clients=6, sampled=3, rounds=6, byzantine=2)
    for attack in ("scale", "nan", "sign-flip,nan"):
        with pytest.raises(ValueError, match="feedsign's clients send signs"):
            load_config(None, attack=attack, **kw)
    assert load_config(None, byzantine=0, attack="nan", algorithm="feedsign", task="quadratic")  # no attackers
    assert "attack_scale" in load_config(None, attack="random", attack_scale=5.0, **kw).unused_options()
    assert "attack_scale" not in load_config(None, attack="random", attack_scale=5.0, algorithm="decomfl",
                                             task="quadratic", byzantine=2).unused_options()

    def votes(**extra):
        from hiso.runners.rundir import run_to_dir
        out = tmp_path / "-".join(f"{k}{v}" for k, v in extra.items())
        run_to_dir(load_config(None, **{**kw, **extra}), out)
        return np.concatenate([r.scalars.ravel() for r in read_history(out / "history.bin")[2]])

    honest = votes(byzantine=0)
    assert not np.array_equal(votes(attack="sign-flip"), honest)
    assert not np.array_equal(votes(attack="random"), honest)


def test_the_core_names_no_method():
    """FeedSign's codec and vote are its own (methods/feedsign.py): no module of hiso.core names
    them, nor compares a value with a built-in method's name."""
    import ast
    from pathlib import Path

    import hiso.core
    from hiso.methods.registry import method_names
    names, found = set(method_names()), []
    for path in sorted(Path(hiso.core.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            used = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            made = (node.arg if isinstance(node, (ast.arg, ast.keyword)) else
                    node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
            word = used or made  # (a use of "signs" may be the direction kernels' Rademacher draw)
            if used in ("SIGNS", "Signs", "sign_vote") or made in ("signs", "SIGNS", "Signs", "sign_vote") or (
                    isinstance(node, ast.Constant) and node.value in names):
                found.append(f"{path.name}:{node.lineno} {word or node.value!r}")
    assert not found
