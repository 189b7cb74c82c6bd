"""int8 scalars (hiso.core.scalars): one float32 scale and one int8 code per scalar, per message
and per history record; exact by construction (every replica applies the decoded values)."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from hiso.core.messages import (Downlink, Uplink, Wire, decode_downlink, decode_uplink, encode_downlink,
                                encode_uplink)
from hiso.core.scalars import decode_scalars, encode_scalars, quantize
from hiso.core.server import Server


def test_codec_worked_example_exact_scale():
    """max |x| = 127 / 128: scale 1/128 = 2^-7 exactly; codes 127, -64 (-0.5 * 128), 1 (0.01 * 128 = 1.28)."""
    x = np.array([0.9921875, -0.5, 0.01], np.float32)
    data = encode_scalars(x, "int8")
    assert data == bytes.fromhex("0000003c") + bytes([127, 256 - 64, 1])  # float32 2^-7 is 0x3C000000
    assert decode_scalars(data, 0, 3, "int8").tolist() == [0.9921875, -0.5, 0.0078125]


def test_codec_worked_example_scale_rounded_up_to_17_bits():
    """max |x| = 1: 1/127 lies in [2^-7, 2^-6), so 17 significant bits are multiples of 2^-23:
    s = ceil(2^23 / 127) 2^-23 = 66053 / 2^23; -0.3 / s = -38.099 -> -38."""
    x = np.array([1.0, -0.3, 0.0], np.float32)
    data = encode_scalars(x, "int8")
    s = Fraction(66053, 2**23)
    assert Fraction(float(np.frombuffer(data[:4], "<f4")[0])) == s
    assert list(np.frombuffer(data[4:], np.int8)) == [127, -38, 0]
    got = decode_scalars(data, 0, 3, "int8")
    assert [Fraction(float(v)) for v in got] == [127 * s, -38 * s, 0]  # exact products


def test_reencoding_is_the_identity_and_error_is_half_a_step():
    rng = np.random.default_rng(0)
    for t in range(2000):
        x = (rng.standard_normal(rng.integers(1, 40)) * 10.0 ** rng.uniform(-25, 25)).astype(np.float32)
        data = encode_scalars(x, "int8")
        q = decode_scalars(data, 0, x.size, "int8")
        assert encode_scalars(q, "int8") == data
        s = float(np.frombuffer(data[:4], "<f4")[0])
        assert np.max(np.abs(q.astype(np.float64) - x)) <= s / 2
    assert encode_scalars(np.zeros(3, np.float32), "int8") == bytes(7)
    assert encode_scalars(np.array([1e-35, -3e-38], np.float32), "int8") == bytes(6)  # below 2^-100: zeros
    with pytest.raises(FloatingPointError):
        encode_scalars(np.array([1.0, np.inf], np.float32), "int8")
    bad = encode_scalars(np.array([1.0, np.nan], np.float32), "int8", check=False)  # an attacker's bytes
    assert not np.isfinite(decode_scalars(bad, 0, 2, "int8")).any()


def test_bytes_per_message():
    """Uplink: header, 4 B scale + tau*P codes, bfloat16 loss. A history record: 4 + tau*P bytes,
    so int8 P = 16 costs float32 P = 5's 20 B per record; P = 20 costs 24 B."""
    for P in (5, 16, 20):
        w8, w32 = Wire(1, P, "int8", seed=3), Wire(1, 5, "float32", seed=3)
        up = Uplink(2, 9, quantize(np.linspace(-1, 1, P).reshape(1, P), "int8"), loss=0.5)
        data = encode_uplink(up, w8)
        assert len(data) == 6 + 4 + P + 2  # version kind flags client round attempt; scale codes; loss
        assert len(encode_uplink(Uplink(2, 9, up.scalars), w8)) == 6 + 4 + P
        back = decode_uplink(data, w8)
        assert np.array_equal(back.scalars, up.scalars) and back.loss == 0.5
        assert w8.record_bytes == 4 + P and w32.record_bytes == 20
    assert Wire(1, 16, "int8").record_bytes == Wire(1, 5).record_bytes
    f32 = len(encode_uplink(Uplink(2, 9, np.zeros((1, 5)), loss=0.5), Wire(1, 5)))
    assert len(encode_uplink(Uplink(2, 9, np.zeros((1, 16)), loss=0.5), Wire(1, 16, "int8"))) < f32


