"""Protocol v2: the messages of the protocol and their compact binary encoding.

Every message starts with two varints (unsigned LEB128, canonical): the protocol version (2)
and the message kind. Rounds, attempts, counts and client ids are varints too; scalars are
little-endian numbers in the run's scalar dtype (float32: 4 bytes, float16 or bfloat16: 2).
int8 scalars travel in blocks
(:mod:`hiso.core.scalars`: a float32 scale, then one code a scalar): an uplink's tau*P are one
block (its loss a bfloat16 after it), a downlink's history one block per record.
No seed is ever sent: each round's seeds derive from the run's seed, the round and its
attempt (:mod:`hiso.core.seeds`), and a peer learns the run's seed once, when it joins.

=========  =========  ===============================================================
kind       direction  fields after ``version, kind``
=========  =========  ===============================================================
1 hello    up         client, round its replica holds
2 welcome  down       run seed (u64), config fingerprint (16 B), x_0 fingerprint (16 B)
3 down     down       round, attempt, n_missed, n_retried, n_retried x (j, attempt_j),
                      n_missed x tau*P scalars (rounds round-n_missed .. round-1)
4 snapshot down       round, attempt, the state at ``round``: trainable tensors (raw,
                      protocol order), then H (HiSo, float32)
5 up       up         flags (1: loss follows), client, round, attempt, tau*P scalars,
                      the mean local loss (scalar dtype, if flags & 1)
=========  =========  ===============================================================

An uplink's tau*P answers are its method's codec's bytes (``Wire.uplink``,
:mod:`hiso.core.uplink`): by default the scalars in the run's dtype, as in the table. FeedSign's
are signs packed 8 to a byte (ceil(tau*P / 8) bytes); a quantised sketch's b-bit codes with one
float32 scale per row (4 tau + ceil(tau*P*b / 8) bytes); greedy's one (index, value) pair a row
(:mod:`hiso.methods.greedy`); a method may bring its own. The loss follows in the scalar dtype's
loss format whatever the codec, and the downlink is unchanged.

``n_retried`` lists the missed rounds that were planned more than once (record j of the
history has attempt_j > 0; almost never), so a record costs its scalars and nothing else.
tau, P and the scalar dtype are part of the configuration both sides fingerprint at the
join, so no message repeats them.

The header and the varints are :mod:`hiso.core.wire`'s, kinds 1 and 2 (joining)
:mod:`hiso.core.join`'s, kind 4's state :mod:`hiso.core.snapshot`'s; every name is importable
from here.

A message is decoded completely and checked (version, kind, every count against the bytes
that follow, exact length, finite scalars, canonical varints) before anyone acts on it, so a
malformed, truncated or wrong-round message raises :class:`MessageError` and changes nothing.

Exactness by construction: a client's scalars are rounded to the scalar dtype when they are
encoded; the server averages what it decoded and rounds the mean to the scalar dtype
(:func:`quantize`) before logging it; every replica applies that logged value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .history import RoundRecord
# one import path for every message and the pieces they share (joining, snapshots and the
# header live in their own modules: join.py, snapshot.py, wire.py)
from .join import (FINGERPRINT_BYTES, Hello, Welcome, check_welcome, config_fingerprint, decode_hello,  # noqa: F401
                   decode_welcome, encode_hello, encode_welcome, tensors_fingerprint, welcome_for)
from .scalars import (SCALAR_BYTES, SCALAR_DTYPES, block_size, decode_blocks,  # noqa: F401
                      decode_codes, decode_scalars, encode_blocks, encode_codes, encode_scalars, loss_dtype,
                      pack_signs, packed_signs_size, quantize, unpack_signs)
from .seeds import MAX_ATTEMPT, MAX_ROUND, round_seeds, seeds_of  # noqa: F401
from .snapshot import encode_state, load_state, state_size  # noqa: F401
from .wire import (DOWN, HELLO, KINDS, SNAPSHOT, UP, VERSION, WELCOME, JoinError, MessageError, Wire,  # noqa: F401
                   check_head, expect_bytes, get_varint, put_varint, varint_size)
from .wire import expect_end as _end
from .wire import read_head as _head
from .wire import start as _start

FLAG_LOSS = 1


@dataclass(frozen=True)
class Downlink:
    """Round ``round`` (attempt ``attempt``) for a sampled client: its seeds and either the
    records since ``since`` or, with ``snapshot``, the whole state at ``round`` (since = round)."""

    round: int
    seeds: np.ndarray  # (tau, P) uint64 (derived, never sent)
    since: int  # the round whose start state the client holds
    missed: tuple[RoundRecord, ...] = field(default=())  # records since .. round-1
    attempt: int = 0
    snapshot: bytes | None = None  # encode_state of the server's replica at ``round``

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", np.asarray(self.seeds, dtype=np.uint64))
        if self.snapshot is not None and (self.missed or self.since != self.round):
            raise MessageError("a snapshot downlink carries no history (since must equal round)")
        if self.since + len(self.missed) != self.round:
            raise MessageError(f"history from round {self.since} with {len(self.missed)} records does not reach round {self.round}")
        for j, rec in enumerate(self.missed):
            if rec.round != self.since + j or rec.scalars.shape != self.seeds.shape:
                raise MessageError(f"history record {j} (round {rec.round}) is out of order or of the wrong shape")


@dataclass(frozen=True)
class Uplink:
    client: int
    round: int
    scalars: np.ndarray  # (tau, P) float32
    loss: float | None = None
    attempt: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scalars", np.asarray(self.scalars, dtype=np.float32))



def encode_downlink(msg: Downlink, wire: Wire | None = None) -> bytes:
    """Encode (``wire`` default: float32 scalars and msg's shape; then seeds are not checked).
    With ``wire``, the seeds must be the ones the receiver will derive."""
    shape = msg.seeds.shape
    dtype = "float32" if wire is None else wire.dtype
    if wire is not None:
        if shape != wire.shape:
            raise ValueError(f"downlink seeds of shape {shape}, the wire's (tau, P) is {wire.shape}")
        if not np.array_equal(msg.seeds, wire.seeds(msg.round, msg.attempt)):
            raise ValueError(f"downlink for round {msg.round}: its seeds are not the run's derived ones")
    if msg.snapshot is not None:
        out = _start(SNAPSHOT)
        put_varint(out, msg.round)
        put_varint(out, msg.attempt)
        return bytes(out) + msg.snapshot
    out = _start(DOWN)
    put_varint(out, msg.round)
    put_varint(out, msg.attempt)
    put_varint(out, len(msg.missed))
    retried = [(j, r.attempt) for j, r in enumerate(msg.missed) if r.attempt]
    put_varint(out, len(retried))
    for j, a in retried:
        put_varint(out, j)
        put_varint(out, a)
    if msg.missed:
        if wire is not None:
            want = seeds_of(wire.seed, [r.round for r in msg.missed], [r.attempt for r in msg.missed], *wire.shape)
            if not np.array_equal(np.stack([r.seeds for r in msg.missed]), want):
                raise ValueError("a history record's seeds are not the run's derived ones")
        out += encode_blocks([r.scalars for r in msg.missed], dtype)
    return bytes(out)


def decode_downlink(data, wire: Wire, *, expect_since: int | None = None) -> Downlink:
    """Decode and check a downlink or snapshot downlink; seeds are derived from ``wire``."""
    what = "downlink"
    if isinstance(data, memoryview):
        data = bytes(data)
    if isinstance(data, (bytes, bytearray)) and len(data) >= 2 and data[0] == VERSION and data[1] == SNAPSHOT:
        off = _head(data, SNAPSHOT, "snapshot")
        rnd, off = get_varint(data, off, "snapshot")
        att, off = get_varint(data, off, "snapshot")
        _check_round(rnd, att, "snapshot")
        return Downlink(rnd, wire.seeds(rnd, att), rnd, (), att, bytes(data[off:]))
    off = _head(data, DOWN, what)
    rnd, off = get_varint(data, off, what)
    att, off = get_varint(data, off, what)
    _check_round(rnd, att, what)
    n, off = get_varint(data, off, what)
    if n > rnd:
        raise MessageError(f"downlink for round {rnd}: {n} history records reach back before round 0")
    since = rnd - n
    if expect_since is not None and since != expect_since:
        raise MessageError(f"downlink: history starts at round {since} but this client holds round {expect_since}")
    n_retried, off = get_varint(data, off, what)
    if n_retried > n:
        raise MessageError(f"downlink for round {rnd}: {n_retried} re-planned records among {n}")
    if off + n * wire.record_bytes > len(data):  # before anything of n's size is allocated
        raise MessageError(f"downlink for round {rnd}: {n} history records of {wire.record_bytes} bytes, "
                           f"but {len(data) - off} bytes follow")
    attempts = np.zeros(n, dtype=np.int64)
    prev = -1
    for _ in range(n_retried):
        j, off = get_varint(data, off, what)
        a, off = get_varint(data, off, what)
        if not prev < j < n or not 0 < a < MAX_ATTEMPT:
            raise MessageError(f"downlink for round {rnd}: bad re-planned record entry ({j}, {a})")
        attempts[j], prev = a, j
    k = wire.n
    _end(data, off + n * wire.record_bytes, what)
    try:
        scal = decode_blocks(data, off, n, k, wire.dtype).reshape(n, *wire.shape)
    except ValueError as e:  # a low-bit block's bad scale, code or pad bits
        raise MessageError(f"downlink for round {rnd}: {e}") from None
    if not np.all(np.isfinite(scal)):
        raise MessageError(f"downlink for round {rnd}: non-finite scalar in its history")
    seeds = seeds_of(wire.seed, np.arange(since, rnd), attempts, *wire.shape) if n else ()
    missed = tuple(RoundRecord(since + j, seeds[j], scal[j], (), int(attempts[j])) for j in range(n))
    return Downlink(rnd, wire.seeds(rnd, att), since, missed, att)


def _check_round(rnd: int, att: int, what: str) -> None:
    if rnd >= MAX_ROUND or att >= MAX_ATTEMPT:
        raise MessageError(f"{what}: round {rnd} / attempt {att} out of range")


def encode_uplink(msg: Uplink, wire: Wire | None = None, *, check: bool = True) -> bytes:
    """The uplink's bytes (``wire`` default: float32 scalars of msg's shape); ``check=False``
    lets non-finite scalars through (simulated attackers only)."""
    if wire is None:
        wire = Wire(*msg.scalars.shape) if msg.scalars.ndim == 2 else Wire(1, msg.scalars.size)
    elif msg.scalars.shape != wire.shape:
        raise ValueError(f"uplink scalars of shape {msg.scalars.shape}, the wire's (tau, P) is {wire.shape}")
    out = _start(UP)
    put_varint(out, FLAG_LOSS if msg.loss is not None else 0)
    put_varint(out, msg.client)
    put_varint(out, msg.round)
    put_varint(out, msg.attempt)
    try:
        body = wire.uplink.encode(msg.scalars.reshape(wire.shape), wire, check)
    except ValueError as e:  # values the codec cannot carry (FloatingPointError passes through)
        raise ValueError(f"uplink from client {msg.client}: {e}") from None
    if len(body) != wire.uplink_bytes:
        raise ValueError(f"uplink codec {wire.uplink.name!r} made {len(body)} bytes, its size is {wire.uplink_bytes}")
    out += body
    if msg.loss is not None:  # in the scalar dtype too (monitoring only; bfloat16 beside int8)
        out += encode_scalars(np.array([msg.loss]), loss_dtype(wire.dtype), check)
    return bytes(out)


def decode_uplink(data, wire: Wire | None = None, *, expect_round: int | None = None,
                  expect_shape: tuple[int, int] | None = None) -> Uplink:
    """Decode and check an uplink (``wire`` default: float32 and ``expect_shape``)."""
    what = "uplink"
    if wire is None:
        if expect_shape is None:
            raise ValueError("decode_uplink needs the wire (or expect_shape)")
        wire = Wire(*expect_shape)
    off = _head(data, UP, what)
    flags, off = get_varint(data, off, what)
    if flags & ~FLAG_LOSS:
        raise MessageError(f"uplink: unknown flags {flags:#x}")
    client, off = get_varint(data, off, what)
    rnd, off = get_varint(data, off, what)
    att, off = get_varint(data, off, what)
    if expect_round is not None and rnd != expect_round:
        raise MessageError(f"uplink from client {client}: round {rnd}, but the server is in round {expect_round}")
    has_loss = bool(flags & FLAG_LOSS)
    nb = wire.uplink_bytes
    _end(data, off + nb + (wire.loss_bytes if has_loss else 0), f"uplink from client {client}")
    try:  # the codec's answers (one path for every codec: hiso.core.uplink)
        scalars = np.asarray(wire.uplink.decode(data, off, wire), dtype=np.float32)
    except ValueError as e:  # bytes no encoder makes: a bad scale, code, index or pad bits
        raise MessageError(f"uplink from client {client}: {e}") from None
    if scalars.shape != wire.shape:
        raise MessageError(f"uplink from client {client}: codec {wire.uplink.name!r} decoded shape {scalars.shape}, "
                           f"the wire's (tau, P) is {wire.shape}")
    if not np.all(np.isfinite(scalars)):
        raise MessageError(f"uplink from client {client}: non-finite scalar (diverged? lower lr or mu)")
    loss = _loss(data, off + nb, wire, client) if has_loss else None
    return Uplink(client, rnd, scalars, loss, att)


def _loss(data, off: int, wire: Wire, client: int) -> float:
    """An uplink's monitoring loss; a non-finite one is refused (one client's NaN would end the
    run as diverged: the round's mean loss is the divergence test's)."""
    loss = float(decode_scalars(data, off, 1, loss_dtype(wire.dtype))[0])
    if not np.isfinite(loss):
        raise MessageError(f"uplink from client {client}: non-finite loss {loss}")
    return loss
