"""Protocol v2: encoding round-trips, derived seeds, scalar dtypes, byte accounting, joins,
snapshots, and clean failure on bad messages."""

import numpy as np
import pytest
import torch

from hiso.core import (Client, Downlink, JoinError, MessageError, ModelState, RoundRecord, Server, Uplink,
                       Wire, decode_downlink, decode_uplink, encode_downlink, encode_uplink)
from hiso.methods.hiso_method import decomfl, hiso
from hiso.core.messages import (Hello, decode_hello, decode_welcome, encode_hello, encode_state, encode_welcome,
                                get_varint, put_varint, quantize, state_size, varint_size, welcome_for)
from hiso.core.seeds import mix64, round_seeds, seeds_of
from hiso.runners.simulate import Simulation, protocol_traffic

from hiso.tasks.quadratic import QuadraticTask

from conftest import TinyTask


def _records(wire, n, start=0, attempts=None):
    rng = np.random.default_rng(0)
    attempts = attempts or [0] * n
    return tuple(RoundRecord(start + i, wire.seeds(start + i, attempts[i]),
                             quantize(rng.standard_normal(wire.shape), wire.dtype), (), attempts[i]) for i in range(n))


# ------------------------------------------------------------------------------ seeds


@pytest.mark.slow
def test_seeds_are_the_published_mix_and_never_collide_over_ten_million_draws():
    # the reference definition, in Python integers
    key = mix64(7 ^ 0x6869736F2D736565)
    want = [[mix64((3 << 28 | 2 << 16 | (k * 5 + p)) ^ key) for p in range(5)] for k in range(2)]
    assert round_seeds(7, 3, 2, 2, 5).tolist() == want
    # 10^7 draws: 2,000,000 rounds x 5 (tau = 1, P = 5), attempts 0 and 1 interleaved
    rounds = np.arange(1_000_000)
    s = np.concatenate([seeds_of(0, rounds, np.zeros_like(rounds), 1, 5).ravel(),
                        seeds_of(0, rounds, np.ones_like(rounds), 1, 5).ravel()])
    s.sort()
    assert s.size == 10**7 and bool(np.all(s[1:] != s[:-1]))
    assert not np.array_equal(round_seeds(0, 0, 0, 1, 5), round_seeds(1, 0, 0, 1, 5))  # depends on the run seed
    with pytest.raises(ValueError):
        round_seeds(0, 2**36, 0, 1, 5)


def test_a_replanned_round_gets_fresh_seeds_and_its_attempt_travels_in_two_bytes():
    srv = Server(4, 2, 1, 3, seed=9)
    first = srv.plan()
    assert srv.aggregate([], partial=True) is None  # nobody answered: planned again
    again = srv.plan()
    assert again.round == first.round and again.attempt == 1
    assert not set(again.seeds.ravel().tolist()) & set(first.seeds.ravel().tolist())
    srv.aggregate([Uplink(c, again.round, np.ones((1, 3)), attempt=1) for c in again.participants])
    for _ in range(3):
        p = srv.plan()
        srv.aggregate([Uplink(c, p.round, np.ones((1, 3))) for c in p.participants])
    down = Downlink(4, srv.wire.seeds(4), 0, tuple(srv.history), 0)
    plain = Downlink(4, srv.wire.seeds(4), 0, tuple(RoundRecord(r.round, srv.wire.seeds(r.round), r.scalars)
                                                     for r in srv.history), 0)
    assert len(encode_downlink(down, srv.wire)) == len(encode_downlink(plain, srv.wire)) + 2  # (j, attempt)
    back = decode_downlink(encode_downlink(down, srv.wire), srv.wire)
    assert [r.attempt for r in back.missed] == [1, 0, 0, 0]
    assert all(np.array_equal(a.seeds, b.seeds) for a, b in zip(back.missed, srv.history))
    # an answer to the abandoned plan is not mixed into the new one
    p = srv.plan()
    srv.aggregate([], partial=True)
    p2 = srv.plan()
    rec = srv.aggregate([Uplink(c, p.round, np.ones((1, 3)), attempt=0) for c in p.participants]
                        + [Uplink(c, p2.round, np.ones((1, 3)), attempt=1) for c in p2.participants[:1]], partial=True)
    assert rec.participants == p2.participants[:1] and any("abandoned" in w for w in srv.rejected)


# ------------------------------------------------------------------------------ framing


