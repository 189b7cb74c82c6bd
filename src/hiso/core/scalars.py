"""The ZO scalars' number formats: the bytes a scalar takes on the wire and in ``history.bin``,
and the rounding both apply (float32, float16, bfloat16, int8, int4, int2, sign; and the b-bit
codes of a quantised sketch's uplink). Below both the message codec
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

``int4``, ``int2`` and ``sign`` are the same idea at 4, 2 and 1 bits (:data:`LOWBIT_DTYPES`): a
block is one row of the b-bit codes below (a float32 scale, then ceil(n b / 8) bytes); int4 and
int2 a symmetric grid (L = 7 and 1: int2 is ternary), sign the scaled sign with the block's mean
|x| as scale. Exact by construction too: encoding decoded values is the identity. They are for a
method whose server re-quantises its aggregate (the sketch's compact downlink).
"""

from __future__ import annotations

import numpy as np

from .errors import MessageError

SCALAR_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4", "int2", "sign")
# the low-bit formats: a block is one row of b-bit codes (see "b-bit codes" below): a float32
# scale, then the codes packed; int4 and int2 a symmetric grid (int2: ternary), sign the scaled sign
LOWBIT_DTYPES = {"int4": 4, "int2": 2, "sign": 1}
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
    if dtype in LOWBIT_DTYPES:
        return codes_size(1, n, LOWBIT_DTYPES[dtype])
    return n * SCALAR_BYTES[dtype]


def loss_dtype(dtype: str) -> str:
    """The format of an uplink's monitoring loss: the scalars' own, bfloat16 beside int8 codes
    (2 bytes, float32's range: a monitoring value needs no scale of its own)."""
    return "bfloat16" if _check_dtype(dtype) == "int8" or dtype in LOWBIT_DTYPES else dtype


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
    if dtype in LOWBIT_DTYPES:
        if check and not np.all(np.isfinite(x32)):
            raise FloatingPointError(f"a scalar is not finite (max |g| = {float(np.max(np.abs(x32))):.4g}): diverged")
        return encode_codes(x32.reshape(1, -1), LOWBIT_DTYPES[dtype], check=False)
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


def _int8_canonical(s: np.float32, codes: np.ndarray) -> bool:
    """Whether (scale, codes) is what :func:`_int8_encode` makes of its values: zeros with scale 0,
    or a scale of :func:`int8_scale`'s form with a code of magnitude 127 (so the block re-encodes
    to its own bytes). A non-finite scale is left to the receivers' finiteness checks."""
    top = int(np.max(np.abs(codes.astype(np.int16)))) if codes.size else 0
    if s == 0:
        return top == 0 and not np.signbit(s)
    bits = int(np.array([s], np.float32).view(np.uint32)[0])
    return top == 127 and s >= _TINY / np.float32(127) and not bits & 0x8000007F


def decode_scalars(data, off: int, n: int, dtype: str) -> np.ndarray:
    """A block of n scalars from ``data[off:]`` (``block_size(n, dtype)`` bytes) as float32
    (exact: every dtype's values are float32 values)."""
    if dtype == "int8":
        s = np.frombuffer(data, "<f4", 1, off).astype(np.float32)[0]
        codes = np.frombuffer(data, np.int8, n, off + INT8_SCALE_BYTES)
        if (np.isfinite(s) or not codes.size) and not _int8_canonical(s, codes):
            raise MessageError(f"int8 block with scale {float(s):.6g} is not one an encoder makes (the same values "
                               f"would have other bytes)")
        return codes.astype(np.float32) * s
    if dtype in LOWBIT_DTYPES:
        return decode_codes(data, off, 1, n, LOWBIT_DTYPES[dtype]).reshape(-1)
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
    per record; int8 and the low-bit blocks each carry their own scale)."""
    if _check_dtype(dtype) in SCALAR_BYTES:
        rows = [np.asarray(r, dtype=np.float32).reshape(-1) for r in rows]
        return encode_scalars(np.concatenate(rows), dtype) if rows else b""
    return b"".join(encode_scalars(r, dtype) for r in rows)


def decode_blocks(data, off: int, count: int, n: int, dtype: str) -> np.ndarray:
    """``count`` blocks of ``n`` scalars from ``data[off:]``: a (count, n) float32 array."""
    if dtype in SCALAR_BYTES:
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


# ------------------------------------------------------------------ b-bit codes, one scale a row
#
# The compact uplink of a quantised sketch (a method whose ``uplink`` is ``"codes"``): a
# (rows, cols) block of values, each row ``c * s_row`` with an integer code c on a b-bit grid,
# b in CODE_BITS. On the wire: the rows' scales (float32, little-endian, 4 bytes each), then
# the rows * cols codes (row-major) packed b bits each, least significant bit first (a code's
# bit j is bit (n b + j) % 8 of byte (n b + j) // 8 for code n), the last byte's pad bits 0.
#
# * b = 1 (scaled sign, signSGD's with an l1 scale as in EF-SGD): c in {-1, +1}, stored 1 for
#   +1 (x > 0), 0 for -1 (x <= 0, as FeedSign's signs); s = mean_j |x_j| of the row (float64,
#   rounded once to float32). Every +-s is exact, and re-encoding the decoded row gives the
#   same s (the mean of equal values is that value).
# * b = 2, 4, 8 (symmetric uniform grid): c in [-L, L], L = 2^(b-1) - 1 (1, 7, 127), stored
#   offset as c + L (the top code 2^b - 1 is invalid); s = max_j |x_j| / L rounded *up* to 17
#   significant bits (as int8's), c = clip(rint(x / s), -L, L): c s is exact in float32 and the
#   largest |c| is L, so re-encoding the decoded row gives the same s and codes.
#
# A row below 2^-100 everywhere has s = 0 (its values decode to +-0).

CODE_BITS = (1, 2, 4, 8)
CODE_SCALE_BYTES = 4


def _check_bits(bits: int) -> int:
    if bits not in CODE_BITS:
        raise ValueError(f"code bits must be one of {CODE_BITS}, got {bits!r}")
    return bits


def codes_size(rows: int, cols: int, bits: int) -> int:
    """Bytes of a (rows, cols) block of b-bit codes with one scale a row."""
    return rows * CODE_SCALE_BYTES + (rows * cols * _check_bits(bits) + 7) // 8


def _grid_scale(m: np.float32, L: int) -> np.float32:
    """max |x| / L rounded up to 17 significant bits (0 below 2^-100; m itself if not finite)."""
    if not np.isfinite(m):
        return m
    if m < _TINY:
        return np.float32(0)
    s = np.array([m / np.float32(L)], dtype=np.float32).view(np.uint32)
    s = (s + np.uint32(0x7F)) & np.uint32(0xFFFFFF80)
    return s.view(np.float32)[0]


def row_codes(x, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The scales (rows,) float32 and integer codes (rows, cols) int16 of a (rows, cols) block."""
    x32 = np.asarray(x, dtype=np.float32)
    if x32.ndim != 2:
        raise ValueError(f"codes are for a (rows, cols) block, got shape {x32.shape}")
    rows, cols = x32.shape
    scales = np.zeros(rows, np.float32)
    codes = np.zeros((rows, cols), np.int16)
    if _check_bits(bits) == 1:
        with np.errstate(invalid="ignore", over="ignore"):
            for r in range(rows):
                m = np.float32(np.mean(np.abs(x32[r].astype(np.float64)))) if cols else np.float32(0)
                scales[r] = m if (not np.isfinite(m) or m >= _TINY) else np.float32(0)
        codes[:] = np.where(x32 > 0, 1, -1)
        return scales, codes
    L = 2 ** (bits - 1) - 1
    for r in range(rows):
        s = _grid_scale(np.float32(np.max(np.abs(x32[r]))) if cols else np.float32(0), L)
        scales[r] = s
        if s != 0 and np.isfinite(s):
            codes[r] = np.clip(np.rint(x32[r] / s), -L, L).astype(np.int16)
    return scales, codes


