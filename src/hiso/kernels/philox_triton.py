"""Fused GPU kernels of the Philox direction families (Triton): fill, shift, combine, and the
grouped shift of many tensors in one launch (:func:`shift_all`), and the replica's fold of a
round over every tensor in one launch (:func:`fold_all`).

The same definition as :func:`hiso.kernels.philox.values_torch` and the numba CPU kernels, element
by element: element ``i`` of tensor ``index`` for direction ``seed`` comes from Philox block
``i // per`` (counter ``(block lo, block hi, index, 0)``, key ``key_of(seed)``). Each element
computes its block itself (integer work is cheap on a GPU; the kernels are bound by memory).

Float arithmetic is the binary32 ``*``, ``+``, division and square root, each rounded
once to nearest: the kernels are compiled with ``enable_fp_fusion=False`` (else a multiply
followed by an add may become one fused multiply-add, rounded once: different bits), and use
``div_rn``/``sqrt_rn`` (Triton's plain ``/`` and ``sqrt`` are approximate for float32).
Imported only where a CUDA tensor meets a Philox family and Triton is importable.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import philox

BLOCK = 1024
_OPTS = {"enable_fp_fusion": False}


@triton.jit
def _philox_words(i, k0, k1, index, LOG_PER: tl.constexpr):
    """The four output words of the Philox block holding element ``i`` (int64 offsets)."""
    b = i >> LOG_PER
    c0 = (b & 0xFFFFFFFF).to(tl.uint32)
    c1 = (b >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + index.to(tl.uint32)
    c3 = tl.zeros_like(c0)
    ka = tl.zeros_like(c0) + k0.to(tl.uint32)  # the low 32 bits, whatever integer type came in
    kb = tl.zeros_like(c0) + k1.to(tl.uint32)
    m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
    m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
    w0 = tl.full(c0.shape, 0x9E3779B9, tl.uint32)
    w1 = tl.full(c0.shape, 0xBB67AE85, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            ka = ka + w0
            kb = kb + w1
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ ka, lo1, hi0 ^ c3 ^ kb, lo0
    return c0, c1, c2, c3


@triton.jit
def _values(i, k0, k1, index, table, GAUSS: tl.constexpr):
    """Direction element ``i`` as float32: a sign (Rademacher) or a table entry (Gaussian)."""
    if GAUSS:
        w0, w1, w2, w3 = _philox_words(i, k0, k1, index, 3)
        k = (i >> 1) & 3
        w = tl.where(k == 0, w0, tl.where(k == 1, w1, tl.where(k == 2, w2, w3)))
        half = (w >> ((i & 1) * 16).to(tl.uint32)) & 0xFFFF
        return tl.load(table + half.to(tl.int32))
    else:
        w0, w1, w2, w3 = _philox_words(i, k0, k1, index, 7)
        k = (i >> 5) & 3
        w = tl.where(k == 0, w0, tl.where(k == 1, w1, tl.where(k == 2, w2, w3)))
        bit = (w >> (i & 31).to(tl.uint32)) & 1
        return 1.0 - 2.0 * bit.to(tl.float32)


@triton.jit
def _rsqrt_exact(hv):
    """1 / sqrt(h), square root and division each correctly rounded (the CPU kernels take the
    float64 root rounded to float32: the same number, see ``philox._rsqrt_exact``)."""
    s = tl.sqrt_rn(hv)
    return tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


_SCALARS = ["n", "k0", "k1", "index"]  # never specialised (a key or an index of 1 would become a constant)


@triton.jit(do_not_specialize=_SCALARS)
def _fill_kernel(out, n, k0, k1, index, table, GAUSS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out + i, _values(i, k0, k1, index, table, GAUSS), mask=mask)


@triton.jit(do_not_specialize=_SCALARS + ["scale"])
def _shift_kernel(out, x, delta, h, n, scale, k0, k1, index, table, HAS_DELTA: tl.constexpr,
                  HAS_H: tl.constexpr, GAUSS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    z = _values(i, k0, k1, index, table, GAUSS)
    if HAS_H:
        z = z * _rsqrt_exact(tl.load(h + i, mask=mask, other=1.0))
    z = z * scale
    o = tl.load(x + i, mask=mask)
    if HAS_DELTA:
        o = o + tl.load(delta + i, mask=mask)
    tl.store(out + i, o + z, mask=mask)


@triton.jit(do_not_specialize=["n", "P", "index"])
def _combine_kernel(out, h, n, keys0, keys1, coefs, P, index, table, HAS_H: tl.constexpr,
                    GAUSS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    acc = tl.zeros([BLOCK], tl.float32)
    for p in range(P):  # in order from p = 0, as the CPU kernels sum
        acc = acc + _values(i, tl.load(keys0 + p), tl.load(keys1 + p), index, table, GAUSS) * tl.load(coefs + p)
    if HAS_H:
        acc = acc * _rsqrt_exact(tl.load(h + i, mask=mask, other=1.0))
    tl.store(out + i, acc, mask=mask)


# The grouped shift: one launch for many tensors ("slots"). Each slot is a row of 9 int64 words
# in a small device array: (numel, tensor index, x, out, delta, h (data pointers), key word 0,
# key word 1, float32 bits of scale). Each program handles BLOCK elements of one slot, named by a
# row (slot, first element) of the block table. Everything that changes between calls (pointers,
# keys, scale) is read from device memory, not passed as kernel arguments.


@triton.jit
def _slot_ptr(row, field):
    return tl.load(row + field).to(tl.pointer_type(tl.float32))


@triton.jit
def _shift_all_kernel(slots, blocks, table, HAS_DELTA: tl.constexpr, HAS_H: tl.constexpr,
                      GAUSS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = slots + tl.load(blocks + 2 * pid) * 9
    i = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK)
    mask = i < tl.load(row + 0)
    index = tl.load(row + 1)
    k0 = tl.load(row + 6)
    k1 = tl.load(row + 7)
    scale = tl.load(row + 8).to(tl.int32).to(tl.float32, bitcast=True)
    z = _values(i, k0, k1, index, table, GAUSS)
    if HAS_H:
        z = z * _rsqrt_exact(tl.load(_slot_ptr(row, 5) + i, mask=mask, other=1.0))
    z = z * scale
    o = tl.load(_slot_ptr(row, 2) + i, mask=mask)
    if HAS_DELTA:
        o = o + tl.load(_slot_ptr(row, 4) + i, mask=mask)
    tl.store(_slot_ptr(row, 3) + i, o + z, mask=mask)


_BLOCK_TABLES: dict[tuple, torch.Tensor] = {}


def _block_table(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(slot, first element) of every BLOCK of every slot, cached by the slots' sizes (a model's
    tensors keep their sizes, so one table per model and device)."""
    key = (numels, str(device))
    table = _BLOCK_TABLES.get(key)
    if table is None:
        counts = [triton.cdiv(n, BLOCK) for n in numels]
        slot = np.repeat(np.arange(len(numels), dtype=np.int64), counts)
        first = np.concatenate([np.arange(c, dtype=np.int64) * BLOCK for c in counts]) if counts else slot
        table = torch.from_numpy(np.stack([slot, first], axis=1).reshape(-1).copy()).to(device)
        if len(_BLOCK_TABLES) > 16:
            _BLOCK_TABLES.clear()
        _BLOCK_TABLES[key] = table
    return table