def test_varints_are_canonical_and_bounded():
    for v in (0, 1, 127, 128, 300, 2**36, 2**64 - 1):
        out = bytearray()
        put_varint(out, v)
        assert len(out) == varint_size(v) and get_varint(bytes(out), 0, "x") == (v, len(out))
    for bad in (b"\x80", b"\x81\x00", b"\xff" * 11):
        with pytest.raises(MessageError):
            get_varint(bad, 0, "x")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_roundtrip_and_sizes(dtype):
    wire = Wire(2, 3, dtype, seed=11)
    recs = _records(wire, 4, start=3)
    msg = Downlink(7, wire.seeds(7), 3, recs)
    data = encode_downlink(msg, wire)
    sb = wire.scalar_bytes
    assert len(data) == 2 + 1 + 1 + 1 + 1 + 4 * 6 * sb  # version kind round attempt n n_retried, scalars
    back = decode_downlink(data, wire)
    assert back.round == 7 and back.since == 3 and np.array_equal(back.seeds, wire.seeds(7))
    for a, b in zip(back.missed, msg.missed):
        assert a.round == b.round and np.array_equal(a.seeds, b.seeds) and np.array_equal(a.scalars, b.scalars)
    up = Uplink(5, 300, quantize(np.arange(6).reshape(2, 3) / 7, dtype), loss=0.25, attempt=1)
    data = encode_uplink(up, wire)
    assert len(data) == 2 + 1 + 1 + 2 + 1 + 6 * sb + sb  # version kind flags client round(2) attempt
    back = decode_uplink(data, wire, expect_round=300)
    assert back.client == 5 and back.loss == 0.25 and back.attempt == 1 and np.array_equal(back.scalars, up.scalars)
    assert len(encode_uplink(Uplink(5, 300, up.scalars), wire)) == len(data) - sb
    h = encode_hello(Hello(3, 129))
    assert len(h) == 5 and decode_hello(h) == Hello(3, 129)


def test_scalar_dtypes_round_like_torch_and_overflow_is_refused():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    assert np.array_equal(quantize(x, "float16"), torch.from_numpy(x).half().float().numpy())
    assert np.array_equal(quantize(x, "bfloat16"), torch.from_numpy(x).bfloat16().float().numpy())
    assert np.array_equal(quantize(x, "float32"), x)
    with pytest.raises(FloatingPointError, match="float16"):
        encode_uplink(Uplink(0, 0, np.array([[7e4]])), Wire(1, 1, "float16"))
    encode_uplink(Uplink(0, 0, np.array([[7e4]])), Wire(1, 1, "bfloat16"))  # bfloat16 has float32's range


def test_the_server_logs_the_encoded_aggregate():
    srv = Server(4, 3, 1, 2, seed=0, scalar_dtype="float16")
    plan = srv.plan()
    ups = [Uplink(c, plan.round, quantize(np.array([[0.1 * c, 1 / 3 + c]]), "float16")) for c in plan.participants]
    rec = srv.aggregate(ups)
    mean = np.mean(np.stack([u.scalars.astype(np.float64) for u in ups]), axis=0)
    assert np.array_equal(rec.scalars, quantize(mean, "float16"))  # the mean, as the wire carries it
    assert np.array_equal(quantize(rec.scalars, "float16"), rec.scalars)


def _client(task, zo, wire):
    return Client(0, ModelState(task.build_model(), zo), task.loss, lambda r, k: task.batch(0, r, k, 8), wire=wire)


@pytest.mark.parametrize("damage", ["truncate", "pad", "version", "v1", "kind", "history_count", "noncanonical",
                                    "retried"])
def test_malformed_downlink_raises_and_changes_nothing(damage):
    task = TinyTask()
    zo = hiso(lr=0.02, perturbations=3, local_steps=2)
    sim = Simulation(task, zo, clients_per_round=3, seed=0, batch_size=8, snapshot_after=1000)
    for _ in range(5):
        sim.step()
    wire = sim.server.wire
    client = _client(task, zo, wire)
    data = bytearray(encode_downlink(Downlink(5, wire.seeds(5), 0, tuple(sim.server.history)), wire))
    assert decode_downlink(bytes(data), wire).round == 5
    if damage == "truncate":
        data = data[:-1]
    elif damage == "pad":
        data += b"\0"
    elif damage == "version":
        data[0] = 99
    elif damage == "v1":
        data[0:2] = b"HS"
    elif damage == "kind":
        data[1] = 5
    elif damage == "history_count":
        data[4] = 4  # n_missed
    elif damage == "noncanonical":
        data[2:3] = b"\x85\x00"  # round 5 in two bytes
    elif damage == "retried":
        data[5] = 9  # more re-planned records than records
    before = [p.clone() for p in client.state.params]
    with pytest.raises(MessageError):
        client.handle(bytes(data))
    assert client.state.round == 0
    assert all(torch.equal(a, b) for a, b in zip(before, client.state.params))
    assert all(torch.equal(h, torch.ones_like(h)) for h in client.state.h)


