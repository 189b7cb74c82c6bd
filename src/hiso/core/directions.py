"""Random directions from seeds: the protocol's definition of a direction.

A direction for a 64-bit seed ``s`` is a float32 vector over all trainable parameters, defined
tensor by tensor. The trainable tensors are numbered 0..T-1 in the model's
``named_parameters()`` order (duplicates removed, ``requires_grad`` only); element ``j`` of a
tensor is its ``j``-th element in row-major (``view(-1)``) order. How a seed becomes numbers is
the run's **direction family** (``ZOConfig.directions``, ``--directions``):

``philox-rademacher`` (the default) and ``philox-gaussian`` are defined by the counter-based
generator Philox4x32-10 (Salmon et al. 2011, as published in Random123 and used by cuRAND and
JAX; checked against Random123's known-answer vectors). Block ``b`` of tensor ``i`` is the
generator's output ``(w0, w1, w2, w3)`` for

    key = (s mod 2^32, s div 2^32),   counter = (b mod 2^32, b div 2^32, i, 0)

so any block of any tensor can be produced on its own, in parallel, on any device, and the
bits depend on neither torch's version nor the device. Then

* ``philox-rademacher``: a block gives 128 elements; element ``j = 128 b + 32 k + t`` is
  ``+1`` if bit ``t`` of ``w_k`` is 0 and ``-1`` if it is 1 (mean 0, covariance I: the
  random signs of SPSA);
* ``philox-gaussian``: a block gives 8 elements; element ``j = 8 b + 2 k + h`` is ``T[u]``
  with ``u`` the low (``h = 0``) or high (``h = 1``) 16 bits of ``w_k`` and ``T`` the
  65,536-entry inverse-normal-CDF table of :func:`hiso.kernels.philox.gaussian_table`
  (``T[u] = c Phi^{-1}((u + 1/2) / 2^16)``, exactly symmetric, unit second moment; pinned by
  its SHA-256): a standard Gaussian quantised to 2^16 equiprobable levels, |z| <= 4.33.

Both are integer functions of the generator's bits, so a direction element is bit-identical on
every CPU and GPU. What a round does with directions is defined in binary32 with every
operation rounded once (no fused multiply-add, ``H^{-1/2} = 1 / sqrt(H)`` with a correctly
rounded square root):

* perturbation of parameter ``x``: ``(x + delta) + (z * H^{-1/2}) * float32(mu)``
  (``delta`` when tau > 1; ``H^{-1/2}`` for HiSo);
* replay of a local step: ``ghat = (((0 + z_1 c_1) + z_2 c_2) + ... + z_P c_P) * H^{-1/2}``
  with ``c_p = float32(g_p / P)``;

which the CPU kernels (numba, fused: a direction element is produced where it is used, no
tensor-sized direction buffer) and the torch kernels (any device: the CUDA path) compute alike.

``torch-normal`` (the paper's Gaussian, kept for comparison): tensor ``i`` gets a CPU
``torch.Generator`` seeded with ``tensor_seed(s, i)`` (a SplitMix64 mix), from which
``torch.Tensor.normal_`` fills the tensor; generated on the CPU (then moved), so peers must run
the same torch version, and about 5-10x slower than the Philox families.

``sparse`` and ``lowrank`` (with their parameters, e.g. ``sparse:q=0.1``, ``lowrank:r=4``,
``lowrank:r=4,refresh=10``, ``sparse:q=0.1,mask=magnitude``) are defined in
:mod:`hiso.core.families`: Philox bits too, exact on every device.

In every family each tensor has its own stream, so which numbers a tensor gets does not depend
on the order tensors are visited: a client may perturb or update one layer at a time.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .. import hardware
from ..kernels import philox
from . import exact, families

# Direction families by name: what ``ZOConfig.directions`` may hold (recorded in config.json).
FAMILIES = {
    "philox-rademacher": "random signs from Philox4x32-10 (bit-identical on every device)",
    "philox-gaussian": "standard Gaussian from Philox4x32-10 by a 2^16-entry inverse-CDF table (bit-identical on every device)",
    "torch-normal": "standard Gaussian from torch's CPU generator (peers need the same torch version and CPU kind: its vectorised sampler differs without AVX2)",
    **families.STRUCTURED,  # with parameters: sparse:q=Q, lowrank:r=R (hiso.core.families)
}
DEFAULT_FAMILY = "philox-rademacher"  # measured: 15.7x torch normal_, MNIST accuracy equal (3 seeds)
KERNELS = ("auto", "numba", "torch")

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def check_family(name: str) -> None:
    """Raise ValueError unless ``name`` is a dense family's name or a structured family's spec."""
    if name in FAMILIES and name not in families.STRUCTURED:
        return
    if name.partition(":")[0] not in families.STRUCTURED:
        raise ValueError(f"unknown direction family {name!r} (choose from {', '.join(FAMILIES)})")
    families.parse(name)


def tensor_seed(seed: int, index: int) -> int:
    """Seed of tensor ``index``'s stream for direction ``seed`` (torch-normal family)."""
    return _splitmix64((seed ^ _splitmix64(index)) & _MASK)


