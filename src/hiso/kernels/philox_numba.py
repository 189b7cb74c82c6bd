"""Fused multi-threaded CPU kernels of the Philox direction families (numba, compiled on first use
and cached on disk).

They compute exactly what :mod:`hiso.kernels.philox`'s torch functions compute, element by
element: the same Philox4x32-10 words, the same sign or table transform, the same binary32
operations in the same order (numba does not fuse multiply-adds unless asked to with
``fastmath``, which is not used here). Each kernel produces a direction element where it is
used: a 128-element block of z lives in a thread's scratch, never in a tensor-sized buffer.
Work is split over numba threads in chunks of CH elements.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

U = np.uint64
U32 = np.uint32
M0, M1 = U(0xD2511F53), U(0xCD9E8D57)
W0, W1 = U(0x9E3779B9), U(0xBB67AE85)
MASK, S16, S32, ONE, H16 = U(0xFFFFFFFF), U(16), U(32), U(1), U(0xFFFF)
CH = 1 << 16  # elements per parallel work item (a multiple of 128)
RADEMACHER, GAUSSIAN = 0, 1


@njit(inline="always")
def philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 words holding 32-bit values."""
    for r in range(10):
        if r:
            k0 = (k0 + W0) & MASK
            k1 = (k1 + W1) & MASK
        p0 = M0 * c0
        p1 = M1 * c2
        c0, c1, c2, c3 = ((p1 >> S32) ^ c1 ^ k0), (p1 & MASK), ((p0 >> S32) ^ c3 ^ k1), (p0 & MASK)
    return c0, c1, c2, c3


@njit(inline="always")
def _signs(z, off, w):
    """z[off + t] = the binary32 bits of +1 (bit t of w is 0) or -1 (it is 1), t < 32."""
    for t in range(32):
        z[off + t] = U32(0x3F800000) | (U32((w >> U(t)) & ONE) << U32(31))


@njit(inline="always")
def _gen128(z, off, fam, table, blk, k0, k1, idx):
    """z[off:off+128] = binary32 bits of elements 128 blk .. 128 blk + 127 (key k0, k1; tensor idx).

    ``z`` and ``table`` are uint32 views (bit patterns), so this part is integer-only.
    """
    if fam == RADEMACHER:
        w0, w1, w2, w3 = philox(blk & MASK, blk >> S32, idx, U(0), k0, k1)
        _signs(z, off, w0)
        _signs(z, off + 32, w1)
        _signs(z, off + 64, w2)
        _signs(z, off + 96, w3)
    else:
        for q in range(16):
            g = blk * U(16) + U(q)
            w0, w1, w2, w3 = philox(g & MASK, g >> S32, idx, U(0), k0, k1)
            o = off + 8 * q
            z[o] = table[w0 & H16]
            z[o + 1] = table[w0 >> S16]
            z[o + 2] = table[w1 & H16]
            z[o + 3] = table[w1 >> S16]
            z[o + 4] = table[w2 & H16]
            z[o + 5] = table[w2 >> S16]
            z[o + 6] = table[w3 & H16]
            z[o + 7] = table[w3 >> S16]


@njit(parallel=True, cache=True)
def fill(out, fam, table, k0, k1, idx):
    """out (a uint32 view of float32) = the direction's elements; full blocks written in place."""
    n = out.size
    for c in prange((n + CH - 1) // CH):
        z = np.empty(128, np.uint32)
        a = c * CH
        e = min(a + CH, n)
        for base in range(a, e, 128):
            if base + 128 <= e:
                _gen128(out, base, fam, table, U(base // 128), k0, k1, idx)
            else:
                _gen128(z, 0, fam, table, U(base // 128), k0, k1, idx)
                for t in range(e - base):
                    out[base + t] = z[t]


@njit(parallel=True, cache=True)
def shift(out, x, d, h, has_d, has_h, s, fam, table, k0, k1, idx):
    """out = (x [+ d]) + (z [* (1 / sqrt(h))]) * s."""
    n = out.size
    one = np.float32(1.0)
    for c in prange((n + CH - 1) // CH):
        zu = np.empty(128, np.uint32)
        z = zu.view(np.float32)
        a = c * CH
        e = min(a + CH, n)
        for base in range(a, e, 128):
            _gen128(zu, 0, fam, table, U(base // 128), k0, k1, idx)
            m = min(128, e - base)
            if has_h:
                for t in range(m):
                    z[t] = z[t] * (one / np.sqrt(h[base + t]))
            if has_d:
                for t in range(m):
                    out[base + t] = (x[base + t] + d[base + t]) + z[t] * s
            else:
                for t in range(m):
                    out[base + t] = x[base + t] + z[t] * s


@njit(parallel=True, cache=True)
def combine(out, h, has_h, k0s, k1s, coefs, fam, table, idx):
    """out = (sum_p z_p * coefs[p], p in order, from 0) [* (1 / sqrt(h))]."""
    n = out.size
    P = coefs.size
    one = np.float32(1.0)
    for c in prange((n + CH - 1) // CH):
        zu = np.empty(128, np.uint32)
        z = zu.view(np.float32)
        acc = np.empty(128, np.float32)
        a = c * CH
        e = min(a + CH, n)
        for base in range(a, e, 128):
            for t in range(128):
                acc[t] = np.float32(0.0)
            for p in range(P):
                _gen128(zu, 0, fam, table, U(base // 128), k0s[p], k1s[p], idx)
                cp = coefs[p]
                for t in range(128):
                    acc[t] = acc[t] + z[t] * cp
            m = min(128, e - base)
            if has_h:
                for t in range(m):
                    out[base + t] = acc[t] * (one / np.sqrt(h[base + t]))
            else:
                for t in range(m):
                    out[base + t] = acc[t]


def set_threads(n: int) -> None:
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
