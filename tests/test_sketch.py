"""The low-bit sketch method: Ferret's projections as b-bit codes with a scale per block."""

import struct

import numpy as np
import pytest
import torch

from hiso.config import load_config
from hiso.core.messages import MessageError, Uplink, Wire, decode_uplink, encode_uplink
from hiso.core.scalars import codes_size, decode_codes, encode_codes, quantize_rows
from hiso.core.uplink import Codes
from hiso.runners.simulate import Simulation

from cli_helpers import run_cli
from conftest import TinyTask, wait_exit
from seed_method_checks import LinearTask, assert_run_refused, assert_same_model, late_client, skippers_match

_C = [(1.0, 0.0), (-1.0, -2.0)]  # the gradient is c_i: one SGD step from 0 moves by exactly -lr c_i


def _zo(**kw):
    return load_config(None, algorithm="sketch", task="quadratic", **kw).zo()


# ------------------------------------------------------------------ the update, by hand


@pytest.mark.parametrize("bits, dtype, r1, x2", [
    # client 1's round-1 projections (0.5, -1.5): 1 bit: s = mean |p| = 1, codes (+, -) -> (1, -1);
    # client 0's (0.5, 0.5) stay (0.5, 0.5); mean (0.75, -0.25)
    # x_2 = (0.5, 0.5) - (1/2)(0.75 (1, -1) - 0.25 (1, 1)) = (0.25, 1.0)
    (1, "float32", [[0.75, -0.25]], [[0.25, 1.0]]),
    # the same, the server's mean logged as a scaled sign (scalar_dtype sign): scale mean |.| = 0.5
    # -> (0.5, -0.5); x_2 = (0.5, 0.5) - (1/2)(0.5 (1, -1) - 0.5 (1, 1)) = (0.5, 1.0)
    (1, "sign", [[0.5, -0.5]], [[0.5, 1.0]]),
    # 2 bits (ternary): s = max |p| / 1 = 1.5, codes rint(1/3) = 0 and -1 -> (0, -1.5); mean (0.25, -0.5)
    # x_2 = (0.5, 0.5) - (1/2)(0.25 (1, -1) - 0.5 (1, 1)) = (0.625, 0.875)
    (2, "float32", [[0.25, -0.5]], [[0.625, 0.875]]),
    # 8 bits: a grid's scale is max |p| / 127 rounded *up* to 17 bits, so even equal values move
    # (by < 2^-17 of themselves): worked below with the scales s_a (of 0.5) and s_b (of 1.5)
    (8, "float32", None, None),
])
def test_two_rounds_worked_by_hand(bits, dtype, r1, x2):
    # run seed 0, B = 1, K = 2 (tests/test_ferret.py): round 0's directions are (-1, -1) twice,
    # round 1's (1, -1) and (1, 1)
    zo = _zo(clients=2, sampled=2, lr=0.5, ferret_k=2, ferret_blocks=1, sketch_bits=bits, scalar_dtype=dtype)
    assert zo.shape == (1, 2) and zo.uplink == Codes(bits) and zo.method.resolved_server_lr == 1.0
    sim = Simulation(LinearTask(_C), zo, clients_per_round=2, seed=0, mode="faithful", eval_every=100)
    # round 0: client 0's projections are (-0.5, -0.5), client 1's (1.5, 1.5): equal values are
    # on the 1- and 2-bit grids, so the round is Ferret's: mean 0.5, x_1 = (0.5, 0.5)
    r0, _ = sim.step()
    if bits == 8:
        def up17(v):  # v / 127 in float32, rounded up to 17 significant bits
            u = np.array([np.float32(v) / np.float32(127)], np.float32).view(np.uint32)
            return float(((u + np.uint32(0x7F)) & np.uint32(0xFFFFFF80)).view(np.float32)[0])
        sa, sb = up17(0.5), up17(1.5)
        assert 0.5 < 127 * sa < 0.5 * (1 + 2 ** -16)
        m0 = float(np.float32((127 * sb - 127 * sa) / 2))
        assert r0.scalars.tolist() == [[m0, m0]]
        rec, _ = sim.step()  # client 1's (0.5, -1.5): codes rint(0.5 / s_b) = 42 and -127
        assert rec.scalars.tolist() == [[float(np.float32((127 * sa + 42 * sb) / 2)),
                                         float(np.float32((127 * sa - 127 * sb) / 2))]]
        return
    assert r0.scalars.tolist() == [[0.5, 0.5]] and sim.state.params[0].tolist() == [[0.5, 0.5]]
    rec, _ = sim.step()
    assert rec.scalars.tolist() == r1 and sim.state.params[0].tolist() == x2
    # every client holds x_1 again after its local steps of round 1
    assert all(c.state.params[0].tolist() == [[0.5, 0.5]] for c in sim.clients.values())