_NUMBA_READY = False


def _numba():
    """The compiled CPU kernels, or None where numba cannot be imported.

    numba's OpenMP threading layer shares libgomp with torch, and starting its thread pool (the
    first parallel kernel) sets OpenMP's thread count to all cores: torch would then run every
    later op on all cores whatever ``torch.set_num_threads`` said (with ``--threads 1 --jobs 2``,
    4 spinning threads on 2 cores: rounds 10-30x slower). So the pool is started here once, and
    torch's thread count put back.
    """
    global _NUMBA_READY
    try:
        from ..kernels import philox_numba as _philox_numba
    except ImportError:  # pragma: no cover - numba is a dependency; the torch kernels still work
        return None
    if not _NUMBA_READY:
        n = torch.get_num_threads()
        _philox_numba.fill(np.zeros(1, np.uint32), 0, np.zeros(1, np.uint32), np.uint64(0), np.uint64(0), np.uint64(0))
        torch.set_num_threads(n)
        _NUMBA_READY = True
    return _philox_numba


_TRITON: list = []


def _triton():
    """The fused GPU kernels, or None where Triton cannot be imported (then: torch's integer ops)."""
    if not _TRITON:
        try:
            from ..kernels import philox_triton as _philox_triton
        except ImportError:  # CPU-only torch has no Triton
            _philox_triton = None
        _TRITON.append(_philox_triton)
    return _TRITON[0]


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(-1).numpy()


