"""The ZO scalars' number formats: the bytes a scalar takes on the wire and in ``history.bin``,
and the rounding both apply (float32, float16, bfloat16, int8). Below both the message codec
(:mod:`hiso.core.messages`) and the log (:mod:`hiso.core.history`), which each encode scalars.

A *block* is the scalars one call encodes: one message's (an uplink's tau*P), or one history
record's. The float formats are fixed-width (``n`` scalars take ``n * SCALAR_BYTES`` bytes).
``int8`` is symmetric 8-bit quantisation with one scale per block: a float32 scale ``s`` (4
bytes, little-endian) and ``n`` int8 codes ``c_j = clip(rint(x_j / s), -127, 127)``, which
decode to ``float32(c_j) * s``. ``s`` is max_j |x_j| / 127 in float32, rounded *up* to 17
significant bits (its low 7 mantissa bits cleared), so that

* every ``c_j * s`` is exact in float32 (7 + 17 bits): the decoded values are the same numbers
  on every machine, whatever its arithmetic;
* re-encoding decoded values gives the same scale and codes (the largest code is +-127 and
  ``127 s / 127 = s`` exactly): the server's logged aggregate, re-sent in a downlink or written
  to ``history.bin``, is the value every replica applied. Exact by construction, as float16.

A block whose largest |x| is below 2^-100 is encoded as zeros (scale 0). The uplink's
monitoring loss travels beside the int8 block as a bfloat16 (:func:`loss_dtype`).
"""

from __future__ import annotations

import numpy as np

SCALAR_DTYPES = ("float32", "float16", "bfloat16", "int8")
SCALAR_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # the fixed-width formats
INT8_SCALE_BYTES = 4  # an int8 block's float32 scale
_TINY = np.float32(2.0 ** -100)  # an int8 block below this everywhere is zeros


def _check_dtype(dtype: str) -> str:
    if dtype not in SCALAR_DTYPES:
        raise ValueError(f"unknown scalar dtype {dtype!r} (choose from {', '.join(SCALAR_DTYPES)})")
    return dtype


def block_size(n: int, dtype: str) -> int:
    """Bytes of a block of ``n`` scalars in ``dtype`` (int8: the scale and n codes)."""
    if _check_dtype(dtype) == "int8":
        return INT8_SCALE_BYTES + n
    return n * SCALAR_BYTES[dtype]


def loss_dtype(dtype: str) -> str:
    """The format of an uplink's monitoring loss: the scalars' own, bfloat16 beside int8 codes
    (2 bytes, float32's range: a monitoring value needs no scale of its own)."""
    return "bfloat16" if _check_dtype(dtype) == "int8" else dtype


def int8_scale(x32: np.ndarray) -> np.float32:
    """The block's scale: max |x| / 127 in float32, rounded up to 17 significant bits (0 for a
    block below 2^-100; not finite for a block that is not)."""
    m = np.float32(np.max(np.abs(x32))) if x32.size else np.float32(0)
    if not np.isfinite(m):
        return m
    if m < _TINY:
        return np.float32(0)
    s = np.array([m / np.float32(127)], dtype=np.float32).view(np.uint32)
    s = (s + np.uint32(0x7F)) & np.uint32(0xFFFFFF80)  # ceil to 17 significant bits (s > 0, normal)
    return s.view(np.float32)[0]


def _int8_encode(x32: np.ndarray) -> bytes:
    s = int8_scale(x32)
    if s == 0 or not np.isfinite(s):  # zeros, or an unencodable block the receiver refuses
        codes = np.zeros(x32.size, np.int8)
    else:
        codes = np.clip(np.rint(x32 / s), -127, 127).astype(np.int8)
    return np.array([s], "<f4").tobytes() + codes.tobytes()


