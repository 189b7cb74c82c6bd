"""torch's CPU random draws, the same bits on every CPU: what tasks build x_0 and buffers from.

torch computes ``randn`` (16 numbers or more), ``normal_`` and ``uniform_`` of float32 tensors with
kernels compiled once per vector unit: with AVX2 or AVX-512 ``uniform_`` is one fused
multiply-add and ``randn`` a Box-Muller over float32 polynomials (``avx_mathfun.h``), without
AVX2 two roundings and the C library's ``logf``/``cosf``. A model drawn with them differs in
its last bits on a CPU without AVX2 (or with ``ATEN_CPU_CAPABILITY=default``), and so would
every model rebuilt there from the log. Here the same draws are recomputed from torch's
uniform integers (exact on every CPU) with numpy's float32 and float64 arithmetic, every
operation IEEE-rounded once, fused multiply-adds done exactly: the numbers torch's AVX2 and
AVX-512 kernels give (tests/test_task_draws.py checks it where this CPU runs them), on any CPU.

:class:`PortableDraws` routes torch's ``uniform_`` and ``normal_`` of float32 CPU tensors here
while a model is built, so ``nn.Linear``, ``nn.Conv2d`` and peft's LoRA initialise portably;
other dtypes and devices keep torch's draws.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_F32 = np.float32
_UNDECIDED = 2.0 ** -40  # relative distance to a float32 midpoint under which float64's exp is not trusted


def _uniform24(n: int, generator: torch.Generator | None) -> np.ndarray:
    """n float32 uniforms k / 2^24 from the generator, as torch's kernels take them (one 32-bit
    word each); exact, so the same on every CPU."""
    return torch.rand(n, generator=generator, dtype=torch.float32).numpy()


def fma32(a, b, c) -> np.ndarray:
    """float32 a * b + c rounded once. a * b is exact in float64; the sum is rounded to odd
    (TwoSum error, then the odd neighbour), which float32 rounding then cannot round twice."""
    a, b, c = (np.asarray(v, _F32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(_F32)


# avx_mathfun.h's constants, and its log256_ps and sincos256_ps step by step, with the
# multiply-adds GCC fuses there (each product whose only use is an add).
_LOG_P = [_F32(v) for v in (7.0376836292E-2, -1.1514610310E-1, 1.1676998740E-1, -1.2420140846E-1,
                            1.4249322787E-1, -1.6668057665E-1, 2.0000714765E-1, -2.4999993993E-1,
                            3.3333331174E-1)]
_LOG_Q1, _LOG_Q2, _SQRTHF = _F32(-2.12194440e-4), _F32(0.693359375), _F32(0.707106781186547524)
_DP = [_F32(v) for v in (-0.78515625, -2.4187564849853515625e-4, -3.77489497744594108e-8)]
_COS_P = [_F32(v) for v in (2.443315711809948E-005, -1.388731625493765E-003, 4.166664568298827E-002)]
_SIN_P = [_F32(v) for v in (-1.9515295891E-4, 8.3321608736E-3, -1.6666654611E-1)]
_FOPI, _TWO_PI = _F32(1.27323954473516), _F32(2.0 * math.pi)


def _log(x: np.ndarray) -> np.ndarray:
    """log256_ps for x in (0, 1]."""
    bits = x.view(np.int32)
    e = ((bits >> 23) - 0x7F).astype(_F32) + _F32(1)
    m = ((bits & ~0x7F800000) | 0x3F000000).view(_F32)  # mantissa in [0.5, 1)
    small = m < _SQRTHF
    e = e - np.where(small, _F32(1), _F32(0))
    x = (m - _F32(1)) + np.where(small, m, _F32(0))
    z = x * x
    y = fma32(_LOG_P[0], x, _LOG_P[1])
    for p in _LOG_P[2:]:
        y = fma32(y, x, p)
    y = y * x
    y = fma32(y, z, e * _LOG_Q1)
    y = y - z * _F32(0.5)  # exact product: fused or not, the same
    return fma32(e, _LOG_Q2, x + y)


def _sincos(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sincos256_ps for x >= 0 (theta = 2 pi u)."""
    j = (np.trunc(x * _FOPI).astype(np.int32) + 1) & ~1
    y = j.astype(_F32)
    sign_sin = (j & 4) != 0
    poly = (j & 2) == 0  # the sine's polynomial is the sin one
    sign_cos = ((~(j - 2)) & 4) != 0
    for dp in _DP:
        x = fma32(y, dp, x)
    z = x * x
    c = fma32(_COS_P[0], z, _COS_P[1])
    c = fma32(c, z, _COS_P[2])
    c = c * z
    c = fma32(c, z, -(z * _F32(0.5))) + _F32(1)
    s = fma32(_SIN_P[0], z, _SIN_P[1])
    s = fma32(s, z, _SIN_P[2])
    s = s * z
    s = fma32(s, x, x)
    sin, cos = np.where(poly, s, c), np.where(poly, c, s)
    return np.where(sign_sin, -sin, sin), np.where(sign_cos, -cos, cos)


