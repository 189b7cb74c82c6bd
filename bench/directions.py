"""Direction work per family, measured in one run: generation (fill), a perturbation (shift:
generate, scale by mu H^{-1/2}, add) and a replay step (combine of P directions), against torch's
``normal_`` on the same element count and thread count.

    python bench/directions.py --numel 10000000 --threads 1 2 --repeat 3
    python bench/directions.py --device cuda --numel 100000000 --threads 1


Prints one markdown table; every ratio is "torch normal_ time / this time" measured in the same
process (higher: faster than torch's generator).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hiso.core.directions import FAMILIES, DirectionGenerator


def best_of(fn, repeat: int, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()  # warm-up (numba compiles on first use; CUDA loads its kernels)
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()  # a CUDA launch returns before the work is done
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=10_000_000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--perturbations", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (threads then only set torch's CPU pool)")
    args = ap.parse_args()
    n, P, dev = args.numel, args.perturbations, args.device
    shape = torch.Size([n])
    x, h = torch.randn(n, device=dev), torch.rand(n, device=dev) + 0.5
    out = torch.empty(n, device=dev)
    seeds = np.arange(1, P + 1, dtype=np.uint64)
    scalars = np.linspace(-1, 1, P).astype(np.float32)
    print(f"device: {torch.cuda.get_device_name(dev) if dev.startswith('cuda') else 'cpu'}, {n:,} elements")
    print(f"| threads | family | fill (M elem/s) | x torch normal_ | shift (s) | combine of P={P} (s) |")
    print("|---:|---|---:|---:|---:|---:|")
    for t in args.threads:
        torch.set_num_threads(t)
        g = torch.Generator(device=dev).manual_seed(0)
        buf = torch.empty(n, device=dev)
        t_ref = best_of(lambda: buf.normal_(generator=g), args.repeat, dev)
        print(f"| {t} | torch `normal_` alone | {n / t_ref / 1e6:.0f} | 1.00 | | |")
        for fam in FAMILIES:
            gen = DirectionGenerator(fam)
            t_fill = best_of(lambda: gen.fill(7, 0, shape, dev), args.repeat, dev)
            t_shift = best_of(lambda: gen.shift(out, x, 7, 0, 1e-3, h), args.repeat, dev)
            t_comb = best_of(lambda: gen.combine(0, shape, seeds, scalars, h, dev), args.repeat, dev)
            print(f"| {t} | {fam} | {n / t_fill / 1e6:.0f} | {t_ref / t_fill:.2f} | {t_shift:.3f} | {t_comb:.3f} |")


if __name__ == "__main__":
    main()