def test_each_history_record_keeps_its_own_scale_on_the_wire():
    wire = Wire(2, 3, "int8", seed=5)
    srv = Server(6, 2, 2, 3, seed=5, scalar_dtype="int8")
    rng = np.random.default_rng(1)
    for r in range(4):
        plan = srv.plan()
        ups = [Uplink(c, plan.round, quantize(rng.standard_normal((2, 3)) * 10.0 ** r, "int8"))
               for c in plan.participants]
        rec = srv.aggregate(ups)
        mean = np.mean(np.stack([u.scalars.astype(np.float64) for u in ups]), axis=0).astype(np.float32)
        assert np.array_equal(rec.scalars, quantize(mean, "int8"))
    msg = Downlink(4, wire.seeds(4), 0, tuple(srv.history))
    data = encode_downlink(msg, wire)
    assert len(data) == 6 + 4 * (4 + 6)
    back = decode_downlink(data, wire)
    for a, b in zip(back.missed, srv.history):  # scales 1 .. 1000 apart, each record exact
        assert np.array_equal(a.scalars, b.scalars)


def test_run_rebuilds_bit_for_bit_with_late_clients(tmp_path):
    from hiso.config import load_config
    from hiso.core.history import parse_history
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="quadratic", dim=40, clients=8, sampled=2, rounds=30, eval_every=30, perturbations=4,
                      scalar_dtype="int8", mode="faithful", threads=1)
    run_to_dir(cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["scalar_dtype"] == "int8"
    log = parse_history(tmp_path / "history.bin")
    assert log.scalar_dtype == "int8" and len(log.records) == 30
    assert all(np.array_equal(quantize(r.scalars, "int8"), r.scalars) for r in log.records)
    # header 36 B (name "philox-rademacher"); a record: round, attempt, n, 2 clients, scale, 4 codes, CRC
    assert (tmp_path / "history.bin").stat().st_size == 36 + 30 * (5 + 4 + 4 + 4)
    state, _ = rebuild(tmp_path)
    saved = torch.load(tmp_path / "model.pt")
    assert state.round == 30 and all(torch.equal(p, saved["model"][n]) for n, p in state.named)
    assert all(torch.equal(h, saved["h"][n]) for (n, _), h in zip(state.named, state.h))


def test_faithful_clients_match_the_server_and_differ_from_float32():
    from conftest import TinyTask
    from hiso.methods.hiso_method import decomfl
    from hiso.runners.simulate import Simulation
    runs = {}
    for dtype in ("int8", "float32"):
        sim = Simulation(TinyTask(num_clients=12), decomfl(lr=0.02, perturbations=4, scalar_dtype=dtype),
                         clients_per_round=3, seed=2, batch_size=8, mode="faithful", eval_every=1000,
                         snapshot_after=10**6)
        list(sim.run(25))
        sim.sync_all()
        for c in sim.clients.values():
            assert all(torch.equal(a, b) for a, b in zip(c.state.params, sim.state.params))
        runs[dtype] = sim
    assert not all(torch.equal(a, b) for a, b in zip(runs["int8"].state.params, runs["float32"].state.params))


def test_int8_only_for_hiso_and_decomfl():
    from hiso.config import ConfigError, load_config
    load_config(None, task="quadratic", algorithm="decomfl", scalar_dtype="int8")
    for algo in ("fedkseed", "feedsign", "ferret"):
        with pytest.raises(ConfigError, match="int8 is for hiso, decomfl, sketch, fedkrso, greedy and conmezo"):
            load_config(None, task="quadratic", algorithm=algo, scalar_dtype="int8")
    with pytest.raises(ConfigError, match="scalar_dtype"):
        load_config(None, task="quadratic", scalar_dtype="int3")  # (int4, int2 and sign are low-bit formats)
