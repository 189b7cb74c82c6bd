"""Hostile bytes: every decoder and reader, fed anything, raises its documented error or returns a
value that re-encodes to the bytes it read; a huge length field raises at once, allocating nothing.

Inputs are random bytes and valid encodings mutated (bytes flipped, cut, inserted, a field made
huge). HISO_FUZZ_EXAMPLES sets Hypothesis's examples per test (CI: 60; bench/fuzz.py: more).
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from hiso.core import messages as M  # noqa: E402
from hiso.core.history import (RoundRecord, encode_header, encode_record, parse_history)  # noqa: E402
from hiso.core.scalars import block_size, decode_scalars, encode_scalars  # noqa: E402
from hiso.core.seeds import round_seeds  # noqa: E402
from hiso.core.uplink import SCALARS  # noqa: E402
from hiso.methods.feedsign import SIGNS  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("HISO_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DTYPES = ("float32", "float16", "bfloat16", "int8")


def mutated(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid encoding with a few bytes flipped, cut off, inserted or replaced by a long varint."""
    def mutate(args):
        data, ops = args
        b = bytearray(data)
        for op, pos, val in ops:
            i = pos % (len(b) + 1)
            if op == 0 and b:
                b[i % len(b)] ^= 1 << (val % 8)
            elif op == 1:
                del b[i:]
            elif op == 2:
                b[i:i] = bytes([val % 256])
            else:  # a length field of 2^60-odd, canonical LEB128
                v, out = (1 << 60) + val, bytearray()
                while v >= 0x80:
                    out.append((v & 0x7F) | 0x80)
                    v >>= 7
                out.append(v)
                b[i:i + 1] = out
        return bytes(b)
    ops = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 1 << 20)), max_size=3)
    return st.tuples(valid, ops).map(mutate)


def hostile(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.binary(max_size=200), valid, mutated(valid))


# ---------------------------------------------------------------------------------- messages
wires = st.builds(M.Wire, st.integers(1, 3), st.integers(1, 3), st.sampled_from(DTYPES), st.integers(0, 2**64 - 1),
                  st.sampled_from([SCALARS, SIGNS]))
finite32 = st.floats(-1e4, 1e4, width=32)


def _scalars(wire, draw):
    vals = np.array(draw(st.lists(finite32, min_size=wire.n, max_size=wire.n)), np.float32).reshape(wire.shape)
    if wire.uplink is SIGNS:
        return np.where(vals >= 0, np.float32(1), np.float32(-1))
    return M.quantize(vals, wire.dtype)


@st.composite
def uplinks(draw):
    wire = draw(wires)
    loss = draw(st.none() | finite32)
    up = M.Uplink(draw(st.integers(0, 2**40)), draw(st.integers(0, 2**30)), _scalars(wire, draw),
                  None if loss is None else float(M.quantize(np.array([loss]), M.loss_dtype(wire.dtype))[0]),
                  draw(st.integers(0, 100)))
    return wire, M.encode_uplink(up, wire)


@st.composite
def downlinks(draw):
    wire = draw(wires)
    rnd, att = draw(st.integers(0, 40)), draw(st.integers(0, 3))
    if draw(st.booleans()):
        return wire, M.encode_downlink(M.Downlink(rnd, wire.seeds(rnd, att), rnd, (), att, draw(st.binary(max_size=40))),
                                       wire)
    n = draw(st.integers(0, min(rnd, 4)))
    missed = []
    for j in range(n):
        r, a = rnd - n + j, draw(st.sampled_from([0, 0, 1, 5]))
        missed.append(RoundRecord(r, wire.seeds(r, a), _scalars(wire, draw), (), a))
    return wire, M.encode_downlink(M.Downlink(rnd, wire.seeds(rnd, att), rnd - n, tuple(missed), att), wire)


def _with(wire_and_bytes):
    wire, data = wire_and_bytes
    return st.tuples(st.just(wire), hostile(st.just(data)))


@FUZZ
@given(uplinks().flatmap(_with))
def test_uplink(case):
    wire, data = case
    try:
        up = M.decode_uplink(data, wire)
    except M.MessageError:
        return
    assert M.encode_uplink(up, wire) == data


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_non_finite_loss_is_refused(dtype):
    """One client's NaN loss would make the round's mean loss NaN and end the run as diverged."""
    wire = M.Wire(1, 2, dtype)
    good = M.encode_uplink(M.Uplink(0, 3, np.zeros((1, 2), np.float32), 1.0), wire)
    nan = np.array([np.nan], np.float32)
    bad = good[:-wire.loss_bytes] + (nan.astype("<f4").tobytes() if wire.loss_bytes == 4 else
                                     (nan.astype("<f2").tobytes() if dtype == "float16" else b"\xc0\x7f"))
    with pytest.raises(M.MessageError, match="non-finite loss"):
        M.decode_uplink(bad, wire)