def test_wrong_round_and_wrong_history_start_are_rejected():
    zo = decomfl(lr=0.02, perturbations=3, local_steps=2)
    wire = Wire(*zo.shape)
    data = encode_downlink(Downlink(3, wire.seeds(3), 1, _records(wire, 2, start=1)), wire)
    with pytest.raises(MessageError, match="holds round 0"):
        decode_downlink(data, wire, expect_since=0)
    with pytest.raises(MessageError):  # another (tau, P): the lengths do not add up
        decode_downlink(data, Wire(1, 5))
    with pytest.raises(ValueError, match="derived"):  # seeds the receiver would not derive
        encode_downlink(Downlink(3, np.ones(zo.shape, np.uint64), 3), wire)
    up = encode_uplink(Uplink(1, 4, np.zeros(zo.shape)), wire)
    with pytest.raises(MessageError, match="round 4"):
        decode_uplink(up, wire, expect_round=5)
    nan = up[:6] + np.full(6, np.nan, "<f4").tobytes()  # a sender that sends NaN anyway
    with pytest.raises(MessageError, match="non-finite"):
        decode_uplink(nan, wire)
    with pytest.raises(FloatingPointError):  # ours refuses to
        encode_uplink(Uplink(1, 4, np.full(zo.shape, np.nan)), wire)
    with pytest.raises(MessageError, match="version 1"):
        decode_uplink(b"HS not a message at all", wire)
    with pytest.raises(MessageError, match="truncated"):
        decode_uplink(up[:10], wire)


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


# ------------------------------------------------------------------------------ joins


def test_join_refuses_another_configuration_or_initial_model_before_anything_changes():
    task = TinyTask()
    zo = hiso(lr=0.02, perturbations=3)
    server_state = ModelState(task.build_model(), zo)
    welcome = encode_welcome(welcome_for(zo, 42, server_state.params))
    assert len(welcome) == 2 + 8 + 16 + 16
    c = Client(1, ModelState(task.build_model(), zo), task.loss, None)
    wire = c.join(welcome)
    assert wire == Wire(1, 3, "float32", 42) and decode_welcome(welcome).seed == 42
    assert decode_hello(c.hello()) == Hello(1, 0)
    for other in (hiso(lr=0.03, perturbations=3), decomfl(lr=0.02, perturbations=3),
                  hiso(lr=0.02, perturbations=3, scalar_dtype="float16"), hiso(lr=0.02, perturbations=3, mu=2e-3),
                  hiso(lr=0.02, perturbations=3, difference="central")):
        bad = Client(1, ModelState(task.build_model(), other), task.loss, None)
        with pytest.raises(JoinError, match="another algorithm configuration"):
            bad.join(welcome)
        assert bad.wire is None
    shifted = ModelState(task.build_model(), zo)
    with torch.no_grad():
        shifted.params[0][0, 0] += 1e-7
    with pytest.raises(JoinError, match="initial model differs"):
        Client(1, shifted, task.loss, None).join(welcome)
    with pytest.raises(MessageError, match="not joined"):
        Client(1, ModelState(task.build_model(), zo), task.loss, None).handle(b"\x02\x03\x00\x00\x00\x00")


def test_the_config_fingerprint_covers_fields_added_later():
    import dataclasses
    from hiso.core.messages import config_fingerprint
    zo = hiso(lr=0.02)
    Extended = dataclasses.make_dataclass("Extended", [("variant", str, dataclasses.field(default="x"))],
                                          bases=(type(zo),), frozen=True)
    a, b = (Extended(**dataclasses.asdict(zo) | {"method": zo.method, "variant": v}) for v in ("x", "y"))
    assert config_fingerprint(a) != config_fingerprint(b)


# ------------------------------------------------------------------------------ bytes


def test_byte_counts_equal_encoded_sizes_and_closed_form():
    """All clients sampled every round: round 0 carries no history, later rounds one record each."""
    M, R, tau, P = 4, 12, 2, 3
    sim = Simulation(TinyTask(num_clients=M), decomfl(lr=0.02, perturbations=P, local_steps=tau),
                     clients_per_round=M, seed=0, batch_size=8)
    rows = list(sim.run(R))
    n = tau * P
    down = 42 + R * 6 + (R - 1) * 4 * n  # welcome; version kind round attempt n n_retried; the missed record
    up = 4 + R * (6 + 4 * n + 4)  # hello; version kind flags client round attempt, scalars, loss
    assert np.all(sim.comm.down == down) and np.all(sim.comm.up == up)
    assert rows[-1]["bytes_down"] == M * down and rows[-1]["bytes_up"] == M * up