def test_the_client_quantises_each_block_with_its_own_scale():
    x = np.array([[0.3, -0.1, 0.0, 0.2], [0.0, 0.0, 0.0, 0.0], [-4.0, 1.0, 2.0, 1.0]], np.float32)
    q = quantize_rows(x, 1)
    s0 = np.float32(0.6 / 4)  # mean |x| in float64, rounded once
    assert q[0].tolist() == [float(s0), -float(s0), -float(s0), float(s0)]  # 0 counts as -1
    assert np.all(q[1] == 0) and q[2].tolist() == [-2.0, 2.0, 2.0, 2.0]
    q4 = quantize_rows(x, 4)  # L = 7: s = 4 / 7 rounded up, so 2 / s is just below 3.5: codes -7, 2, 3, 2
    s2 = q4[2, 0] / -7
    assert q4[2].tolist() == [float(np.float32(c) * s2) for c in (-7, 2, 3, 2)] and s2 >= np.float32(4) / 7


# ------------------------------------------------------------------ the packed bytes, by hand


def test_an_uplink_of_one_bit_codes_byte_for_byte():
    wire = Wire(1, 2, uplink=Codes(1))
    data = encode_uplink(Uplink(1, 1, [[1.0, -1.0]]), wire)
    # version 2, kind 5 (up), flags 0, client 1, round 1, attempt 0; the scale 1.0; codes +, - -> 0b01
    assert data == bytes([2, 5, 0, 1, 1, 0]) + struct.pack("<f", 1.0) + bytes([0x01])
    assert wire.uplink_bytes == 5 and np.array_equal(decode_uplink(data, wire).scalars, [[1.0, -1.0]])
    # with the loss: a float32 after the codes
    with_loss = encode_uplink(Uplink(1, 1, [[1.0, -1.0]], 2.5), wire)
    assert with_loss == bytes([2, 5, 1, 1, 1, 0]) + struct.pack("<f", 1.0) + bytes([0x01]) + struct.pack("<f", 2.5)


def test_four_bit_codes_byte_for_byte():
    x = np.array([[3.5, -1.5, 0.0], [0.0, 0.0, 0.0]], np.float32)  # s = 3.5 / 7 = 0.5: codes 7, -3, 0
    assert np.array_equal(quantize_rows(x, 4), x)
    data = encode_codes(x, 4)
    # scales 0.5 and 0; codes + 7: 14, 4, 7 | 7, 7, 7, two a byte, low nibble first
    assert data == struct.pack("<ff", 0.5, 0.0) + bytes([0x4E, 0x77, 0x77])
    assert len(data) == codes_size(2, 3, 4) == 11
    assert np.array_equal(decode_codes(data, 0, 2, 3, 4), x)


def test_two_bit_codes_and_what_a_decoder_refuses():
    x = np.array([[1.0, 0.0, -1.0, 1.0, 1.0]], np.float32)  # ternary, s = 1: codes + 1 = 2, 1, 0, 2, 2
    data = encode_codes(x, 2)
    assert data == struct.pack("<f", 1.0) + bytes([0b00_01_10 | 0b10 << 6, 0b10])
    assert codes_size(1, 5, 2) == 6 and np.array_equal(decode_codes(data, 0, 1, 5, 2), x)
    with pytest.raises(ValueError, match="invalid 2-bit code"):  # 3 is not a ternary code
        decode_codes(struct.pack("<f", 1.0) + bytes([0xFF, 0x02]), 0, 1, 5, 2)
    with pytest.raises(ValueError, match="pad bits"):
        decode_codes(struct.pack("<f", 1.0) + bytes([0x86, 0x06]), 0, 1, 5, 2)
    with pytest.raises(ValueError, match="negative or not finite"):
        decode_codes(struct.pack("<f", float("nan")) + bytes([0x86, 0x02]), 0, 1, 5, 2)
    with pytest.raises(ValueError, match="not on their 2-bit grid"):  # nothing is rounded on the wire
        encode_codes(np.array([[1.0, 0.4, -1.0, 1.0, 1.0]], np.float32), 2)
    wire = Wire(1, 5, uplink=Codes(2))
    up = encode_uplink(Uplink(0, 3, x), wire)
    with pytest.raises(MessageError, match="truncated or padded"):
        decode_uplink(up[:-1], wire)
    with pytest.raises(MessageError, match="pad bits"):
        decode_uplink(up[:-1] + bytes([0x06]), wire)