@FUZZ
@given(downlinks().flatmap(_with))
def test_downlink(case):
    wire, data = case
    try:
        down = M.decode_downlink(data, wire)
    except M.MessageError:
        return
    assert M.encode_downlink(down, wire) == data


@FUZZ
@given(hostile(st.builds(lambda c, r: M.encode_hello(M.Hello(c, r)), st.integers(0, 2**63), st.integers(0, 2**63))))
def test_hello(data):
    try:
        h = M.decode_hello(data)
    except M.MessageError:
        return
    assert M.encode_hello(h) == data


@FUZZ
@given(hostile(st.builds(lambda s, a, b: M.encode_welcome(M.Welcome(s, a, b)), st.integers(0, 2**64 - 1),
                         st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16))))
def test_welcome(data):
    try:
        w = M.decode_welcome(data)
    except M.MessageError:
        return
    assert M.encode_welcome(w) == data


@FUZZ
@given(st.sampled_from(DTYPES), st.integers(0, 6), st.data())
def test_scalar_blocks(dtype, n, data):
    """A block of the right size decodes; a finite one re-encodes to its bytes (int8: to its values)."""
    raw = data.draw(st.binary(min_size=block_size(n, dtype), max_size=block_size(n, dtype)))
    try:
        x = decode_scalars(raw, 0, n, dtype)
    except M.MessageError:  # an int8 block no encoder makes (the same values would have other bytes)
        assert dtype == "int8"
        return
    if np.all(np.isfinite(x)):
        assert encode_scalars(x, dtype) == raw


def _tiny_state():
    from hiso.core.config import ZOConfig
    from hiso.core.state import ModelState
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    return ModelState(model, ZOConfig(lr=0.1, mu=1e-3, perturbations=1, local_steps=1))


_STATE = None


@FUZZ
@given(st.data())
def test_snapshot(data):
    global _STATE
    _STATE = _STATE or _tiny_state()
    size = M.state_size(_STATE)
    valid = st.lists(finite32, min_size=size // 4, max_size=size // 4).map(
        lambda v: np.array(v, "<f4").tobytes())
    payload = data.draw(hostile(valid))
    before = M.encode_state(_STATE)
    try:
        M.load_state(_STATE, payload, 7)
    except M.MessageError:
        assert M.encode_state(_STATE) == before  # refused: nothing changed
        return
    assert M.encode_state(_STATE) == payload


# ---------------------------------------------------------------------------------- files
@st.composite
def histories(draw):
    tau, P = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dtype, seed = draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**64 - 1))
    fam = draw(st.sampled_from(["philox-rademacher", "torch-normal", ""]))
    out = encode_header(tau, P, seed, dtype, fam)
    for r in range(draw(st.integers(0, 3))):
        a = draw(st.sampled_from([0, 0, 2]))
        g = M.quantize(np.array(draw(st.lists(finite32, min_size=tau * P, max_size=tau * P)), np.float32), dtype)
        parts = tuple(draw(st.lists(st.integers(0, 300), max_size=3)))
        out += encode_record(RoundRecord(r, round_seeds(seed, r, a, tau, P), g.reshape(tau, P), parts, a), dtype)
    return out


@FUZZ
@given(hostile(histories()))
def test_history(tmp_path, data):
    path = tmp_path / "history.bin"
    path.write_bytes(data)
    try:
        log = parse_history(path)
    except ValueError as e:
        assert "\n" not in str(e)
        return
    if log.version != 3:
        return
    again = encode_header(log.tau, log.P, log.seed, log.scalar_dtype, log.directions) + b"".join(
        encode_record(r, log.scalar_dtype) for r in log.records)
    assert again == data[:len(data) - log.torn]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=8)


def _config_texts():
    from hiso.config import RunConfig
    base = {**RunConfig(task="quadratic", dim=4).model_dump(), "task_info": {"task": "quadratic"}}
    keys = sorted(base)
    edited = st.tuples(st.sampled_from(keys), json_values).map(lambda kv: json.dumps({**base, kv[0]: kv[1]}))
    return st.one_of(st.text(max_size=50), json_values.map(json.dumps), edited,
                     st.just("[" * 100_000), st.just(json.dumps(base)))


@FUZZ
@given(_config_texts())
def test_config_json(tmp_path, text):
    from hiso.runners.runfiles import saved_config
    (tmp_path / "config.json").write_text(text)
    try:
        cfg, info = saved_config(tmp_path)
    except ValueError:  # ConfigError, a pydantic ValidationError and a damaged file are ValueErrors
        return
    assert saved_config_roundtrip(tmp_path, cfg, info)


