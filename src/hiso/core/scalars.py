"""The ZO scalars' number formats: the bytes a scalar takes on the wire and in ``history.bin``,
and the rounding both apply (float32, float16, bfloat16). Below both the message codec
(:mod:`hiso.core.messages`) and the log (:mod:`hiso.core.history`), which each encode scalars."""

from __future__ import annotations

import numpy as np

SCALAR_DTYPES = ("float32", "float16", "bfloat16")
SCALAR_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _check_dtype(dtype: str) -> str:
    if dtype not in SCALAR_BYTES:
        raise ValueError(f"unknown scalar dtype {dtype!r} (choose from {', '.join(SCALAR_DTYPES)})")
    return dtype


def _bf16_bits(x32: np.ndarray) -> np.ndarray:
    u = x32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def encode_scalars(x, dtype: str, check: bool = True) -> bytes:
    """Scalars in the wire's dtype (rounded to nearest). A value that is not finite there
    (overflow, e.g. |g| > 65504 in float16) raises FloatingPointError, unless ``check`` is
    False (a simulated attacker, whose bytes the receiver must then refuse)."""
    x32 = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1))
    if _check_dtype(dtype) == "float32":
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
    """n scalars from ``data[off:]`` as float32 (exact: every dtype's values are float32 values)."""
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