def test_a_downlink_of_sign_records_byte_for_byte():
    from hiso.core.history import RoundRecord
    from hiso.core.messages import Downlink, decode_downlink, encode_downlink
    wire = Wire(1, 2, "sign", seed=0)
    recs = tuple(RoundRecord(r, wire.seeds(r), np.array([v], np.float32), (0, 1)) for r, v in
                 enumerate([(0.5, 0.5), (0.5, -0.5)]))
    data = encode_downlink(Downlink(2, wire.seeds(2), 0, recs), wire)
    # version 2, kind 3 (down), round 2, attempt 0, 2 missed, 0 re-planned; then per record the
    # scale 0.5 and one byte of signs (+, + -> 0b11; +, - -> 0b01): 5 bytes a record, float32's 8
    half = struct.pack("<f", 0.5)
    assert data == bytes([2, 3, 2, 0, 2, 0]) + half + bytes([0b11]) + half + bytes([0b01])
    back = decode_downlink(data, wire, expect_since=0)
    assert [r.scalars.tolist() for r in back.missed] == [[[0.5, 0.5]], [[0.5, -0.5]]]
    with pytest.raises(MessageError, match="pad bits"):
        decode_downlink(data[:-1] + bytes([0b101]), wire)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantised_values_survive_the_wire_and_a_second_quantisation(bits):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((3, 37)) * 10.0 ** rng.integers(-6, 6, (3, 1))).astype(np.float32)
    q = quantize_rows(x, bits)
    assert np.array_equal(quantize_rows(q, bits), q)
    data = encode_codes(q, bits)
    assert len(data) == codes_size(3, 37, bits) == 12 + (3 * 37 * bits + 7) // 8
    assert np.array_equal(decode_codes(data, 0, 3, 37, bits), q)


# ------------------------------------------------------------------ replicas and front ends


@pytest.mark.parametrize("bits, dtype", [(1, "float32"), (4, "int8"), (1, "sign"), (2, "int2"), (4, "int4")])
def test_replicas_and_clients_that_skipped_many_rounds_match_bit_for_bit(bits, dtype):
    # int8, int4, int2, sign: the logged sketch is re-quantised once by the server (one scale a
    # record), the same numbers in the log, the downlink and every replica
    skippers_match(_zo(local_steps=2, ferret_k=4, ferret_blocks=3, lr=0.05, sketch_bits=bits, scalar_dtype=dtype))


@pytest.mark.parametrize("dtype", ["int4", "int2", "sign"])
def test_decomfl_with_low_bit_scalars_rebuilds_bit_for_bit(dtype):
    # the zeroth-order arm at few bytes: P scalars a client quantised with one scale an uplink, the
    # server's mean re-quantised once; a client that skipped every round replays the same numbers
    zo = load_config(None, algorithm="decomfl", task="quadratic", perturbations=16, lr=0.01,
                     scalar_dtype=dtype).zo()
    task = TinyTask(num_clients=12)
    sim = Simulation(task, zo, clients_per_round=3, seed=2, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    rows = list(sim.run(30))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    levels = {"int4": 15, "int2": 3, "sign": 2}[dtype]  # distinct values a record can hold
    assert all(len(np.unique(r.scalars)) <= levels for r in sim.server.history)
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, zo).state])
    # an uplink of P = 16 scalars in this dtype: a float32 scale and 16 b-bit codes, nothing rounded
    # on the way (the decoded values are the quantised ones); a damaged scale is refused
    wire = Wire(1, 16, dtype, seed=2)
    g = np.linspace(-1, 1, 16, dtype=np.float32)
    data = encode_uplink(Uplink(3, 7, g.reshape(1, 16)), wire)
    bits = {"int4": 4, "int2": 2, "sign": 1}[dtype]
    assert len(data) == 6 + 4 + 16 * bits // 8
    from hiso.core.scalars import quantize
    assert np.array_equal(decode_uplink(data, wire).scalars.reshape(-1), quantize(g, dtype))
    with pytest.raises(MessageError, match="negative or not finite"):
        decode_uplink(data[:6] + struct.pack("<f", -1.0) + data[10:], wire)