@pytest.mark.parametrize("opts", [True, 1, 1.5, "c=1"])
def test_config_json_with_method_options_of_another_type_is_refused(tmp_path, opts):
    """Found by the fuzzer above: ``method_opts`` that is neither a table nor a list of pairs
    is a ValueError (one line), not a TypeError."""
    from hiso.config import RunConfig
    from hiso.runners.runfiles import saved_config
    base = {**RunConfig(task="quadratic", dim=4).model_dump(), "task_info": {"task": "quadratic"}}
    (tmp_path / "config.json").write_text(json.dumps({**base, "method_opts": opts}))
    with pytest.raises(ValueError):
        saved_config(tmp_path)


def saved_config_roundtrip(d, cfg, info) -> bool:
    from hiso.runners.runfiles import saved_config
    (d / "config.json").write_text(json.dumps({**cfg.model_dump(), "task_info": info}))
    again, info2 = saved_config(d)
    return again.model_dump() == cfg.model_dump() and info2 == info


def _manifests():
    m = {"format": "hiso-model-pack", "format_version": 1, "model": "m", "hiso_version": "0", "part_size": 4,
         "total_size": 4, "files": [{"path": "a/b.json", "size": 4, "sha256": "0" * 64}],
         "parts": [{"name": "m.part0000", "size": 4, "sha256": "1" * 64}]}
    edited = st.tuples(st.sampled_from(sorted(m)), json_values).map(lambda kv: json.dumps({**m, kv[0]: kv[1]}))
    return st.one_of(st.text(max_size=40), edited, st.just(json.dumps(m)), st.just("[" * 100_000),
                     st.binary(max_size=40).map(lambda b: b.decode("latin-1")))


@FUZZ
@given(_manifests())
def test_cache_manifest(tmp_path, text):
    from hiso.tasks.lm_pack import MANIFEST, PackError, read_manifest
    (tmp_path / MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape"))
    try:
        m = read_manifest(tmp_path)
    except PackError as e:
        assert "\n" not in str(e)
        return
    assert json.loads(json.dumps(m)) == m


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@FUZZ
@given(st.data())
def test_checkpoint_file(tmp_path, data):
    """Whatever checkpoint.pt holds, load_start names why it is not used or returns a state."""
    from hiso.config import RunConfig
    from hiso.runners.checkpoint import FORMAT, load_start
    cfg = RunConfig(task="quadratic", dim=4)
    import io
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "round": 0, "state": {"round": 0, "x": torch.zeros(3)}}, buf)
    (tmp_path / "checkpoint.pt").write_bytes(data.draw(hostile(st.just(buf.getvalue()))))
    (tmp_path / "history.bin").write_bytes(b"")
    state, why = load_start(tmp_path, cfg, 0)
    assert state is None and isinstance(why, str) and "\n" not in why


@FUZZ
@given(st.sampled_from(("float32", "float16", "bfloat16")), st.data())
def test_full_model_messages(dtype, data):
    """The full-model baselines' messages (hiso.baselines.messages)."""
    from hiso.baselines import messages as F
    vec = st.lists(st.floats(-100, 100, width=16), max_size=4).map(lambda v: torch.tensor(v, dtype=torch.float32))
    down = st.builds(lambda r, m: F.encode_downlink(F.FullDownlink(r, m), dtype), st.integers(0, 2**32 - 1), vec)
    raw = data.draw(hostile(down))
    try:
        msg = F.decode_downlink(raw)
    except M.MessageError:
        pass
    else:
        assert F.encode_downlink(msg, F._NAMES[raw[4]]) == raw
    up = st.builds(lambda c, r, v, loss: F.encode_uplink(F.FullUplink(c, r, v, loss), dtype), st.integers(0, 99),
                   st.integers(0, 99), vec, st.floats(-10, 10, width=32))
    raw = data.draw(hostile(up))
    try:
        msg = F.decode_uplink(raw)
    except M.MessageError:
        return
    assert F.encode_uplink(msg, F._NAMES[raw[4]]) == raw


# ---------------------------------------------------------------------------------- FedKSeed and Flower
@FUZZ
@given(st.sampled_from(("float32", "float16", "bfloat16")), st.integers(1, 3), st.data())
def test_pool_messages(dtype, tau, data):
    from hiso.methods.fedkseed import (PoolRecord, decode_pool_downlink, decode_pool_uplink, encode_pool_downlink,
                                       encode_pool_uplink)
    K = 8
    g = st.lists(finite32, min_size=tau, max_size=tau).map(lambda v: M.quantize(np.array(v, np.float32), dtype))
    idx = st.lists(st.integers(0, K - 1), min_size=tau, max_size=tau).map(np.array)
    up = st.builds(lambda c, r, i, v: encode_pool_uplink(c, r, i, v, None, dtype), st.integers(0, 99),
                   st.integers(0, 99), idx, g)
    raw = data.draw(hostile(up))
    try:
        c, r, i, v, loss = decode_pool_uplink(raw, tau, K, dtype)
    except M.MessageError:
        pass
    else:
        assert encode_pool_uplink(c, r, i, v, loss, dtype) == raw
    down = st.builds(lambda i, v: encode_pool_downlink(3, [PoolRecord(2, (1,), i.reshape(1, tau), v.reshape(1, tau))],
                                                       dtype), idx, g)
    raw = data.draw(hostile(down))
    try:
        rnd, recs = decode_pool_downlink(raw, tau, K, dtype)
    except M.MessageError:
        return
    assert encode_pool_downlink(rnd, recs, dtype) == raw


