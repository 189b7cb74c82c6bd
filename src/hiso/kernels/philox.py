"""Philox4x32-10 (Salmon et al., SC'11; Random123) and the element transforms of the Philox
direction families, in three implementations that give the same bits:

* :func:`philox4x32_10`: the reference, plain Python integers, one block at a time (the
  known-answer tests check it against Random123's published vectors);
* :func:`values_torch`: torch int64 tensor operations on any device (the CPU path when numba
  is missing, the GPU path when Triton is); every product is split so it stays below 2^63, so
  no integer operation overflows on any device;
* :mod:`hiso.kernels.philox_numba`: fused multi-threaded CPU kernels (numba);
* :mod:`hiso.kernels.philox_triton`: fused CUDA kernels (Triton).

The float32 values are integer functions of the generator's output (a sign, or a table entry
selected by 16 bits), and what is done with them afterwards (scale, H^{-1/2}, add, sum over p)
uses only IEEE-754 binary32 ``+``, ``*``, ``/`` and ``sqrt``, each rounded once to nearest
(no fused multiply-add, no approximate reciprocal square root): these are correctly rounded on
every IEEE CPU and on CUDA at its default precision, so every implementation gives the same
bits on every device. See :mod:`hiso.core.directions` for the definition.
"""

from __future__ import annotations

import hashlib
import statistics
from functools import lru_cache

import numpy as np
import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
ROUNDS = 10
MASK32 = 0xFFFFFFFF

# elements produced by one Philox block (4 x 32 bits) in each family
PER_BLOCK = {"philox-rademacher": 128, "philox-gaussian": 8}
CHUNK = 1 << 18  # elements the torch path materialises at a time on the CPU (a multiple of 128)
GPU_CHUNK = 1 << 22  # on a GPU: ~100 small kernels per chunk, so fewer, larger chunks (32 MB int64 temporaries)


def _chunk(device: torch.device) -> int:
    return CHUNK if device.type == "cpu" else GPU_CHUNK


def philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32 with 10 rounds on one 128-bit counter and a 64-bit key (Random123's order)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def key_of(seed: int) -> tuple[int, int]:
    """The Philox key of a 64-bit direction seed: its low and high 32-bit words."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"direction seeds are unsigned 64-bit integers, got {seed}")
    return seed & MASK32, seed >> 32


# The Gaussian family's table: T[u] = c * Phi^{-1}((u + 1/2) / 2^16) for u >= 2^15, T[u] = -T[2^16-1-u]
# below (exactly symmetric), c making the mean of the squares 1 (in float64), then rounded to
# float32. Computed with Python's statistics.NormalDist (float64); the digest pins the result,
# so a platform whose libm rounded one entry differently would refuse to run, not drift.
TABLE_SHA256 = "8babbcaf96568f10165a1eab530c0e5c92d04de96761b6dbb3dadfa94baba37f"


def _table_digest(t: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(t, dtype="<f4").tobytes()).hexdigest()


@lru_cache(maxsize=None)
def gaussian_table() -> np.ndarray:
    """The 65,536-entry float32 inverse-CDF table of the ``philox-gaussian`` family (read-only)."""
    nd = statistics.NormalDist()
    upper = np.array([nd.inv_cdf((u + 0.5) / 65536.0) for u in range(32768, 65536)], dtype=np.float64)
    upper *= 1.0 / np.sqrt(np.mean(upper * upper))
    t = np.concatenate([-upper[::-1], upper]).astype(np.float32)
    if _table_digest(t) != TABLE_SHA256:
        raise RuntimeError("the philox-gaussian table computed on this platform differs from the protocol's "
                           f"(sha256 {_table_digest(t)}); use --directions philox-rademacher")
    t.setflags(write=False)
    return t


@lru_cache(maxsize=None)
@lru_cache(maxsize=None)
def _table_on(device: str) -> torch.Tensor:
    return torch.from_numpy(gaussian_table().copy()).to(device)


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of m * x for m < 2^32 and int64 x in [0, 2^32), no overflow."""
    pa = (x >> 16) * m                       # < 2^48
    mid = (x & 0xFFFF) * m + ((pa & 0xFFFF) << 16)  # < 2^49
    return (pa >> 16) + (mid >> 32), mid & MASK32


def philox_torch(ctr: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding 32-bit counter words (any device, no overflow)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def words_torch(seed: int, index: int, first_block: int, n_blocks: int, device) -> torch.Tensor:
    """Philox output of blocks first_block .. first_block + n_blocks - 1 as int64 (n_blocks, 4)."""
    b = torch.arange(first_block, first_block + n_blocks, dtype=torch.int64, device=device)
    ctr = [b & MASK32, b >> 32, torch.full_like(b, index & MASK32), torch.zeros_like(b)]
    return torch.stack(philox_torch(ctr, key_of(seed)), dim=1)


def values_torch(family: str, seed: int, index: int, start: int, count: int, device) -> torch.Tensor:
    """Direction elements start .. start + count - 1 of tensor ``index`` (float32, on ``device``).

    ``start`` must be a multiple of the family's elements per block.
    """
    per = PER_BLOCK[family]
    if start % per:
        raise ValueError(f"start {start} is not a multiple of {per}")
    n_blocks = -(-count // per)
    w = words_torch(seed, index, start // per, n_blocks, device)
    if family == "philox-rademacher":
        shifts = torch.arange(32, dtype=torch.int64, device=device)
        bits = (w.unsqueeze(-1) >> shifts) & 1                 # element 128 b + 32 k + t: bit t of word k
        z = (1 - 2 * bits).reshape(-1).to(torch.float32)
    else:
        shifts = torch.tensor([0, 16], dtype=torch.int64, device=device)
        half = ((w.unsqueeze(-1) >> shifts) & 0xFFFF).reshape(-1)  # element 8 b + 2 k + h: half h of word k
        z = _table_on(str(torch.device(device)))[half]
    return z[:count]


def _rsqrt_exact(h: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(h) in binary32 with sqrt and the division each correctly rounded.

    Not torch.rsqrt (approximate on CUDA) nor torch.sqrt on float32 (not correctly rounded on
    the CPU: it differs from IEEE sqrt in about 1 element in 5, measured with torch 2.13): the
    square root is taken in float64 and rounded to float32, which is the correctly rounded
    float32 square root (a float32's square root is never within 2^-49 relative of a float32
    rounding boundary, and float64 sqrt is accurate to 2^-52).
    """
    return torch.sqrt(h.double()).float().reciprocal_()


def shift_torch(family: str, out: torch.Tensor, x: torch.Tensor, seed: int, index: int, scale: float,
                h: torch.Tensor | None, delta: torch.Tensor | None) -> torch.Tensor:
    """out = (x [+ delta]) + (z [* H^{-1/2}]) * scale, chunk by chunk, float32, on x's device."""
    s = float(np.float32(scale))
    of, xf = out.view(-1), x.reshape(-1)
    df = None if delta is None else delta.reshape(-1)
    hf = None if h is None else h.reshape(-1)
    n, step = of.numel(), _chunk(of.device)
    for a in range(0, n, step):
        b = min(a + step, n)
        z = values_torch(family, seed, index, a, b - a, of.device)
        if hf is not None:
            z.mul_(_rsqrt_exact(hf[a:b]))
        z.mul_(s)
        o = of[a:b]
        o.copy_(xf[a:b])
        if df is not None:
            o.add_(df[a:b])
        o.add_(z)
    return out


def combine_torch(family: str, out: torch.Tensor, seeds: list[int], coefs: np.ndarray, index: int,
                  h: torch.Tensor | None) -> torch.Tensor:
    """out = (sum_p z_p * c_p, in order from 0) [* H^{-1/2}], float32, chunk by chunk."""
    of = out.view(-1)
    hf = None if h is None else h.reshape(-1)
    n = of.numel()
    cs = [float(c) for c in np.asarray(coefs, dtype=np.float32)]
    step = _chunk(of.device)
    for a in range(0, n, step):
        b = min(a + step, n)
        o = of[a:b].zero_()
        for s, c in zip(seeds, cs):
            o.add_(values_torch(family, s, index, a, b - a, of.device).mul_(c))
        if hf is not None:
            o.mul_(_rsqrt_exact(hf[a:b]))
    return out
