"""The replicas' float arithmetic: one rounding per operation, the same bits on every machine.

Every replica (the server, each client's catch-up, ``hiso rebuild``) must compute the same model
and H bit for bit. torch's fused elementwise ops are not one definition across machines:
``y.add_(x, alpha=a)`` is a fused multiply-add (one rounding) where ATen's CPU kernels use AVX2
or AVX-512, but two roundings with ``ATEN_CPU_CAPABILITY=default`` (how torch runs on a CPU
without AVX2), and a CUDA run replayed on the CPU differed (H100, torch 2.11; ``addcmul_``
rounds in yet another order). So the state update uses only a product and a sum, each its own
correctly rounded operation: ``y + fl(a * x)``, chunk by chunk through a small scratch, so the
memory over the tensors themselves stays ``CHUNK`` floats.
"""

from __future__ import annotations

import numpy as np
import torch

CHUNK = 1 << 20  # elements of a product materialised at a time (4 MB)


def _chunks(y: torch.Tensor, x: torch.Tensor):
    if not y.is_contiguous():
        raise ValueError("the replicated state must be contiguous tensors")
    yf, xf = y.view(-1), x.reshape(-1)
    n = yf.numel()
    tmp = torch.empty(min(CHUNK, n), dtype=torch.float32, device=y.device)
    for s in range(0, n, CHUNK):
        e = min(s + CHUNK, n)
        yield yf[s:e], xf[s:e], tmp[: e - s]


def axpy_(y: torch.Tensor, a: float, x: torch.Tensor) -> torch.Tensor:
    """y <- y + fl(a * x): a float32 product (``a`` rounded to float32 first), then the sum."""
    a = float(np.float32(a))
    for ys, xs, t in _chunks(y, x):
        torch.mul(xs, a, out=t)
        ys.add_(t)
    return y


def add_scaled_square_(y: torch.Tensor, b: float, x: torch.Tensor) -> torch.Tensor:
    """y <- y + fl(fl(x * x) * b)."""
    b = float(np.float32(b))
    for ys, xs, t in _chunks(y, x):
        torch.mul(xs, xs, out=t).mul_(b)
        ys.add_(t)
    return y