def codes_values(scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The float32 values c * s of a block (exact in float32)."""
    return (codes.astype(np.float32) * np.asarray(scales, np.float32)[:, None]).astype(np.float32)


def quantize_rows(x, bits: int) -> np.ndarray:
    """The float32 values ``x`` (rows, cols) becomes in b-bit codes: what a client sends."""
    return codes_values(*row_codes(x, bits))


def encode_codes(x, bits: int, check: bool = True) -> bytes:
    """A (rows, cols) block as its scales and packed b-bit codes. With ``check`` the values
    must already be on their grid (``quantize_rows``' output: nothing is rounded on the wire)
    and finite; without (a simulated attacker or a lost answer's size), they are quantised."""
    x32 = np.asarray(x, dtype=np.float32)
    scales, codes = row_codes(x32, bits)
    if check:
        if not np.all(np.isfinite(scales)):
            raise FloatingPointError("a sketch value is not finite: diverged (lower lr)")
        if not np.array_equal(codes_values(scales, codes), x32):
            raise ValueError(f"values are not on their {bits}-bit grid (quantise them with quantize_rows first)")
    scales = np.where(np.isfinite(scales), scales, np.float32(0)) if not check else scales
    u = (codes > 0).astype(np.uint8) if bits == 1 else (codes + (2 ** (bits - 1) - 1)).astype(np.uint8)
    planes = ((u.reshape(-1, 1) >> np.arange(bits, dtype=np.uint8)) & 1).astype(np.uint8)
    return scales.astype("<f4").tobytes() + np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def decode_codes(data, off: int, rows: int, cols: int, bits: int) -> np.ndarray:
    """A (rows, cols) float32 block from ``data[off:]`` (``codes_size`` bytes). A scale that is
    negative or not finite, an invalid code (2^b - 1 for b > 1) or a set pad bit: ValueError."""
    scales = np.frombuffer(data, "<f4", rows, off).astype(np.float32)
    if not (np.all(np.isfinite(scales)) and np.all(scales >= 0)):
        raise ValueError("codes: a row's scale is negative or not finite")
    n = rows * cols
    nb = (n * _check_bits(bits) + 7) // 8
    raw = np.frombuffer(data, np.uint8, nb, off + rows * CODE_SCALE_BYTES)
    allbits = np.unpackbits(raw, bitorder="little")
    if allbits[n * bits:].any():
        raise ValueError("codes: pad bits are set")
    u = (allbits[:n * bits].reshape(n, bits).astype(np.int16) << np.arange(bits, dtype=np.int16)).sum(axis=1)
    if bits == 1:
        codes = np.where(u == 1, 1, -1).astype(np.int16)
    else:
        L = 2 ** (bits - 1) - 1
        if np.any(u > 2 * L):
            raise ValueError(f"codes: an invalid {bits}-bit code")
        codes = (u - L).astype(np.int16)
    return codes_values(scales, codes.reshape(rows, cols))
