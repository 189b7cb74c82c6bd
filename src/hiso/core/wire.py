"""What every message's bytes share: the header (protocol version, then the message kind, both
varints), the varints themselves, the checks a decoder makes before it acts on anything, the
errors it raises, and :class:`Wire`, the facts of a run that encoding needs. The messages and
their table are in :mod:`hiso.core.messages`; FedKSeed's (:mod:`hiso.methods.fedkseed`) and the
full-model baselines' (:mod:`hiso.baselines.messages`) reuse these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import JoinError, MessageError  # noqa: F401 (defined below both wire and scalars)
from .scalars import SCALAR_BYTES, _check_dtype, block_size, loss_dtype
from .seeds import round_seeds
from .uplink import SCALARS, check_codec

VERSION = 2
HELLO, WELCOME, DOWN, SNAPSHOT, UP = 1, 2, 3, 4, 5
KINDS = {HELLO: "hello", WELCOME: "welcome", DOWN: "downlink", SNAPSHOT: "snapshot", UP: "uplink"}


# ------------------------------------------------------------------------------ primitives


def put_varint(out: bytearray, v: int) -> None:
    if v < 0:
        raise ValueError(f"varint of a negative number {v}")
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def varint_size(v: int) -> int:
    return max(1, (int(v).bit_length() + 6) // 7)


def get_varint(data, off: int, what: str) -> tuple[int, int]:
    """(value, offset after it); truncated, over-long or non-canonical varints are errors."""
    v = shift = 0
    for i in range(10):
        if off + i >= len(data):
            raise MessageError(f"{what}: truncated (a number runs past the end)")
        b = data[off + i]
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and i > 0:
                raise MessageError(f"{what}: non-canonical number encoding")
            return v, off + i + 1
        shift += 7
    raise MessageError(f"{what}: number longer than 10 bytes")


# ------------------------------------------------------------------------------ the run's facts


@dataclass(frozen=True)
class Wire:
    """What encoding and decoding need, fixed for a run: (tau, P), the scalar dtype, the
    run's seed (from which every round's direction seeds derive) and the uplink's codec
    (:mod:`hiso.core.uplink`: the run's method's)."""

    tau: int
    P: int
    dtype: str = "float32"
    seed: int = 0
    uplink: Any = SCALARS  # the codec of an uplink's tau*P answers

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        check_codec(self.uplink)

    @classmethod
    def of(cls, zo, seed: int) -> "Wire":
        return cls(zo.local_steps, zo.perturbations, getattr(zo, "scalar_dtype", "float32"), seed,
                   getattr(zo, "uplink", SCALARS))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.tau, self.P)

    @property
    def n(self) -> int:
        return self.tau * self.P

    @property
    def scalar_bytes(self) -> int:
        """Bytes of one scalar (the fixed-width dtypes; int8 has :attr:`record_bytes`)."""
        return SCALAR_BYTES[self.dtype]

    @property
    def record_bytes(self) -> int:
        """Bytes of one round's tau*P scalars (an uplink's, or a history record's)."""
        return block_size(self.n, self.dtype)

    @property
    def uplink_bytes(self) -> int:
        """Bytes of an uplink's tau*P answers (its codec's size; the loss excluded)."""
        return self.uplink.size(self)

    @property
    def loss_bytes(self) -> int:
        return block_size(1, loss_dtype(self.dtype))

    def seeds(self, round: int, attempt: int = 0) -> np.ndarray:
        return round_seeds(self.seed, round, attempt, self.tau, self.P)


# ------------------------------------------------------------------------------ the header


def start(kind: int) -> bytearray:
    """A message's first bytes: the protocol version and ``kind``."""
    out = bytearray()
    put_varint(out, VERSION)
    put_varint(out, kind)
    return out


def expect_bytes(data, what: str) -> None:
    """A message must be bytes (or a bytes-like view) before anything is decoded."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"{what}: expected bytes, got {type(data).__name__}")


def check_head(what: str, version: int, kind: int | None, *, want_version: int, want_kind: int,
               kinds: dict[int, str] | None = None, family: str = "protocol") -> None:
    """The checks every hiso message header makes once its version and kind are read (this
    module's varint header, and the full-model baselines' fixed one). ``kind`` None: not read
    yet (only the version is checked)."""
    if version != want_version:
        raise MessageError(f"{what}: {family} version {version} not supported (this is version {want_version})")
    if kind is not None and kind != want_kind:
        name = "" if kinds is None else f" ({kinds.get(kind, 'unknown')})"
        raise MessageError(f"{what}: message kind {kind}{name} is not a {what}")


def read_head(data, kind: int, what: str) -> int:
    """Check version and kind; return the offset after them."""
    expect_bytes(data, what)
    if bytes(data[:2]) == b"HS":
        raise MessageError(f"{what}: a protocol version 1 message (an older hiso): every peer must run protocol "
                           f"version {VERSION}")
    version, off = get_varint(data, 0, what)
    check_head(what, version, None, want_version=VERSION, want_kind=kind)  # before the kind is read
    k, off = get_varint(data, off, what)
    check_head(what, version, k, want_version=VERSION, want_kind=kind, kinds=KINDS)
    return off


def expect_end(data, off: int, what: str) -> None:
    """A message must end exactly where its fields do (neither truncated nor padded)."""
    if off != len(data):
        raise MessageError(f"{what}: {len(data)} bytes, expected {off} (truncated or padded)")

