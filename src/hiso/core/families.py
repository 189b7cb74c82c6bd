"""Structured direction families: sparse and low-rank directions, each a pure function of
(seed, tensor index, shape), exact under replay on every device.

A family with parameters is named by a **spec** string, recorded in ``config.json`` (as
``directions`` plus its ``direction_*`` options), in history.bin's header and in the join
fingerprint (``ZOConfig.directions``): ``sparse:q=<density>`` or ``lowrank:r=<rank>``.

Both draw their bits from Philox4x32-10 with key ``(s mod 2^32, s div 2^32)`` as the dense
families do (:mod:`hiso.core.directions`), with the counter's last word naming the stream, so
they never reuse the dense family's bits: block ``b`` of stream ``c`` of tensor ``i`` is the
output for counter ``(b mod 2^32, b div 2^32, i, c)``. A *Rademacher stream* gives element
``j = 128 b + 32 k + t`` = +1 if bit t of word k is 0, else -1 (the dense family's rule).

``sparse:q=Q`` (stream 1): element ``j = 8 b + 2 k + h`` takes the 16-bit half ``v`` (low for
h = 0) of word ``k`` of block ``b``; it is nonzero iff ``v >> 1 < T`` with
``T = round(Q 2^15)`` (1 <= T <= 2^15), and then ``+c`` if ``v`` is even, ``-c`` if odd, with
``c = float32(1 / sqrt(T / 2^15))``. So each coordinate is in the seed's subset with
probability ``q = T / 2^15`` independently, and ``E[u u^T] = q c^2 I = I`` (up to the rounding
of c, relative 2^-24): the same scale as a dense direction, so mu and lr keep their meaning.
A fresh subset per seed, i.e. per (round, step, perturbation).

``lowrank:r=R``: a tensor of two or more dimensions is read as an ``m x n`` matrix
(``m = shape[0]``, ``n`` the rest, row-major, so a conv kernel's rows are its output
channels); ``U`` (m x R, stream 2) and ``V`` (n x R, stream 3) are Rademacher streams read
row-major, and ``u[i, j] = float32(S[i, j] * c)`` with ``S = sum_{l < R} U[i, l] V[j, l]`` and
``c = float32(1 / sqrt(R))``. Each term is +-1 and every partial sum is an integer of size at
most R, exact in binary32, so S is the same integer on every device whatever the order; it
is still accumulated elementwise, l = 0, 1, ..., never by a matrix product, and one rounding
(the product by c) makes u. ``E[u u^T] = I`` exactly in real arithmetic (the R products
U[i,l] V[j,l] are independent signs). One-dimensional tensors (biases) keep the dense
``philox-rademacher`` direction, the same bits as that family.

What a round does with these directions (shift, replay) is the arithmetic of the dense
families, operation for operation (:func:`hiso.kernels.philox.shift_torch`, ``combine_torch``),
with torch elementwise ops on the tensor's device; the direction is materialised one tensor
at a time (no fused kernel yet). On the CPU the Philox bits come from small numba kernels
(:mod:`hiso.kernels.families_numba`), elsewhere from torch's integer ops: the same integers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels import philox

STRUCTURED = {
    "sparse": "a seeded random subset of a q share of the coordinates, signs scaled by 1/sqrt(q) (E[u u^T] = I)",
    "lowrank": "per weight matrix U V^T / sqrt(r), U and V random signs (E[u u^T] = I); vectors stay dense",
}
SPARSE_STREAM, U_STREAM, V_STREAM = 1, 2, 3


def spec(name: str, density: float | None = None, rank: int | None = None) -> str:
    """The spec string of a family and its options (a dense family's name is its spec)."""
    if name == "sparse":
        return f"sparse:q={float(density if density is not None else 0.1)!r}"
    if name == "lowrank":
        return f"lowrank:r={int(rank if rank is not None else 1)}"
    return name


def parse(text: str):
    """The family object of a spec, or of a bare name with its defaults (ValueError if malformed)."""
    if text in STRUCTURED:
        text = spec(text)
    name, _, arg = text.partition(":")
    try:
        if name == "sparse" and arg.startswith("q="):
            return Sparse(float(arg[2:]))
        if name == "lowrank" and arg.startswith("r="):
            return LowRank(int(arg[2:]))
    except ValueError as e:
        raise ValueError(f"bad direction family {text!r}: {e}") from None
    raise ValueError(f"bad direction family {text!r} (sparse:q=Q or lowrank:r=R)")


def _words(seed: int, index: int, stream: int, first: int, n: int, device) -> torch.Tensor:
    """Philox output of blocks first .. first+n-1 of ``stream`` of tensor ``index``: int64 (n, 4)."""
    b = torch.arange(first, first + n, dtype=torch.int64, device=device)
    ctr = [b & philox.MASK32, b >> 32, torch.full_like(b, index & philox.MASK32), torch.full_like(b, stream)]
    return torch.stack(philox.philox_torch(ctr, philox.key_of(int(seed))), dim=1)


_NB: list = []


def _numba(device):
    """The numba kernels (hiso.kernels.families_numba) for CPU tensors, or None (then torch's ops)."""
    if torch.device(device).type != "cpu":
        return None
    if not _NB:
        try:
            from ..kernels import families_numba as _families_numba
        except ImportError:  # pragma: no cover - numba is a dependency
            _families_numba = None
        _NB.append(_families_numba)
    return _NB[0]


def _key(seed: int) -> tuple[np.uint64, np.uint64]:
    k0, k1 = philox.key_of(int(seed))
    return np.uint64(k0), np.uint64(k1)


def _signs(seed: int, index: int, stream: int, count: int, device) -> torch.Tensor:
    """Elements 0 .. count-1 of a Rademacher stream (float32 +-1)."""
    nb = _numba(device)
    if nb is not None:
        out = np.empty(count, np.float32)
        nb.signs(out, *_key(seed), np.uint64(index), np.uint64(stream))
        return torch.from_numpy(out)
    w = _words(seed, index, stream, 0, -(-count // 128), device)
    bits = (w.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64, device=device)) & 1
    return (1 - 2 * bits).reshape(-1)[:count].to(torch.float32)


class _Family:
    def values(self, seed: int, index: int, shape: torch.Size, device) -> torch.Tensor:
        raise NotImplementedError

    def shift(self, out: torch.Tensor, x: torch.Tensor, seed: int, index: int, scale: float,
              h: torch.Tensor | None, delta: torch.Tensor | None) -> torch.Tensor:
        """out = (x [+ delta]) + (z [* H^{-1/2}]) * scale (shift_torch's operations and order)."""
        if x.dtype != torch.float32:  # the float32 value, rounded once to x's dtype
            tmp = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            return out.copy_(self.shift(tmp, x.float(), seed, index, scale, h, delta))
        z = self.values(seed, index, x.shape, x.device)
        if h is not None:
            z.mul_(philox._rsqrt_exact(h.reshape(-1)))
        z.mul_(float(np.float32(scale)))
        o = out.view(-1)
        o.copy_(x.reshape(-1))
        if delta is not None:
            o.add_(delta.reshape(-1))
        o.add_(z)
        return out

    def combine(self, out: torch.Tensor, index: int, seeds: list[int], coefs: np.ndarray,
                h: torch.Tensor | None) -> torch.Tensor:
        """out = (sum_p z_p * c_p, in order from 0) [* H^{-1/2}] (combine_torch's order)."""
        o = out.view(-1).zero_()
        for s, c in zip(seeds, np.asarray(coefs, dtype=np.float32).tolist()):
            o.add_(self.values(s, index, out.shape, out.device).mul_(float(c)))
        if h is not None:
            o.mul_(philox._rsqrt_exact(h.reshape(-1)))
        return out


class Sparse(_Family):
    def __init__(self, q: float):
        if not 0.0 < q <= 1.0:
            raise ValueError(f"direction density must be in (0, 1], got {q}")
        self.q = q
        self.T = max(1, min(1 << 15, round(q * (1 << 15))))
        self.c = float(np.float32(1.0 / math.sqrt(self.T / float(1 << 15))))

    def values(self, seed, index, shape, device) -> torch.Tensor:
        """The flat float32 direction of tensor ``index`` (a fresh tensor)."""
        n = math.prod(shape)
        nb = _numba(device)
        if nb is not None:
            out = np.empty(n, np.float32)
            nb.sparse(out, *_key(seed), np.uint64(index), np.uint64(SPARSE_STREAM), np.uint64(self.T), np.float32(self.c))
            return torch.from_numpy(out)
        w = _words(seed, index, SPARSE_STREAM, 0, -(-n // 8), device)
        v = ((w.unsqueeze(-1) >> torch.tensor([0, 16], dtype=torch.int64, device=device)) & 0xFFFF).reshape(-1)[:n]
        keep = (v >> 1) < self.T
        sign = 1 - 2 * (v & 1)
        return torch.where(keep, sign, 0).to(torch.float32).mul_(self.c)


class LowRank(_Family):
    def __init__(self, r: int):
        if not 1 <= r <= 1 << 20:
            raise ValueError(f"direction rank must be in [1, 2^20], got {r}")
        self.r = r
        self.c = float(np.float32(1.0 / math.sqrt(r)))

    def factors(self, seed: int, index: int, m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """U (m x r) and V (n x r), float32 signs."""
        r = self.r
        return (_signs(seed, index, U_STREAM, m * r, device).view(m, r),
                _signs(seed, index, V_STREAM, n * r, device).view(n, r))

    def values(self, seed, index, shape, device) -> torch.Tensor:
        n_all = math.prod(shape)
        if len(shape) < 2:  # a vector: the dense philox-rademacher direction (stream 0)
            return _signs(seed, index, 0, n_all, device)
        m = shape[0]
        n = n_all // m
        U, V = self.factors(seed, index, m, n, device)
        S = torch.zeros((m, n), dtype=torch.float32, device=device)
        t = torch.empty((m, n), dtype=torch.float32, device=device)
        for l in range(self.r):  # integers |S| <= r: exact in any order; elementwise anyway
            torch.mul(U[:, l:l + 1], V[:, l].view(1, n), out=t)
            S.add_(t)
        return S.view(-1).mul_(self.c)
