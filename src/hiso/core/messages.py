"""The two messages of the protocol and their compact binary encoding.

Downlink (server -> sampled client), little-endian::

    b"HS" u8 version u8 kind=1 | u32 round | u16 tau | u16 P | u32 since | u32 n_missed
    tau*P x u64          this round's seeds
    n_missed x (tau*P x u64 seeds, tau*P x f32 scalars)   rounds since .. round-1

Uplink (client -> server)::

    b"HS" u8 version u8 kind=2 | u8 flags | u32 client | u32 round | u16 tau | u16 P
    tau*P x f32 scalars | f32 mean local loss (if flags & 1)

That is all that crosses the network: seeds and scalars, never a d-dimensional vector.
A message is decoded completely and checked before anyone acts on it, so a malformed,
truncated or wrong-round message raises :class:`MessageError` and changes nothing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from .history import RoundRecord

VERSION = 1
DOWN, UP = 1, 2
_DOWN = struct.Struct("<2sBBIHHII")
_UP = struct.Struct("<2sBBBIIHH")
FLAG_LOSS = 1


class MessageError(ValueError):
    """A message that cannot be decoded or does not fit the receiver's state."""


@dataclass(frozen=True)
class Downlink:
    round: int
    seeds: np.ndarray  # (tau, P) uint64
    since: int  # the round whose start state the client holds
    missed: tuple[RoundRecord, ...] = field(default=())  # records since .. round-1

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", np.asarray(self.seeds, dtype=np.uint64))
        if self.since + len(self.missed) != self.round:
            raise MessageError(f"history from round {self.since} with {len(self.missed)} records does not reach round {self.round}")
        for j, rec in enumerate(self.missed):
            if rec.round != self.since + j or rec.seeds.shape != self.seeds.shape:
                raise MessageError(f"history record {j} (round {rec.round}) is out of order or of the wrong shape")


@dataclass(frozen=True)
class Uplink:
    client: int
    round: int
    scalars: np.ndarray  # (tau, P) float32
    loss: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scalars", np.asarray(self.scalars, dtype=np.float32))


def encode_downlink(msg: Downlink) -> bytes:
    tau, P = msg.seeds.shape
    parts = [_DOWN.pack(b"HS", VERSION, DOWN, msg.round, tau, P, msg.since, len(msg.missed)),
             msg.seeds.astype("<u8").tobytes()]
    for rec in msg.missed:
        parts.append(rec.seeds.astype("<u8").tobytes())
        parts.append(rec.scalars.astype("<f4").tobytes())
    return b"".join(parts)


def downlink_size(tau: int, P: int, n_missed: int) -> int:
    """Bytes of an encoded downlink (closed form, for accounting and tests)."""
    return _DOWN.size + 8 * tau * P + n_missed * 12 * tau * P


def uplink_size(tau: int, P: int, with_loss: bool = True) -> int:
    return _UP.size + 4 * tau * P + (4 if with_loss else 0)


def _header(data: bytes, st: struct.Struct, kind: int, what: str) -> tuple:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) < st.size:
        raise MessageError(f"{what}: truncated header ({len(data)} < {st.size} bytes)")
    head = st.unpack_from(data, 0)
    if head[0] != b"HS":
        raise MessageError(f"{what}: bad magic {head[0]!r}, not a hiso message")
    if head[1] != VERSION:
        raise MessageError(f"{what}: protocol version {head[1]} not supported (this is version {VERSION})")
    if head[2] != kind:
        raise MessageError(f"{what}: message kind {head[2]} is not a {what}")
    return head


def decode_downlink(data: bytes, *, expect_shape: tuple[int, int] | None = None,
                    expect_since: int | None = None) -> Downlink:
    _, _, _, rnd, tau, P, since, n = _header(data, _DOWN, DOWN, "downlink")
    if tau == 0 or P == 0:
        raise MessageError("downlink: empty seed block (tau or P is 0)")
    if expect_shape is not None and (tau, P) != tuple(expect_shape):
        raise MessageError(f"downlink: (tau, P) = {(tau, P)} but this client runs {tuple(expect_shape)}")
    if expect_since is not None and since != expect_since:
        raise MessageError(f"downlink: history starts at round {since} but this client holds round {expect_since}")
    if since + n != rnd:
        raise MessageError(f"downlink for round {rnd}: history from round {since} has {n} records, expected {rnd - since}")
    k = tau * P
    want = downlink_size(tau, P, n)
    if len(data) != want:
        raise MessageError(f"downlink for round {rnd}: {len(data)} bytes, expected {want} (truncated or padded)")
    off = _DOWN.size
    seeds = np.frombuffer(data, "<u8", k, off).reshape(tau, P).copy(); off += 8 * k
    missed = []
    for j in range(n):
        s = np.frombuffer(data, "<u8", k, off).reshape(tau, P).copy(); off += 8 * k
        g = np.frombuffer(data, "<f4", k, off).reshape(tau, P).copy(); off += 4 * k
        if not np.all(np.isfinite(g)):
            raise MessageError(f"downlink: non-finite scalar in history round {since + j}")
        missed.append(RoundRecord(since + j, s, g))
    return Downlink(rnd, seeds, since, tuple(missed))


def encode_uplink(msg: Uplink) -> bytes:
    tau, P = msg.scalars.shape
    flags = FLAG_LOSS if msg.loss is not None else 0
    out = _UP.pack(b"HS", VERSION, UP, flags, msg.client, msg.round, tau, P) + msg.scalars.astype("<f4").tobytes()
    if msg.loss is not None:
        out += struct.pack("<f", msg.loss)
    return out


def decode_uplink(data: bytes, *, expect_round: int | None = None,
                  expect_shape: tuple[int, int] | None = None) -> Uplink:
    _, _, _, flags, client, rnd, tau, P = _header(data, _UP, UP, "uplink")
    if flags & ~FLAG_LOSS:
        raise MessageError(f"uplink: unknown flags {flags:#x}")
    if expect_round is not None and rnd != expect_round:
        raise MessageError(f"uplink from client {client}: round {rnd}, but the server is in round {expect_round}")
    if expect_shape is not None and (tau, P) != tuple(expect_shape):
        raise MessageError(f"uplink from client {client}: (tau, P) = {(tau, P)}, expected {tuple(expect_shape)}")
    has_loss = bool(flags & FLAG_LOSS)
    want = uplink_size(tau, P, has_loss)
    if len(data) != want:
        raise MessageError(f"uplink from client {client}: {len(data)} bytes, expected {want} (truncated or padded)")
    scalars = np.frombuffer(data, "<f4", tau * P, _UP.size).reshape(tau, P).copy()
    if not np.all(np.isfinite(scalars)):
        raise MessageError(f"uplink from client {client}: non-finite scalar (diverged? lower lr or mu)")
    loss = struct.unpack_from("<f", data, len(data) - 4)[0] if has_loss else None
    return Uplink(client, rnd, scalars, loss)
