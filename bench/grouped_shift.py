"""One perturbation of a whole model: ``shift`` per tensor (one launch each on a GPU) against
``shift_all`` (one grouped launch), on SmolLM2-135M's 272 parameter shapes (134.5M elements).

    python bench/grouped_shift.py --device cuda --repeat 20
    python bench/grouped_shift.py --device cpu --threads 2 --repeat 3     # CPU: shift_all loops

Times are synchronised (``torch.cuda.synchronize`` after each repetition), best of ``--repeat``;
``--points P`` also times one call for P points (a seed per slot, as a batched round would).
"""

from __future__ import annotations

import argparse
import time

import torch

from hiso.core.directions import DirectionGenerator

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152


def smollm2_shapes(layers: int = LAYERS) -> list[tuple[int, ...]]:
    """named_parameters() shapes of SmolLM2-135M (tied head), in order: 134,515,008 elements."""
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
             (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER), (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN), *layer * layers, (HIDDEN,)]


def best_of(fn, repeat: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--points", type=int, default=5)
    ap.add_argument("--family", default="philox-rademacher")
    ap.add_argument("--layers", type=int, default=LAYERS, help="fewer layers for a quick check (default: 30)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev, cuda = args.device, args.device.startswith("cuda")
    shapes = smollm2_shapes(args.layers)
    xs = [torch.randn(s, device=dev) for s in shapes]
    hs = [torch.rand(s, device=dev) + 0.5 for s in shapes]
    outs = [torch.empty_like(x) for x in xs]
    idx = list(range(len(xs)))
    gen = DirectionGenerator(args.family)
    n = sum(x.numel() for x in xs)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"device: {name}, {len(xs)} tensors, {n:,} elements, {args.family}, H given")

    def one_by_one():
        for o, x, h, i in zip(outs, xs, hs, idx):
            gen.shift(o, x, 7, i, 1e-3, h)

    t_loop = best_of(one_by_one, args.repeat, cuda)
    t_all = best_of(lambda: gen.shift_all(outs, xs, 7, idx, 1e-3, hs), args.repeat, cuda)
    assert all(torch.equal(o, gen.shift(torch.empty_like(x), x, 7, i, 1e-3, h))
               for o, x, h, i in list(zip(outs, xs, hs, idx))[:3])
    P = args.points
    outs_p = [torch.empty_like(x) for _ in range(P) for x in xs]
    seeds = [7 + p for p in range(P) for _ in xs]
    t_p = best_of(lambda: gen.shift_all(outs_p, xs * P, seeds, idx * P, 1e-3, hs * P), args.repeat, cuda)
    gb = n * 4 * 3 / 1e9  # read x and h, write out
    print("| what | ms per model | GB/s (x, h read, out written) |")
    print("|---|---:|---:|")
    print(f"| shift per tensor ({len(xs)} launches on CUDA) | {t_loop * 1e3:.2f} | {gb / t_loop:.1f} |")
    print(f"| shift_all (one launch on CUDA; a loop on the CPU) | {t_all * 1e3:.2f} | {gb / t_all:.1f} |")
    print(f"| shift_all, {P} points in one call, per point | {t_p / P * 1e3:.2f} | {gb * P / t_p:.1f} |")


if __name__ == "__main__":
    main()
