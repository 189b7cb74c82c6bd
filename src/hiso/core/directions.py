"""Random directions from seeds: the protocol's definition of a direction.

A direction for a 64-bit seed ``s`` is a standard Gaussian vector over all trainable
parameters, defined tensor by tensor:

* the trainable tensors are numbered 0..T-1 in the model's ``named_parameters()`` order
  (duplicates removed, ``requires_grad`` only);
* tensor ``i`` gets its own stream: a CPU ``torch.Generator`` seeded with
  ``tensor_seed(s, i)`` (a SplitMix64 mix of ``s`` and ``i``), from which
  ``torch.Tensor.normal_`` fills a float32 tensor of the parameter's shape.

Because each tensor has its own stream, which numbers a tensor gets does not depend on the
order tensors are visited: a client may perturb or update one layer at a time and never holds
a d-sized temporary. Directions are always generated on the CPU (then moved), so CPU and GPU
peers agree; peers must run the same torch version (its CPU generator defines the stream).
"""

from __future__ import annotations

import torch

# Direction families by name: what ``ZOConfig.directions`` may hold (recorded in config.json).
FAMILIES = {
    "torch-normal": "standard Gaussian from torch's CPU generator (peers need the same torch version)",
}

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def tensor_seed(seed: int, index: int) -> int:
    """Seed of tensor ``index``'s stream for direction ``seed`` (both non-negative)."""
    return _splitmix64((seed ^ _splitmix64(index)) & _MASK)


class DirectionGenerator:
    """Fills per-tensor Gaussian directions into reusable CPU buffers.

    It also owns the scratch tensors of direction arithmetic (:meth:`scratch`): one buffer per
    (purpose, shape), so a round allocates nothing after its first tensor of each shape and
    never holds more than a few tensors' worth of temporaries. (Fresh allocations are not only
    wasteful: on some machines every new page costs a fault, which dominated round time.)
    """

    def __init__(self, family: str = "torch-normal") -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown direction family {family!r} (choose from {', '.join(FAMILIES)})")
        self.family = family
        self._gen = torch.Generator(device="cpu")
        self._buffers: dict[tuple, torch.Tensor] = {}

    def scratch(self, tag: str, shape: torch.Size, device: torch.device | str = "cpu") -> torch.Tensor:
        """A float32 buffer for ``tag`` (uninitialised; valid until the next call with this key)."""
        key = (tag, tuple(shape), str(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(tuple(shape), dtype=torch.float32, device=device)
        return buf

    def fill(self, seed: int, index: int, shape: torch.Size) -> torch.Tensor:
        """Return u_i for direction ``seed`` (a float32 CPU buffer, valid until the next fill)."""
        self._gen.manual_seed(tensor_seed(seed, index))
        return self.scratch("u", shape).normal_(generator=self._gen)


def direction(seed: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """The whole direction for ``seed`` as fresh tensors (for tests and small models)."""
    gen = DirectionGenerator()
    return [gen.fill(seed, i, s).clone() for i, s in enumerate(shapes)]