def _box_muller16(u: np.ndarray, mean: np.float32, std: np.float32) -> np.ndarray:
    """torch's NormalFill16 (AVX2) on blocks of 16 uniforms, shape (blocks, 16)."""
    radius = np.sqrt(_F32(-2) * _log(_F32(1) - u[:, :8]))
    sin, cos = _sincos(_TWO_PI * u[:, 8:])
    return np.concatenate([fma32(radius * cos, std, mean), fma32(radius * sin, std, mean)], axis=1)


def normal(n: int, mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None) -> np.ndarray:
    """n float32 normals as ``torch.empty(n).normal_(mean, std, generator=generator)`` draws them
    with torch's AVX2/AVX-512 kernels, consuming the generator as they do."""
    if n < 16:  # torch's scalar path: a float64 Box-Muller with the C library's log1p, sin and
        # cos (not torch's kernels; C libraries that differ in a float64's last bit would differ
        # here only where it decides a float32 tie), then mean and std
        z = torch.randn(n, generator=generator, dtype=torch.float64).tolist()
        fm, fs = Fraction(mean), Fraction(std)  # fused in float64, then rounded to float32
        return np.array([float(Fraction(v) * fs + fm) for v in z], dtype=np.float64).astype(_F32)
    tail = n % 16
    u = _uniform24(n + (16 if tail else 0), generator)
    m, s = _F32(mean), _F32(std)
    out = np.empty(n, _F32)
    full = n // 16 * 16
    out[:full] = _box_muller16(u[:full].reshape(-1, 16), m, s).reshape(-1)
    if tail:  # torch redraws the last 16 numbers
        out[n - 16:] = _box_muller16(u[n:].reshape(1, 16), m, s).reshape(-1)
    return out


def uniform(n: int, low: float, high: float, generator: torch.Generator | None = None) -> np.ndarray:
    """n float32 uniforms in [low, high) as ``Tensor.uniform_`` draws them with torch's AVX2 and
    AVX-512 kernels: fma(k / 2^24, high - low, low)."""
    lo, hi = _F32(low), _F32(high)
    return fma32(_uniform24(n, generator), hi - lo, lo)


def randn(*shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.randn(*shape, generator=generator)`` (float32), portably."""
    return torch.from_numpy(normal(math.prod(shape), generator=generator).reshape(shape))


def exp(x) -> np.ndarray:
    """float32 exp(x), correctly rounded (so the same on every CPU, unlike torch.exp's vector
    kernels). float64's exp decides the rounding unless it lies within 2^-40 of a float32
    midpoint, where a 60-digit decimal exp (correctly rounded itself) does."""
    x = np.asarray(x, _F32)
    v = np.exp(x.astype(np.float64))
    r = v.astype(_F32)
    other = np.nextafter(r, np.where(v > r, _F32(np.inf), _F32(-np.inf)))
    mid = (r.astype(np.float64) + other.astype(np.float64)) / 2  # exact
    for i in np.flatnonzero(np.abs(v - mid) <= np.abs(v) * _UNDECIDED):
        with localcontext(prec=60):
            above = Decimal(float(x.flat[i])).exp() > Decimal(float(mid.flat[i]))
        r.flat[i] = max(r.flat[i], other.flat[i]) if above else min(r.flat[i], other.flat[i])
    return r


def _portable(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class PortableDraws(TorchDispatchMode):
    """Within it, torch's ``uniform_`` and ``normal_`` of contiguous float32 CPU tensors, however
    called (``nn.init``, a module's ``reset_parameters``), draw portably (this module's
    functions); build models under it. A dispatch mode, so it sees the calls nested in others."""

    _ops = {torch.ops.aten.uniform_.default: uniform, torch.ops.aten.normal_.default: normal}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        draw = self._ops.get(func)
        if draw is None or not _portable(args[0]):
            return func(*args, **kwargs)
        t, given = args[0], list(args[1:])
        names = ("from", "to") if draw is uniform else ("mean", "std")
        a, b = (given[i] if i < len(given) else kwargs.get(k, d) for i, (k, d) in enumerate(zip(names, (0.0, 1.0))))
        t.copy_(torch.from_numpy(draw(t.numel(), a, b, kwargs.get("generator"))).reshape(t.shape))
        return t
