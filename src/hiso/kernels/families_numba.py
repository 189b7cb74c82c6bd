"""CPU kernels (numba) of the structured families' Philox streams: the same integers as
:func:`hiso.core.families._words` computes with torch, without torch's per-operation overhead
(which dominates for the small tensors of a CNN). Only integer work and the choice of a float32
constant happen here, so the values are the torch path's bit for bit."""

from __future__ import annotations

import numpy as np
from numba import njit

from .philox_numba import philox

U = np.uint64
MASK, S32, ONE, H16 = U(0xFFFFFFFF), U(32), U(1), U(0xFFFF)


@njit(cache=True)
def _sign_word(out, j0, w, n):
    for t in range(32):
        j = j0 + t
        if j < n:
            out[j] = np.float32(1.0) if ((w >> U(t)) & ONE) == U(0) else np.float32(-1.0)


@njit(cache=True)
def signs(out, k0, k1, idx, stream):
    """out[j] = element j of a Rademacher stream (float32 +-1)."""
    n = out.size
    for b in range((n + 127) // 128):
        bb = U(b)
        w0, w1, w2, w3 = philox(bb & MASK, bb >> S32, idx, stream, k0, k1)
        _sign_word(out, 128 * b, w0, n)
        _sign_word(out, 128 * b + 32, w1, n)
        _sign_word(out, 128 * b + 64, w2, n)
        _sign_word(out, 128 * b + 96, w3, n)


@njit(cache=True)
def _sparse_word(out, j0, w, n, T, c):
    for h in range(2):
        j = j0 + h
        if j < n:
            v = (w >> U(16 * h)) & H16
            if (v >> ONE) >= T:
                out[j] = np.float32(0.0)
            elif (v & ONE) == U(0):
                out[j] = c
            else:
                out[j] = -c


@njit(cache=True)
def sparse(out, k0, k1, idx, stream, T, c):
    """out[j] = element j of the sparse family (see hiso.core.families)."""
    n = out.size
    for b in range((n + 7) // 8):
        bb = U(b)
        w0, w1, w2, w3 = philox(bb & MASK, bb >> S32, idx, stream, k0, k1)
        _sparse_word(out, 8 * b, w0, n, T, c)
        _sparse_word(out, 8 * b + 2, w1, n, T, c)
        _sparse_word(out, 8 * b + 4, w2, n, T, c)
        _sparse_word(out, 8 * b + 6, w3, n, T, c)
