"""Full-model messages: what FedAvg-style baselines put on the wire (d values each way).

Downlink (server -> sampled client), little-endian::

    b"HF" u8 version u8 kind=1 u8 dtype | u32 round | u64 d | d values   (the global model)

Uplink (client -> server)::

    b"HF" u8 version u8 kind=2 u8 dtype | u32 client | u32 round | u64 d | f32 mean local loss
    d values                                                        (x_local - x_received)

``dtype`` is 1 float32, 2 float16, 3 bfloat16 (2 bytes: bfloat16's bit pattern as int16,
since numpy has no bfloat16). The vector is the trainable parameters flattened in
:func:`~hiso.core.state.trainable_params` order. A message's size is its header plus
``d * bytes_per_value``: that is what the baselines are charged per client, so the
comparison with HiSo's seeds-and-scalars counts the same thing (encoded bytes).

As in :mod:`hiso.core.messages`, a message is checked completely before anyone uses it: a
malformed, truncated, wrong-round or non-finite message raises
:class:`~hiso.core.messages.MessageError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from ..core.messages import MessageError, check_head, expect_bytes

WireDtype = Literal["float32", "float16", "bfloat16"]

MAGIC = b"HF"
VERSION = 1
DOWN, UP = 1, 2
_DOWN = struct.Struct("<2sBBBIQ")
_UP = struct.Struct("<2sBBBIIQf")
DTYPES: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3}
_NAMES = {v: k for k, v in DTYPES.items()}
BYTES_PER_VALUE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class FullDownlink:
    round: int
    model: torch.Tensor  # (d,) float32: the global model x_r


@dataclass(frozen=True)
class FullUplink:
    client: int
    round: int
    delta: torch.Tensor  # (d,) float32: x_{r,tau} - x_r as the client computed it
    loss: float


# ---------------------------------------------------------------- flat vectors

def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float32 vector of ``tensors`` in order (a copy; the inputs are not aliased)."""
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])


def unflatten(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``vec`` shaped like ``like`` (the inverse of :func:`flatten`)."""
    d = sum(t.numel() for t in like)
    if vec.numel() != d:
        raise ValueError(f"vector has {vec.numel()} values, the parameters need {d}")
    out, off = [], 0
    for t in like:
        out.append(vec[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


# ---------------------------------------------------------------- values <-> bytes

def _to_bytes(vec: torch.Tensor, dtype: str) -> bytes:
    v = vec.detach().reshape(-1).to("cpu")
    if dtype == "float32":
        return v.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()
    if dtype == "float16":
        return v.to(torch.float16).numpy().astype("<f2", copy=False).tobytes()
    if dtype == "bfloat16":
        return v.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    raise ValueError(f"unknown wire dtype {dtype!r} (choose from {', '.join(DTYPES)})")


def _from_bytes(data: bytes, dtype: str, d: int, offset: int) -> torch.Tensor:
    if dtype == "float32":
        arr = np.frombuffer(data, "<f4", d, offset).astype(np.float32)
        return torch.from_numpy(arr)
    if dtype == "float16":
        return torch.from_numpy(np.frombuffer(data, "<f2", d, offset).astype(np.float16)).to(torch.float32)
    bits = np.frombuffer(data, "<i2", d, offset).astype(np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16).to(torch.float32)


def _check_dtype(dtype: str) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"unknown wire dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def downlink_size(d: int, dtype: str = "float32") -> int:
    """Bytes of an encoded downlink (closed form, for accounting and tests)."""
    return _DOWN.size + d * BYTES_PER_VALUE[dtype]


def uplink_size(d: int, dtype: str = "float32") -> int:
    return _UP.size + d * BYTES_PER_VALUE[dtype]


# ---------------------------------------------------------------- encode / decode

def encode_downlink(msg: FullDownlink, dtype: str = "float32") -> bytes:
    code = _check_dtype(dtype)
    return _DOWN.pack(MAGIC, VERSION, DOWN, code, msg.round, msg.model.numel()) + _to_bytes(msg.model, dtype)


def encode_uplink(msg: FullUplink, dtype: str = "float32") -> bytes:
    code = _check_dtype(dtype)
    head = _UP.pack(MAGIC, VERSION, UP, code, msg.client, msg.round, msg.delta.numel(), msg.loss)
    return head + _to_bytes(msg.delta, dtype)


def _header(data, st: struct.Struct, kind: int, what: str) -> tuple:
    """The fixed header (magic, version, kind, dtype, ...): its own framing, the protocol's
    checks (:func:`~hiso.core.messages.check_head`)."""
    expect_bytes(data, what)
    if len(data) < st.size:
        raise MessageError(f"{what}: truncated header ({len(data)} < {st.size} bytes)")
    head = st.unpack_from(data, 0)
    if head[0] != MAGIC:
        raise MessageError(f"{what}: bad magic {head[0]!r}, not a hiso full-model message")
    check_head(what, head[1], head[2], want_version=VERSION, want_kind=kind, family="format")
    if head[3] not in _NAMES:
        raise MessageError(f"{what}: unknown value dtype code {head[3]}")
    return head


def _check_body(data, what: str, name: str, d: int, expect_d: int | None,
                expect_dtype: str | None, size: int) -> None:
    if expect_dtype is not None and name != expect_dtype:
        raise MessageError(f"{what}: values are {name}, expected {expect_dtype}")
    if expect_d is not None and d != expect_d:
        raise MessageError(f"{what}: {d} values, but the model has {expect_d}")
    if len(data) != size:
        raise MessageError(f"{what}: {len(data)} bytes, expected {size} (truncated or padded)")


def decode_downlink(data: bytes, *, expect_round: int | None = None, expect_d: int | None = None,
                    expect_dtype: str | None = None) -> FullDownlink:
    _, _, _, code, rnd, d = _header(data, _DOWN, DOWN, "full-model downlink")
    name = _NAMES[code]
    what = f"full-model downlink for round {rnd}"
    if expect_round is not None and rnd != expect_round:
        raise MessageError(f"{what}: expected round {expect_round}")
    _check_body(data, what, name, d, expect_d, expect_dtype, downlink_size(d, name))
    model = _from_bytes(data, name, d, _DOWN.size)
    if not bool(torch.isfinite(model).all()):
        raise MessageError(f"{what}: non-finite value in the model")
    return FullDownlink(rnd, model)


def decode_uplink(data: bytes, *, expect_round: int | None = None, expect_d: int | None = None,
                  expect_dtype: str | None = None) -> FullUplink:
    _, _, _, code, client, rnd, d, loss = _header(data, _UP, UP, "full-model uplink")
    name = _NAMES[code]
    what = f"full-model uplink from client {client}"
    if expect_round is not None and rnd != expect_round:
        raise MessageError(f"{what}: round {rnd}, but the server is in round {expect_round}")
    _check_body(data, what, name, d, expect_d, expect_dtype, uplink_size(d, name))
    delta = _from_bytes(data, name, d, _UP.size)
    if not bool(torch.isfinite(delta).all()) or not np.isfinite(loss):
        raise MessageError(f"{what}: non-finite update or loss (diverged? lower lr or server_lr)")
    return FullUplink(client, rnd, delta, float(loss))
