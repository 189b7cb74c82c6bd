"""Encoding round-trips, byte accounting, and clean failure on bad messages."""

import numpy as np
import pytest
import torch

from hiso.core import (Client, Downlink, MessageError, ModelState, RoundRecord, Uplink, decode_downlink,
                       decode_uplink, decomfl, encode_downlink, encode_uplink, hiso)
from hiso.core.messages import downlink_size, uplink_size
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def _records(n, tau=2, P=3, start=0):
    rng = np.random.default_rng(0)
    return tuple(RoundRecord(start + i, rng.integers(0, 2**63, (tau, P), dtype=np.uint64),
                             rng.standard_normal((tau, P)).astype(np.float32)) for i in range(n))


def test_roundtrip_and_sizes():
    seeds = np.array([[1, 2**64 - 1, 3], [4, 5, 6]], dtype=np.uint64)
    msg = Downlink(7, seeds, 3, _records(4, start=3))
    data = encode_downlink(msg)
    assert len(data) == downlink_size(2, 3, 4)
    back = decode_downlink(data)
    assert back.round == 7 and back.since == 3 and np.array_equal(back.seeds, seeds)
    for a, b in zip(back.missed, msg.missed):
        assert a.round == b.round and np.array_equal(a.seeds, b.seeds) and np.array_equal(a.scalars, b.scalars)
    up = Uplink(5, 7, np.arange(6, dtype=np.float32).reshape(2, 3), loss=0.25)
    data = encode_uplink(up)
    assert len(data) == uplink_size(2, 3)
    back = decode_uplink(data, expect_round=7)
    assert back.client == 5 and back.loss == 0.25 and np.array_equal(back.scalars, up.scalars)
    assert len(encode_uplink(Uplink(5, 7, up.scalars))) == uplink_size(2, 3, with_loss=False)


@pytest.mark.parametrize("damage", ["truncate", "pad", "magic", "version", "kind", "history_count"])
def test_malformed_downlink_raises_and_changes_nothing(damage):
    task = TinyTask()
    zo = hiso(lr=0.02, perturbations=3, local_steps=2)
    sim = Simulation(task, zo, clients_per_round=3, seed=0, batch_size=8)
    for _ in range(5):
        sim.step()
    client = Client(0, ModelState(task.build_model(), zo), task.loss, lambda r, k: task.batch(0, r, k, 8))
    data = bytearray(encode_downlink(Downlink(5, np.ones(zo.shape, np.uint64), 0, tuple(sim.server.history))))
    if damage == "truncate":
        data = data[:-1]
    elif damage == "pad":
        data += b"\0"
    elif damage == "magic":
        data[0:2] = b"XX"
    elif damage == "version":
        data[2] = 99
    elif damage == "kind":
        data[3] = 2
    elif damage == "history_count":
        data[16:20] = (4).to_bytes(4, "little")  # n_missed field
    before = [p.clone() for p in client.state.params]
    with pytest.raises(MessageError):
        client.handle(bytes(data))
    assert client.state.round == 0
    assert all(torch.equal(a, b) for a, b in zip(before, client.state.params))
    assert all(torch.equal(h, torch.ones_like(h)) for h in client.state.h)


def test_wrong_round_and_wrong_history_start_are_rejected():
    zo = decomfl(lr=0.02, perturbations=3, local_steps=2)
    data = encode_downlink(Downlink(3, np.ones(zo.shape, np.uint64), 1, _records(2, start=1)))
    with pytest.raises(MessageError, match="holds round 0"):
        decode_downlink(data, expect_since=0)
    with pytest.raises(MessageError, match=r"\(tau, P\)"):
        decode_downlink(data, expect_shape=(1, 5))
    up = encode_uplink(Uplink(1, 4, np.zeros(zo.shape, np.float32)))
    with pytest.raises(MessageError, match="round 4"):
        decode_uplink(up, expect_round=5)
    nan = encode_uplink(Uplink(1, 4, np.full(zo.shape, np.nan, np.float32)))
    with pytest.raises(MessageError, match="non-finite"):
        decode_uplink(nan)
    with pytest.raises(MessageError, match="magic"):
        decode_uplink(b"not a message at all")
    with pytest.raises(MessageError, match="truncated"):
        decode_uplink(up[:10])


def test_server_rejects_incomplete_or_foreign_uplinks_without_changing_state():
    sim = Simulation(TinyTask(), decomfl(lr=0.02, perturbations=2), clients_per_round=3, seed=0)
    plan = sim.server.plan()
    ups = [Uplink(c, plan.round, np.zeros((1, 2), np.float32)) for c in plan.participants]
    outsider = next(c for c in range(20) if c not in plan.participants)
    for bad in (ups[:-1], ups + ups[:1], ups[:-1] + [Uplink(outsider, 0, np.zeros((1, 2), np.float32))]):
        with pytest.raises(MessageError):
            sim.server.aggregate(bad)
        assert sim.server.round == 0
    rec = sim.server.aggregate(ups)
    assert rec.round == 0 and sim.server.round == 1


def test_byte_counts_equal_encoded_sizes_and_closed_form():
    """All clients sampled every round: round 0 carries no history, later rounds one record each."""
    M, R, tau, P = 4, 12, 2, 3
    sim = Simulation(TinyTask(num_clients=M), decomfl(lr=0.02, perturbations=P, local_steps=tau),
                     clients_per_round=M, seed=0, batch_size=8)
    rows = list(sim.run(R))
    n = tau * P
    down = R * downlink_size(tau, P, 0) + (R - 1) * 12 * n
    up = R * uplink_size(tau, P)
    assert np.all(sim.comm.down == down) and np.all(sim.comm.up == up)
    assert down == R * (20 + 8 * n) + (R - 1) * 12 * n and up == R * (17 + 4 * n + 4)
    assert rows[-1]["bytes_down"] == M * down and rows[-1]["bytes_up"] == M * up


def test_byte_counts_follow_the_messages_under_partial_participation():
    sim = Simulation(TinyTask(), decomfl(lr=0.02, perturbations=5), clients_per_round=2, seed=4)
    expect_down, expect_up = np.zeros(20, np.int64), np.zeros(20, np.int64)
    for _ in range(40):
        plan_round = sim.server.round
        synced = sim.server.synced.copy()
        rec, _ = sim.step()
        for c in rec.participants:
            expect_down[c] += downlink_size(1, 5, plan_round - synced[c])
            expect_up[c] += uplink_size(1, 5)
    assert np.array_equal(sim.comm.down, expect_down) and np.array_equal(sim.comm.up, expect_up)