RUN = ["--task", "quadratic", "--dim", "30", "--clients", "5", "--sampled", "2", "--lr", "0.05",
       "--eval-every", "2", "--threads", "1", "--algorithm", "sketch", "--ferret-k", "16", "--ferret-blocks", "2"]


def _model(path):
    return torch.load(path, weights_only=False)


def test_rebuild_and_resume_are_bit_for_bit(tmp_path, capsys):
    full, short = tmp_path / "full", tmp_path / "short"
    for d, rounds in ((full, 6), (short, 3)):
        code, _, err = run_cli(["run", "--quiet", *RUN, "--sketch-bits", "2", "--rounds", str(rounds),
                                "--out", str(d)], capsys)
        assert code == 0, err
    code, _, err = run_cli(["run", "--quiet", "--resume", str(short), "--rounds", "6"], capsys)
    assert code == 0, err
    assert (short / "history.bin").read_bytes() == (full / "history.bin").read_bytes()
    a, b = _model(full / "model.pt"), _model(short / "model.pt")
    assert a["round"] == b["round"] == 6 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    code, _, err = run_cli(["rebuild", str(full), "--out", str(tmp_path / "re.pt")], capsys)
    assert code == 0, err
    assert all(torch.equal(a["model"][k], _model(tmp_path / "re.pt")["model"][k]) for k in a["model"])


def test_the_uplink_bytes_counted_are_the_codes(tmp_path, capsys):
    import json
    d = tmp_path / "r"
    code, _, err = run_cli(["run", "--quiet", "--task", "quadratic", "--dim", "30", "--clients", "2", "--sampled", "2",
                            "--algorithm", "sketch", "--ferret-k", "16", "--ferret-blocks", "2", "--sketch-bits", "2",
                            "--rounds", "3", "--threads", "1", "--out", str(d)], capsys)
    assert code == 0, err
    comm = json.loads((d / "summary.json").read_text())["communication_per_client"]
    # the hello (4 bytes), then 3 uplinks: header 6 (every number < 128), 2 float32 scales,
    # 2 x 16 two-bit codes (8 bytes), the float32 loss; Ferret's would carry 32 float32s (128 bytes)
    assert comm["bytes_up_mean"] == 4 + 3 * (6 + codes_size(2, 16, 2) + 4) == 4 + 3 * 26


def test_a_sketch_run_killed_with_sigkill_resumes_to_the_uninterrupted_run(tmp_path):
    from test_resume import QUAD, _cfg, _kill_after, _spawn, assert_same_run

    from hiso.runners.rundir import run_to_dir
    args = [*QUAD, "--rounds", "16", "--dim", "2000", "--algorithm", "sketch", "--ferret-k", "32",
            "--ferret-blocks", "2", "--sketch-bits", "4", "--lr", "0.02"]
    run_to_dir(_cfg(args), tmp_path / "ref")
    d = tmp_path / "killed"
    p = _spawn(["--out", str(d), *args])
    try:
        _kill_after(p, d, 3)
        p = _spawn(["--resume", str(d)])
        assert wait_exit(p, 300) == 0, p.stderr.read().decode()[-1000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert_same_run(tmp_path / "ref", d)


def test_the_flower_serverapp_runs_it_as_the_simulator_does(tmp_path, monkeypatch):
    from seed_method_checks import assert_serverapp_runs_it_as_the_simulator
    assert_serverapp_runs_it_as_the_simulator({"algorithm": "sketch", "ferret_k": 8, "ferret_blocks": 2, "sketch_bits": 1},
                                             tmp_path, monkeypatch)


@pytest.mark.parametrize("flags, msg", [
    (["--sketch-bits", "3"], "bits must be one of 1, 2, 4, 8"),
    (["--dp-clip", "1", "--dp-noise-multiplier", "1"], "differential privacy is for"),
    (["--algorithm", "feedsign", "--scalar-dtype", "sign"], "scalar_dtype sign is for hiso, decomfl, sketch, fedkrso and conmezo, not feedsign"),
    (["--algorithm", "decomfl", "--scalar-dtype", "int4", "--secagg"], "secure aggregation sums answers"),
])
def test_bad_settings_fail_with_one_line(tmp_path, capsys, flags, msg):
    args = ["--task", "quadratic", "--algorithm", "sketch", *flags]
    assert_run_refused(tmp_path, capsys, args, msg)