def test_simulated_bytes_are_the_schedules_bytes():
    """A run counts exactly what the model-free schedule count gives (snapshots included)."""
    zo = hiso(lr=0.02, perturbations=5, scalar_dtype="float16")
    sim = Simulation(TinyTask(num_clients=10), zo, clients_per_round=2, seed=4, snapshot_after=5)
    for _ in range(60):
        sim.step()
    values = state_size(sim.state) // 4
    comm = protocol_traffic(10, 2, 1, 5, 60, scalar_dtype="float16", seed=4, state_values=values, snapshot_after=5)
    assert np.array_equal(sim.comm.down, comm.down)
    assert np.array_equal(sim.comm.up, comm.up)


@pytest.mark.parametrize("dtype, bound", [("float32", 21_560), ("float16", 10_800)])
def test_the_papers_schedule_costs_less_than_the_paper_says(dtype, bound):
    """DeComFL, OPT-350M SST-2: 6 clients, 2 per round, P = 5, tau = 1, 550 rounds; the paper
    counts 21.56 KB per client. Every byte counted: join, headers, downlinks with the history,
    uplinks with their loss (the model, 331M parameters, is never worth a snapshot)."""
    means = [protocol_traffic(6, 2, 1, 5, 550, scalar_dtype=dtype, seed=s).summary()["bytes_total_mean"]
             for s in range(3)]
    assert max(means) <= bound, means


# ------------------------------------------------------------------------------ snapshots


@pytest.mark.slow
def test_a_client_absent_for_5000_rounds_costs_at_most_a_snapshot_and_lands_bit_identical():
    task = QuadraticTask(2, seed=0, dim=64)
    zo = hiso(lr=1e-3, perturbations=1, scalar_dtype="float16")
    replica = ModelState(task.build_model(), zo)
    server = Server(2, 2, 1, 1, seed=3, scalar_dtype="float16", replica=replica)
    welcome = encode_welcome(welcome_for(zo, 3, replica.params))
    K = server.snapshot_after
    assert 0 < K < 5000
    rng = np.random.default_rng(0)
    for r in range(5000):  # client 1 is unreachable; client 0's answers move the model
        plan = server.plan()
        rec = server.aggregate([Uplink(0, r, quantize(rng.standard_normal((1, 1)), "float16"))], partial=True)
        replica.apply(rec)
    assert len(server.history) == K and server.first == 5000 - K  # only the last K records are kept
    late = Client(1, ModelState(task.build_model(), zo), task.loss, lambda r, k: task.batch(1, r, k, 8))
    late.join(welcome)
    plan = server.plan()
    down = encode_downlink(server.downlink(1), server.wire)
    history_bytes = 6 + 5000 * 2  # what the history would have cost (2 bytes a round)
    assert len(down) == server.snapshot_bytes() == 2 + 2 + 1 + state_size(replica) < history_bytes
    late.handle(down)
    assert late.state.round == 5000
    assert all(torch.equal(a, b) for a, b in zip(late.state.params, replica.params))
    assert all(torch.equal(a, b) for a, b in zip(late.state.h, replica.h))
    assert not torch.equal(replica.params[0], ModelState(task.build_model(), zo).params[0])  # it did move


def test_a_bad_snapshot_is_refused_before_anything_changes():
    task = TinyTask()
    zo = decomfl(lr=0.02, perturbations=2)
    src = ModelState(task.build_model(), zo)
    payload = encode_state(src)
    wire = Wire(1, 2)
    c = _client(task, zo, wire)
    before = [p.clone() for p in c.state.params]
    for bad in (payload[:-4], payload + b"\0\0\0\0",
                payload[:-4] + np.array([np.nan], "<f4").tobytes()):
        data = encode_downlink(Downlink(9, wire.seeds(9), 9, (), 0, bad), wire)
        with pytest.raises(MessageError):
            c.handle(data)
        assert c.state.round == 0 and all(torch.equal(a, b) for a, b in zip(before, c.state.params))