def _bf16_bits(x32: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits, rounded to nearest even; a NaN stays a (quiet) NaN: rounding its
    payload could carry into the exponent and sign and make it a zero."""
    u = x32.view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    nan = np.isnan(x32)
    if nan.any():
        out[nan] = ((u[nan] >> 16) & 0x8000 | 0x7FC0).astype(np.uint16)
    return out


def encode_scalars(x, dtype: str, check: bool = True) -> bytes:
    """Scalars in the wire's dtype (rounded to nearest). A value that is not finite there
    (overflow, e.g. |g| > 65504 in float16) raises FloatingPointError, unless ``check`` is
    False (a simulated attacker, whose bytes the receiver must then refuse)."""
    x32 = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1))
    if _check_dtype(dtype) == "int8":
        data = _int8_encode(x32)
        if check and not (np.all(np.isfinite(x32)) and np.isfinite(int8_scale(x32))):
            raise FloatingPointError(f"a scalar is not finite (max |g| = {float(np.max(np.abs(x32))):.4g}): diverged")
        return data
    if dtype == "float32":
        raw = x32.astype("<f4")
    elif dtype == "float16":
        with np.errstate(over="ignore"):
            raw = x32.astype("<f2")
    else:
        raw = _bf16_bits(x32).astype("<u2")
    back = decode_scalars(raw.tobytes(), 0, x32.size, dtype)
    if check and not np.all(np.isfinite(back)):
        raise FloatingPointError(f"a scalar is not finite in {dtype} (max |g| = {float(np.max(np.abs(x32))):.4g}): "
                                 f"diverged, or use --scalar-dtype float32 / bfloat16")
    return raw.tobytes()


def decode_scalars(data, off: int, n: int, dtype: str) -> np.ndarray:
    """A block of n scalars from ``data[off:]`` (``block_size(n, dtype)`` bytes) as float32
    (exact: every dtype's values are float32 values)."""
    if dtype == "int8":
        s = np.frombuffer(data, "<f4", 1, off).astype(np.float32)[0]
        return np.frombuffer(data, np.int8, n, off + INT8_SCALE_BYTES).astype(np.float32) * s
    if dtype == "float32":
        return np.frombuffer(data, "<f4", n, off).astype(np.float32)
    if dtype == "float16":
        return np.frombuffer(data, "<f2", n, off).astype(np.float32)
    bits = np.frombuffer(data, "<u2", n, off).astype(np.uint32) << 16
    return bits.view(np.float32).copy()


def quantize(x, dtype: str) -> np.ndarray:
    """The float32 array of the values ``x`` becomes on the wire in ``dtype`` (x rounded to
    float32 first). The server logs its aggregate through this, so what it logs is what it sends."""
    x32 = np.asarray(x, dtype=np.float32)
    if _check_dtype(dtype) == "float32":
        return x32.copy()
    return decode_scalars(encode_scalars(x32, dtype), 0, x32.size, dtype).reshape(x32.shape)


def encode_blocks(rows, dtype: str) -> bytes:
    """Records' scalars, one block each (for a float dtype: the same bytes as one block of all,
    which is how they are encoded: a client thousands of rounds behind costs one call, not one
    per record; int8 blocks each carry their own scale)."""
    if _check_dtype(dtype) != "int8":
        rows = [np.asarray(r, dtype=np.float32).reshape(-1) for r in rows]
        return encode_scalars(np.concatenate(rows), dtype) if rows else b""
    return b"".join(encode_scalars(r, dtype) for r in rows)


def decode_blocks(data, off: int, count: int, n: int, dtype: str) -> np.ndarray:
    """``count`` blocks of ``n`` scalars from ``data[off:]``: a (count, n) float32 array."""
    if dtype != "int8":
        return decode_scalars(data, off, count * n, dtype).reshape(count, n)
    step = block_size(n, dtype)
    out = np.empty((count, n), np.float32)
    for j in range(count):
        out[j] = decode_scalars(data, off + j * step, n, dtype)
    return out


def packed_signs_size(n: int) -> int:
    """Bytes of n packed signs (the one-bit uplink format, FeedSign's)."""
    return (n + 7) // 8


def pack_signs(s) -> bytes:
    """Signs (+1 / -1; anything > 0 counts as +1) to bytes, 8 per byte, least significant bit first."""
    bits = (np.asarray(s, dtype=np.float32).reshape(-1) > 0).astype(np.uint8)
    return np.packbits(bits, bitorder="little").tobytes()


def unpack_signs(data, off: int, n: int) -> np.ndarray:
    """n signs (float32 +1 / -1) from ``data[off:]``; set pad bits are an error (ValueError)."""
    raw = np.frombuffer(data, np.uint8, packed_signs_size(n), off)
    bits = np.unpackbits(raw, bitorder="little")
    if bits[n:].any():
        raise ValueError("packed signs: pad bits are set")
    return np.where(bits[:n] == 1, np.float32(1), np.float32(-1)).astype(np.float32)