def shift_all(family: str, outs: list[torch.Tensor], xs: list[torch.Tensor], seeds: list[int],
              indices: list[int], scale: float, hs: list[torch.Tensor] | None,
              deltas: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """outs[j] = xs[j] [+ deltas[j]] + scale * [hs[j]^{-1/2}] u(seeds[j])_{indices[j]} for every j,
    in one launch: the same element arithmetic as :func:`shift`, so the same bits.

    All tensors float32, contiguous, on one device; ``hs``/``deltas`` all given or None.
    """
    if not outs:
        return outs
    dev = outs[0].device
    bits = int(np.float32(scale).view(np.int32))
    rows = []
    for j, (o, x) in enumerate(zip(outs, xs)):
        k0, k1 = philox.key_of(int(seeds[j]))
        rows += [o.numel(), int(indices[j]), x.data_ptr(), o.data_ptr(),
                 (x if deltas is None else deltas[j]).data_ptr(), (x if hs is None else hs[j]).data_ptr(),
                 k0, k1, bits]
    # pinned and non-blocking: a plain host-to-device copy would wait for the GPU's queue to drain
    # (torch's caching host allocator keeps the pinned block until the copy has run)
    slots = torch.tensor(rows, dtype=torch.int64, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)
    blocks = _block_table(tuple(o.numel() for o in outs), dev)
    if blocks.numel():
        _shift_all_kernel[(blocks.numel() // 2,)](slots, blocks, _table(family, dev), HAS_DELTA=deltas is not None,
                                                  HAS_H=hs is not None, GAUSS=family == "philox-gaussian",
                                                  BLOCK=BLOCK, **_OPTS)
    return outs


# The grouped fold: one local step of the replica's fold (hiso.core.chain) for every tensor in one
# launch. Each slot is a row of 4 int64 words (numel, tensor index, parameter, H (data pointers));
# the step's keys and coefficients are shared by all slots. Element by element it is the chain's
# arithmetic: ghat = (sum_p z_p c_p) * H^{-1/2}; x <- x + fl(ghat * -lr); then, for HiSo's
# coordinate-wise H, H <- fl(H * a) + fl(fl(ghat * ghat) * b) [+ b eps] [clamped].


@triton.jit(do_not_specialize=["P", "neg_lr", "a", "b", "b_eps", "h_min", "h_max"])
def _fold_all_kernel(slots, blocks, keys0, keys1, coefs, P, table, neg_lr, a, b, b_eps, h_min, h_max,
                     HAS_H: tl.constexpr, UPDATE_H: tl.constexpr, HAS_EPS: tl.constexpr,
                     HAS_MIN: tl.constexpr, HAS_MAX: tl.constexpr, GAUSS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = slots + tl.load(blocks + 2 * pid) * 4
    i = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK)
    mask = i < tl.load(row + 0)
    index = tl.load(row + 1)
    acc = tl.zeros([BLOCK], tl.float32)
    for p in range(P):  # in order from p = 0, as _combine_kernel and the CPU kernels sum
        acc = acc + _values(i, tl.load(keys0 + p), tl.load(keys1 + p), index, table, GAUSS) * tl.load(coefs + p)
    if HAS_H:
        hp = _slot_ptr(row, 3)
        hv = tl.load(hp + i, mask=mask, other=1.0)
        acc = acc * _rsqrt_exact(hv)
    xp = _slot_ptr(row, 2)
    tl.store(xp + i, tl.load(xp + i, mask=mask) + acc * neg_lr, mask=mask)
    if UPDATE_H:
        hn = hv * a + (acc * acc) * b
        if HAS_EPS:
            hn = hn + b_eps
        if HAS_MIN:  # torch's clamp: a NaN stays NaN
            hn = tl.where(hn < h_min, h_min, hn)
        if HAS_MAX:
            hn = tl.where(hn > h_max, h_max, hn)
        tl.store(hp + i, hn, mask=mask)


def _f32(v: float) -> float:
    return float(np.float32(v))


def fold_all(family: str, params: list[torch.Tensor], hs: list[torch.Tensor] | None, indices: list[int],
             seeds: list[int], coefs: np.ndarray, lr: float, h_update: tuple | None) -> None:
    """One local step of the fold for every tensor in one launch, in place: params[j] <- params[j]
    + fl(ghat_j * float32(-lr)) with ghat_j = (sum_p u(seeds[p])_{indices[j]} coefs[p]) * hs[j]^{-1/2};
    then, when ``h_update`` = (a, b, eps, h_min, h_max) is given, hs[j] <- fl(hs[j] a) +
    fl(fl(ghat_j^2) b) [+ fl(b eps)] clamped to [h_min, h_max] (None: no bound), as
    :func:`hiso.core.preconditioner.update_` computes it (its scalars rounded to float32 as torch
    rounds a Python scalar against a float32 tensor).

    All tensors float32, contiguous, on one CUDA device (or CPU tensors under Triton's interpreter).
    """
    if not params:
        return
    dev = params[0].device
    rows = []
    for j, p in enumerate(params):
        rows += [p.numel(), int(indices[j]), p.data_ptr(), (p if hs is None else hs[j]).data_ptr()]
    slots = torch.tensor(rows, dtype=torch.int64, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)
    blocks = _block_table(tuple(p.numel() for p in params), dev)
    if not blocks.numel():
        return
    k0, k1, c = _combine_args(seeds, coefs, dev)
    a, b, eps, h_min, h_max = h_update if h_update is not None else (1.0, 0.0, 0.0, None, None)
    _fold_all_kernel[(blocks.numel() // 2,)](
        slots, blocks, k0, k1, c, len(seeds), _table(family, dev), _f32(-lr), _f32(a), _f32(b), _f32(b * eps),
        _f32(0.0 if h_min is None else h_min), _f32(0.0 if h_max is None else h_max),
        HAS_H=hs is not None, UPDATE_H=h_update is not None and hs is not None, HAS_EPS=bool(eps),
        HAS_MIN=h_min is not None, HAS_MAX=h_max is not None, GAUSS=family == "philox-gaussian",
        BLOCK=BLOCK, **_OPTS)


_TABLES: dict[str, torch.Tensor] = {}


def _table(family: str, device: torch.device) -> torch.Tensor:
    key = f"{family}@{device}"
    if key not in _TABLES:
        t = philox.gaussian_table() if family == "philox-gaussian" else np.zeros(1, np.float32)
        _TABLES[key] = torch.from_numpy(t.copy()).to(device)
    return _TABLES[key]


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def fill(family: str, out: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    k0, k1 = philox.key_of(int(seed))
    n = out.numel()
    _fill_kernel[_grid(n)](out, n, k0, k1, int(index), _table(family, out.device),
                           GAUSS=family == "philox-gaussian", BLOCK=BLOCK, **_OPTS)
    return out


def shift(family: str, out: torch.Tensor, x: torch.Tensor, seed: int, index: int, scale: float,
          h: torch.Tensor | None, delta: torch.Tensor | None) -> torch.Tensor:
    k0, k1 = philox.key_of(int(seed))
    n = out.numel()
    _shift_kernel[_grid(n)](out, x, x if delta is None else delta, x if h is None else h, n,
                            float(np.float32(scale)), k0, k1, int(index), _table(family, out.device),
                            HAS_DELTA=delta is not None, HAS_H=h is not None,
                            GAUSS=family == "philox-gaussian", BLOCK=BLOCK, **_OPTS)
    return out


_COMBINE_ARGS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _combine_args(seeds: list[int], coefs: np.ndarray, dev: torch.device):
    """The keys and coefficients on the device. A round's replay combines the same (seeds, coefs)
    for every tensor, so they are copied once per round, not three blocking copies per tensor."""
    c32 = np.asarray(coefs, dtype=np.float32)
    key = (tuple(int(s) for s in seeds), c32.tobytes(), str(dev))
    args = _COMBINE_ARGS.get(key)
    if args is None:
        keys = [philox.key_of(s) for s in key[0]]
        pin = dev.type == "cuda"
        k = torch.tensor([[a for a, _ in keys], [b for _, b in keys]], dtype=torch.int64, pin_memory=pin)
        c = torch.from_numpy(c32.copy())
        k, c = k.to(dev, non_blocking=True), (c.pin_memory() if pin else c).to(dev, non_blocking=True)
        if len(_COMBINE_ARGS) >= 8:
            _COMBINE_ARGS.pop(next(iter(_COMBINE_ARGS)))
        args = _COMBINE_ARGS[key] = (k[0], k[1], c)
    return args


def combine(family: str, out: torch.Tensor, seeds: list[int], coefs: np.ndarray, index: int,
            h: torch.Tensor | None) -> torch.Tensor:
    dev = out.device
    k0, k1, c = _combine_args(seeds, coefs, dev)
    n = out.numel()
    _combine_kernel[_grid(n)](out, out if h is None else h, n, k0, k1, c, len(seeds), int(index),
                              _table(family, dev), HAS_H=h is not None,
                              GAUSS=family == "philox-gaussian", BLOCK=BLOCK, **_OPTS)
    return out