@pytest.mark.parametrize("K", [0, 3])
def test_faithful_clients_stay_bit_identical_with_snapshots(K):
    zo = hiso(lr=0.02, perturbations=3, local_steps=2, scalar_dtype="bfloat16")
    sim = Simulation(TinyTask(), zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", snapshot_after=K)
    fast = Simulation(TinyTask(), zo, clients_per_round=3, seed=1, batch_size=8, snapshot_after=K)
    for _ in range(15):
        a, _ = sim.step()
        b, _ = fast.step()
        assert np.array_equal(a.scalars, b.scalars)
    assert np.array_equal(sim.comm.down, fast.comm.down)
    assert len(sim.server.history) == K
    sim.sync_all()
    for c in sim.clients.values():
        assert all(torch.equal(x, y) for x, y in zip(c.state.params, sim.state.params))
        assert all(torch.equal(x, y) for x, y in zip(c.state.h, sim.state.h))


def test_a_flower_node_checks_the_welcome_before_it_joins(tmp_path):
    """The Flower ClientApp's join (no flwr needed): a matching welcome is kept and answered
    with a hello; another configuration's is refused in one clear error."""
    from hiso.config import RunConfig
    from hiso.flower.app import query_fields
    from hiso.tasks.registry import build_task
    cfg = RunConfig(task="quadratic", dim=8, clients=2, sampled=1, rounds=3)
    x0 = ModelState(build_task(cfg).build_model(), cfg.zo())
    good = encode_welcome(welcome_for(cfg.zo(), cfg.seed, x0.params))
    f = query_fields(cfg, 1, 1, str(tmp_path), welcome=good)
    assert decode_hello(f["hello"]) == Hello(1, 0)
    other = RunConfig(task="quadratic", dim=8, clients=2, sampled=1, rounds=3, scalar_dtype="float16")
    with pytest.raises(JoinError, match="another algorithm configuration"):
        query_fields(cfg, 1, 1, str(tmp_path), welcome=encode_welcome(welcome_for(other.zo(), cfg.seed, x0.params)))


def test_automatic_snapshot_point_is_where_a_snapshot_gets_cheaper():
    from hiso.core.server import auto_snapshot_after
    assert auto_snapshot_after(1000, 20) == 50  # bytes: 50 records weigh a snapshot
    # at 1 MB/s a round's replay of 1 ms weighs 1000 bytes more: snapshots come much sooner
    assert auto_snapshot_after(1000, 20, bandwidth=1e6, replay_s=1e-3) == 0
    assert auto_snapshot_after(10**6, 20, bandwidth=1e6, replay_s=1e-3) == 980
    task = TinyTask()
    zo = hiso(lr=0.02, perturbations=5, scalar_dtype="float16")
    rep = ModelState(task.build_model(), zo)
    srv = Server(20, 3, 1, 5, scalar_dtype="float16", replica=rep)
    assert srv.snapshot_after == srv.snapshot_bytes() // 10  # 5 float16 scalars a missed round
    fast = Server(20, 3, 1, 5, scalar_dtype="float16", replica=rep, bandwidth=1e7)  # a fast link: replay dominates
    assert fast.snapshot_after < srv.snapshot_after


def test_header_errors_of_both_message_families():
    """The protocol's varint header and the full-model baselines' fixed one share their checks
    (hiso.core.messages.check_head): same wording, each naming its own family and kinds."""
    from hiso.baselines import messages as fm
    from hiso.core.messages import VERSION, encode_hello
    hello = encode_hello(Hello(3, 0))
    with pytest.raises(MessageError, match=r"^hello: expected bytes, got str$"):
        decode_hello("no")
    with pytest.raises(MessageError, match=rf"^hello: protocol version 99 not supported \(this is version {VERSION}\)$"):
        decode_hello(bytes([99]))  # refused before the kind is read
    with pytest.raises(MessageError, match=r"^uplink.*: message kind 1 \(hello\) is not a uplink"):
        decode_uplink(hello, Wire(1, 1))
    down = fm.encode_downlink(fm.FullDownlink(0, torch.zeros(3)))
    with pytest.raises(MessageError, match=r"^full-model uplink: expected bytes, got list$"):
        fm.decode_uplink([1])
    bad = bytearray(down)
    bad[2] = 7
    with pytest.raises(MessageError, match=r"^full-model downlink: format version 7 not supported \(this is version 1\)$"):
        fm.decode_downlink(bytes(bad))
    with pytest.raises(MessageError, match=r"^full-model uplink: message kind 1 is not a full-model uplink$"):
        fm.decode_uplink(down + bytes(fm._UP.size))


def test_a_plan_sizes_a_snapshot_without_holding_the_model():
    from hiso.core.snapshot import state_size
    from hiso.runners.protocol import BlobReplica

    blob = BlobReplica(10**8)  # a plan's stand-in for a 100M-value state: its bytes counted, none held
    assert state_size(blob) == 4 * 10**8
    held = blob.params[0].untyped_storage().nbytes()  # (a storage's repr would print every value)
    assert held < 1024