class DirectionGenerator:
    """Produces a family's directions and the direction arithmetic of a round, tensor by tensor.

    ``kernel`` picks the CPU implementation of the Philox families: ``"numba"`` (fused,
    multi-threaded with torch's thread count), ``"torch"`` (integer tensor ops, chunked) or
    ``"auto"`` (numba when importable; ``$HISO_DIRECTION_KERNEL`` overrides). Tensors on a CUDA
    device use fused Triton kernels where Triton is importable (it ships with CUDA builds of
    torch), unless ``kernel="torch"``; else the torch kernels, on their device. All give the
    same bits.

    It also owns the scratch tensors of direction arithmetic (:meth:`scratch`): one buffer per
    (purpose, shape, device), so a round allocates nothing after its first tensor of each shape.
    """

    def __init__(self, family: str = DEFAULT_FAMILY, kernel: str = "auto") -> None:
        check_family(family)
        # sparse / lowrank: their own torch arithmetic (hiso.core.families), dispatched first
        self._structured = None if family in FAMILIES and family not in families.STRUCTURED else families.parse(family)
        kernel = os.environ.get("HISO_DIRECTION_KERNEL", kernel) if kernel == "auto" else kernel
        if kernel not in KERNELS:
            raise ValueError(f"unknown direction kernel {kernel!r} (choose from {', '.join(KERNELS)})")
        self.family = family
        self.philox = family.startswith("philox-")
        self._nb = None
        self._tr = (_triton() if self.philox and kernel != "torch" and hardware.has("cuda") and hardware.has("triton")
                    else None)
        if self.philox and kernel != "torch":
            self._nb = _numba()
            if self._nb is None and kernel == "numba":
                raise ImportError("direction kernel 'numba' needs numba (pip install numba)")
        if self.philox:
            self._fam = 0 if family == "philox-rademacher" else 1
            self._table = (philox.gaussian_table() if self._fam == 1 else np.zeros(1, np.float32)).view(np.uint32)
        self._gen = torch.Generator(device="cpu")
        self._buffers: dict[tuple, torch.Tensor] = {}

    def bind(self, run_seed: int | None = None, params=None) -> "DirectionGenerator":
        """Give a structured family what it may need beyond (seed, tensor, shape): the run's seed
        (lowrank with refresh) and the initial trainable tensors x_0 (sparse with a magnitude
        mask). ModelState binds both when it is built; a client learns the seed at the join."""
        if self._structured is not None:
            self._structured.bind(run_seed, params)
        return self

    @property
    def kernel(self) -> str:
        """Which CPU kernel this generator uses ("numba" or "torch")."""
        return "numba" if self._nb is not None else "torch"

    def scratch(self, tag: str, shape: torch.Size, device: torch.device | str = "cpu") -> torch.Tensor:
        """A float32 buffer for ``tag`` (uninitialised; valid until the next call with this key)."""
        key = (tag, tuple(shape), str(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(tuple(shape), dtype=torch.float32, device=device)
        return buf

    def _use_numba(self, *tensors: torch.Tensor | None) -> bool:
        if self._nb is None:
            return False
        for t in tensors:
            if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()):
                return False
        self._nb.set_threads(torch.get_num_threads())
        return True

    def _use_triton(self, *tensors: torch.Tensor | None) -> bool:
        if self._tr is None:
            return False
        return all(t is None or (t.is_cuda and t.dtype == torch.float32 and t.is_contiguous()) for t in tensors)

    def _key(self, seed: int) -> tuple[np.uint64, np.uint64]:
        k0, k1 = philox.key_of(int(seed))
        return np.uint64(k0), np.uint64(k1)

    def fill(self, seed: int, index: int, shape: torch.Size, device: torch.device | str = "cpu") -> torch.Tensor:
        """Return u_i for direction ``seed``: a float32 buffer on ``device`` (the torch-normal
        family generates on the CPU and moves it), valid until the next fill."""
        if self._structured is not None:
            out = self.scratch("u", shape, device)
            out.view(-1).copy_(self._structured.values(seed, index, shape, out.device))
            return out
        if not self.philox:
            self._gen.manual_seed(tensor_seed(seed, index))
            return self.scratch("u", shape).normal_(generator=self._gen).to(device)
        out = self.scratch("u", shape, device)
        if self._use_numba(out):
            self._nb.fill(_flat(out).view(np.uint32), self._fam, self._table, *self._key(seed), np.uint64(index))
            return out
        if self._use_triton(out):
            return self._tr.fill(self.family, out, seed, index)
        n, step = out.numel(), philox._chunk(out.device)
        of = out.view(-1)
        for a in range(0, n, step):
            b = min(a + step, n)
            of[a:b] = philox.values_torch(self.family, seed, index, a, b - a, out.device)
        return out

    def shift(self, out: torch.Tensor, x: torch.Tensor, seed: int, index: int, scale: float,
              h: torch.Tensor | None = None, delta: torch.Tensor | None = None) -> torch.Tensor:
        """out = x [+ delta] + scale * [H^{-1/2}] u(seed)_index, in one pass; x is not written."""
        if self._structured is not None:
            return self._structured.shift(out, x, seed, index, scale, h, delta)
        if not self.philox:  # the torch-normal family: CPU-generated Gaussians
            out.copy_(x)
            if delta is not None:
                out.add_(delta.to(x.dtype))
            z = self.fill(seed, index, x.shape).to(x.device)
            from . import preconditioner as pc
            pc.precondition_(z, h, None if h is None else self.scratch("rsqrt", pc.scratch_shape(h), h.device))
            return exact.axpy_(out, scale, z)
        if x.dtype != torch.float32:  # e.g. bfloat16 parameters: the float32 value, rounded once
            tmp = self.scratch("shift", x.shape, x.device)
            self.shift(tmp, x.float(), seed, index, scale, h, delta)
            return out.copy_(tmp)
        if self._use_numba(out, x, h, delta):
            xf = _flat(x)
            self._nb.shift(_flat(out), xf, xf if delta is None else _flat(delta), xf if h is None else _flat(h),
                           delta is not None, h is not None, np.float32(scale), self._fam, self._table,
                           *self._key(seed), np.uint64(index))
            return out
        if self._use_triton(out, x, h, delta):
            return self._tr.shift(self.family, out, x, seed, index, scale, h, delta)
        return philox.shift_torch(self.family, out, x, seed, index, scale, h, delta)

    def shift_all(self, outs: list[torch.Tensor], xs: list[torch.Tensor], seed: int | list[int],
                  indices: list[int], scale: float, hs: list[torch.Tensor] | None = None,
                  deltas: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """:meth:`shift` for many tensors: ``outs[j] = xs[j] [+ deltas[j]] + scale *
        [hs[j]^{-1/2}] u(seed)_{indices[j]}``, the same bits as calling :meth:`shift` per tensor.

        ``seed`` is one seed for all, or one per tensor (the P points of a round in one call:
        outs and xs repeated per point, seeds and indices per slot). On CUDA with Triton, when
        every tensor is float32 and contiguous on one device and ``hs``/``deltas`` are given for
        all tensors or for none, this is ONE kernel launch (``hiso.kernels.philox_triton.shift_all``) instead
        of one per tensor; otherwise (CPU, bfloat16, torch kernel) it loops over :meth:`shift`.

        For the perturbation modes (``core/perturb.py``): a mode that shifts every parameter
        before the forward (``swap``, batched) should collect (buffer, parameter, index) for all
        parameters and call this once per point rather than ``Shift.shifted`` per parameter;
        ``hooks`` shifts inside each module's pre-hook, so it cannot group without holding every
        shifted tensor at once (which is what swap does).
        """
        n = len(outs)
        seeds = [int(seed)] * n if np.ndim(seed) == 0 else [int(s) for s in seed]
        if not (len(xs) == len(seeds) == len(indices) == n and (hs is None or len(hs) == n)
                and (deltas is None or len(deltas) == n)):
            raise ValueError("shift_all: outs, xs, indices (and seeds, hs, deltas when lists) need one entry per tensor")
        if n and self.philox and self._tr is not None:
            every = [*outs, *xs, *(hs or ()), *(deltas or ())]
            dev = outs[0].device
            if all(t is not None and t.device == dev for t in every) and self._use_triton(*every):
                return self._tr.shift_all(self.family, outs, xs, seeds, indices, scale, hs, deltas)
        for j in range(n):
            self.shift(outs[j], xs[j], seeds[j], indices[j], scale, None if hs is None else hs[j],
                       None if deltas is None else deltas[j])
        return outs

    def fold_all(self, params: list[torch.Tensor], hs: list[torch.Tensor] | None, seeds: np.ndarray,
                 scalars: np.ndarray, lr: float, h_update: tuple | None) -> bool:
        """One local step of the chain's plain fold (SGD through H, then H's coordinate-wise EMA
        when ``h_update`` = (a, b, eps, h_min, h_max)) for every tensor in ONE launch, with the
        bits of :meth:`combine`, ``exact.axpy_`` and ``preconditioner.update_`` per tensor.

        Only on CUDA with Triton, for a Philox family and float32 contiguous tensors on one
        device; returns False (nothing done) otherwise, and the caller folds tensor by tensor.
        """
        if not (self.philox and self._tr is not None and params):
            return False
        every = [*params, *(hs or ())]
        dev = params[0].device
        if not (all(t.device == dev for t in every) and self._use_triton(*every)):
            return False
        P = len(seeds)
        coefs = (np.asarray(scalars, dtype=np.float64) / P).astype(np.float32)
        self._tr.fold_all(self.family, params, hs, list(range(len(params))),
                          [int(s) for s in np.asarray(seeds).tolist()], coefs, lr, h_update)
        return True

    def combine(self, index: int, shape: torch.Size, seeds: np.ndarray, scalars: np.ndarray,
                h: torch.Tensor | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """ghat_i = H_i^{-1/2} (1/P) sum_p g_p u_p, summed over p in order (float32 on ``device``).

        The result lives in this generator's scratch space: use it before the next call.
        """
        P = len(seeds)
        if self._structured is not None:  # the same coefficients c_p = float32(g_p / P) as below
            coefs = (np.asarray(scalars, dtype=np.float64) / P).astype(np.float32)
            return self._structured.combine(self.scratch("acc", shape, device), index,
                                            [int(s) for s in np.asarray(seeds).tolist()], coefs, h)
        if not self.philox:  # the torch-normal family: CPU-generated Gaussians
            acc = self.scratch("acc", shape).zero_()
            for s, g in zip(seeds.tolist(), scalars.tolist()):
                exact.axpy_(acc, g / P, self.fill(s, index, shape))
            acc = acc.to(device)
            from . import preconditioner as pc
            return pc.precondition_(acc, h, None if h is None else self.scratch("rsqrt", pc.scratch_shape(h), h.device))
        coefs = (np.asarray(scalars, dtype=np.float64) / P).astype(np.float32)
        seeds = [int(s) for s in np.asarray(seeds).tolist()]
        out = self.scratch("acc", shape, device)
        if self._use_numba(out, h):
            keys = [philox.key_of(s) for s in seeds]
            self._nb.combine(_flat(out), _flat(out) if h is None else _flat(h), h is not None,
                             np.array([k[0] for k in keys], np.uint64), np.array([k[1] for k in keys], np.uint64),
                             coefs, self._fam, self._table, np.uint64(index))
            return out
        if self._use_triton(out, h):
            return self._tr.combine(self.family, out, seeds, coefs, index, h)
        return philox.combine_torch(self.family, out, seeds, coefs, index, h)


def direction(seed: int, shapes: list[torch.Size], family: str = DEFAULT_FAMILY,
              device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The whole direction for ``seed`` as fresh tensors (for tests and small models)."""
    gen = DirectionGenerator(family)
    return [gen.fill(seed, i, s, device).clone() for i, s in enumerate(shapes)]