@FUZZ
@given(st.sampled_from(("float32", "float16", "bfloat16")), st.data())
def test_pool_log(tmp_path, dtype, data):
    from hiso.methods.fedkseed import PoolLogWriter, PoolRecord, read_pool_log
    path = tmp_path / "history.bin"
    with PoolLogWriter(path, 2, 8, 5, dtype) as w:
        for r in range(data.draw(st.integers(0, 3))):
            w.write(PoolRecord(r, (1, 4), np.array([[1, 2], [3, 7]]), np.ones((2, 2), np.float32)))
    raw = data.draw(hostile(st.just(path.read_bytes())))
    path.write_bytes(raw)
    try:
        head, recs = read_pool_log(path)
    except ValueError as e:
        assert "\n" not in str(e)
        return
    with PoolLogWriter(path, head["tau"], head["K"], head["seed"], head["scalar_dtype"], keep=recs):
        pass
    assert raw.startswith(path.read_bytes())  # the records it kept, as they were (a torn tail dropped)


@FUZZ
@given(st.dictionaries(st.sampled_from(["up", "hello", "behind", "partition", "round", "x"]),
                       st.one_of(st.integers(-2**70, 2**70), st.floats(), st.text(max_size=5), st.binary(max_size=20),
                                 st.booleans(), st.lists(st.integers(), max_size=2)), max_size=4))
def test_flower_reply_fields(rec):
    """A node's reply record: each field the ServerApp reads is the documented MessageError or a
    value of its kind and range."""
    from hiso.flower.records import reply_bytes, reply_int
    for name in ("up", "hello"):
        try:
            assert isinstance(reply_bytes(rec, name), bytes)
        except M.MessageError as e:
            assert "\n" not in str(e)
    for name in ("behind", "partition", "round"):
        try:
            v = reply_int(rec, name)
        except M.MessageError as e:
            assert "\n" not in str(e)
        else:
            assert type(v) is int and 0 <= v < M.MAX_ROUND


# ---------------------------------------------------------------------------------- huge length fields
def _varint(v: int) -> bytes:
    out = bytearray()
    M.put_varint(out, v)
    return bytes(out)


def _huge_cases():
    w = M.Wire(2, 3, "float32", 1)
    head = lambda kind: bytes([M.VERSION, kind])  # noqa: E731
    big = 1 << 60
    yield "downlink records", lambda: M.decode_downlink(head(M.DOWN) + _varint(2**35) + b"\0" + _varint(2**35 - 1)
                                                        + b"\0", w)
    yield "downlink re-planned", lambda: M.decode_downlink(head(M.DOWN) + _varint(50) + b"\0" + _varint(50)
                                                           + _varint(big), w)
    yield "uplink client", lambda: M.decode_uplink(head(M.UP) + b"\0" + _varint(big) + b"\0\0", w)
    from hiso.baselines import messages as F
    yield "full-model downlink", lambda: F.decode_downlink(F._DOWN.pack(F.MAGIC, F.VERSION, F.DOWN, 1, 0, 2**63))
    from hiso.methods.fedkseed import POOL_DOWN, decode_pool_downlink
    yield "pool downlink", lambda: decode_pool_downlink(head(POOL_DOWN) + _varint(big) + _varint(big - 1)
                                                        + _varint(big), 2, 8)


@pytest.mark.parametrize("name,call", list(_huge_cases()))
def test_a_huge_length_field_raises_at_once(name, call):
    tracemalloc.start()
    t0 = time.process_time()  # this process's CPU time: other jobs on the machine do not add to it
    try:
        with pytest.raises(M.MessageError):
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.process_time() - t0 < 2.0 and peak < 1 << 20, f"{name}: {peak} bytes"


def test_a_huge_history_header_allocates_nothing(tmp_path):
    path = tmp_path / "history.bin"
    path.write_bytes(encode_header(65535, 65535, 1, "float32", "x") + _varint(0) + _varint(0) + _varint(2**60))
    tracemalloc.start()
    try:
        log = parse_history(path)  # a record cut short: the torn tail of a crash
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert log.records == [] and log.torn > 0 and peak < 1 << 20
