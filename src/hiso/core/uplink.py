"""A method's uplink codec: how a client's (tau, P) answer becomes bytes and back.

A codec is any object with

* ``name``: a short word for messages and docs;
* ``size(wire) -> int``: the bytes of the tau*P answers (the loss excluded), fixed for the run
  (:class:`~hiso.core.wire.Wire` gives tau, P, the scalar dtype and the run's seed);
* ``encode(scalars, wire, check) -> bytes``: ``size(wire)`` bytes of a (tau, P) float32 array;
  a ValueError for values it cannot carry. ``check=False`` (a simulated attacker, a lost
  answer's size) must still make ``size`` bytes and lets non-finite values through;
* ``decode(data, off, wire) -> ndarray``: the (tau, P) float32 answers from
  ``data[off:off + size(wire)]``; a ValueError for any bytes an encoder would not make (so the
  same values never have two encodings).

:func:`hiso.core.messages.encode_uplink` puts the header before the codec's bytes and the loss
after them; the decoder checks the exact length first and refuses non-finite answers after,
whatever the codec. A method names its codec in ``uplink`` (:mod:`hiso.core.method`): a codec
instance, or one of the built-in names ``"scalars"`` and ``"codes"`` (with the method's
``bits``); a method's own codec lives beside it (FeedSign's one-bit signs, greedy's choices).
The codec is part of the method's code, so peers that fingerprint the same method class
(:func:`hiso.core.join.config_fingerprint`) use the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .scalars import CODE_BITS, codes_size, decode_codes, decode_scalars, encode_codes, encode_scalars


@dataclass(frozen=True)
class Scalars:
    """The tau*P answers as one block of the run's scalar dtype (DeComFL's and HiSo's uplink)."""

    name: ClassVar[str] = "scalars"

    def size(self, wire) -> int:
        return wire.record_bytes

    def encode(self, scalars, wire, check: bool = True) -> bytes:
        return encode_scalars(scalars, wire.dtype, check)

    def decode(self, data, off: int, wire) -> np.ndarray:
        return decode_scalars(data, off, wire.n, wire.dtype).reshape(wire.shape)


@dataclass(frozen=True)
class Codes:
    """A quantised sketch's: each row b-bit codes with a float32 scale (:func:`hiso.core.scalars.encode_codes`)."""

    bits: int
    name: ClassVar[str] = "codes"

    def __post_init__(self) -> None:
        if self.bits not in CODE_BITS:
            raise ValueError(f"code bits must be one of {CODE_BITS}, got {self.bits!r}")

    def size(self, wire) -> int:
        return codes_size(wire.tau, wire.P, self.bits)

    def encode(self, scalars, wire, check: bool = True) -> bytes:
        return encode_codes(scalars, self.bits, check)

    def decode(self, data, off: int, wire) -> np.ndarray:
        return decode_codes(data, off, wire.tau, wire.P, self.bits)


SCALARS = Scalars()
CODEC_PARTS = ("name", "size", "encode", "decode")


def uplink_codec(method: Any) -> Any:
    """The codec of ``method``'s uplink (None: DeComFL's scalars); a bad one is a one-line ValueError."""
    spec = "scalars" if method is None else getattr(method, "uplink", "scalars")
    if isinstance(spec, str):
        if spec == "scalars":
            return SCALARS
        if spec == "codes":
            bits = getattr(method, "bits", None)
            if bits not in CODE_BITS:
                raise ValueError(f"a method with uplink 'codes' needs bits in {CODE_BITS}, got {bits!r}")
            return Codes(bits)
        raise ValueError(f"a method's uplink must be 'scalars', 'codes' or a codec (hiso.core.uplink), "
                         f"got {spec!r}")
    return check_codec(spec)


def check_codec(codec: Any) -> Any:
    """``codec`` if it is a codec instance with the four parts (one-line ValueError otherwise)."""
    if isinstance(codec, (str, type)):
        raise ValueError(f"an uplink codec must be a codec instance (hiso.core.uplink), got {codec!r}")
    missing = [part for part in CODEC_PARTS if not hasattr(codec, part)]
    if missing:
        raise ValueError(f"an uplink codec ({type(codec).__name__}) lacks {', '.join(missing)}: a codec has "
                         f"name, size, encode and decode (hiso.core.uplink)")
    return codec
