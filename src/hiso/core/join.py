"""Joining a run: the client's hello, the server's welcome and the checks behind it.

A peer learns the run's seed once, here, and the two sides compare fingerprints of their whole
algorithm configuration and of x_0 before any round: peers that differ must not mix. (Kinds 1
and 2 of the table in :mod:`hiso.core.messages`.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from .wire import (HELLO, VERSION, WELCOME, JoinError, Wire, expect_end, get_varint, put_varint, read_head,
                   start)

FINGERPRINT_BYTES = 16


def config_fingerprint(zo) -> bytes:
    """16 bytes naming the whole algorithm configuration (every field of ZOConfig, nested ones
    included, whatever fields it has, and the class of its method): peers with different
    fingerprints must not mix. Checkpoints keep it, so a built-in method's blob is the one hiso
    wrote before methods were plugins (:func:`hiso.compat.fingerprint_method`); H's configuration
    is under "precond" in every blob (None without H). Fields added to a method later
    (:data:`hiso.compat.FINGERPRINT_LATER_FIELDS`) count only when set."""
    return hashlib.sha256(f"hiso-protocol-{VERSION}|{config_blob(zo)}".encode()).digest()[:FINGERPRINT_BYTES]


def config_blob(zo) -> str:
    """The JSON text :func:`config_fingerprint` hashes (see there)."""
    from ..compat import FINGERPRINT_LATER_FIELDS, class_key, fingerprint_method
    fields = dataclasses.asdict(zo)
    method = fields.pop("method")
    for name in FINGERPRINT_LATER_FIELDS.get(class_key(zo.method), ()):
        if method.get(name) is None:
            method.pop(name)
    precond = zo.precond  # H's configuration, whichever method's stage keeps it
    fields["precond"] = None if precond is None else dataclasses.asdict(precond)
    fields.update(fingerprint_method(zo.method, method, zo.uplink))
    return json.dumps(fields, sort_keys=True, default=repr)


def tensors_fingerprint(tensors) -> bytes:
    """16 bytes naming a list of tensors: their number, shapes, dtypes and exact values."""
    h = hashlib.sha256(f"{len(tensors)}".encode())
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"|{str(t.dtype)}{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()[:FINGERPRINT_BYTES]


# ------------------------------------------------------------------------------ messages


@dataclass(frozen=True)
class Hello:
    """A client joining (or rejoining): who it is and the round its replica holds."""

    client: int
    round: int = 0


@dataclass(frozen=True)
class Welcome:
    """The server's answer to a hello: the run's seed and the fingerprints the client checks."""

    seed: int
    config: bytes  # config_fingerprint of the server's ZOConfig
    init: bytes  # tensors_fingerprint of the server's x_0 (trainable tensors)



def encode_hello(msg: Hello) -> bytes:
    out = start(HELLO)
    put_varint(out, msg.client)
    put_varint(out, msg.round)
    return bytes(out)


def decode_hello(data) -> Hello:
    off = read_head(data, HELLO, "hello")
    client, off = get_varint(data, off, "hello")
    rnd, off = get_varint(data, off, "hello")
    expect_end(data, off, "hello")
    return Hello(client, rnd)


def encode_welcome(msg: Welcome) -> bytes:
    if len(msg.config) != FINGERPRINT_BYTES or len(msg.init) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprints must be {FINGERPRINT_BYTES} bytes")
    return bytes(start(WELCOME)) + int(msg.seed).to_bytes(8, "little") + msg.config + msg.init


def decode_welcome(data) -> Welcome:
    off = read_head(data, WELCOME, "welcome")
    expect_end(data, off + 8 + 2 * FINGERPRINT_BYTES, "welcome")
    seed = int.from_bytes(data[off:off + 8], "little")
    off += 8
    return Welcome(seed, bytes(data[off:off + FINGERPRINT_BYTES]),
                   bytes(data[off + FINGERPRINT_BYTES:off + 2 * FINGERPRINT_BYTES]))


def welcome_for(zo, seed: int, init_tensors) -> Welcome:
    """The server's welcome for a run of ``zo`` with run seed ``seed`` from x_0 ``init_tensors``."""
    return Welcome(seed, config_fingerprint(zo), tensors_fingerprint(init_tensors))


def check_welcome(msg: Welcome, zo, init: bytes) -> Wire:
    """The client's side of the join: the server's configuration and x_0 must be its own.
    Returns the run's :class:`Wire`; raises :class:`JoinError` (one line) otherwise."""
    mine = config_fingerprint(zo)
    if msg.config != mine:
        raise JoinError(f"join refused: the server runs another algorithm configuration (fingerprint "
                        f"{msg.config.hex()[:12]}, this client's {mine.hex()[:12]} for "
                        f"{config_blob(zo)}): every peer needs the "
                        f"same algorithm, hyper-parameters, direction family, scalar dtype and protocol version")
    if msg.init != init:
        raise JoinError(f"join refused: the server's initial model differs from this client's (fingerprint "
                        f"{msg.init.hex()[:12]} vs {init.hex()[:12]}): same model, seed and torch version needed")
    return Wire.of(zo, msg.seed)

