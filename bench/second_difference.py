"""Can a second-difference scalar (HiZOO's extra forward) teach a diagonal preconditioner curvature?

    python bench/second_difference.py --dims 100,1000,10000,100000 --samples 1000,4000,16000

HiZOO-style estimators spend one more forward per direction u for the second difference
``c = (f(x + mu u) + f(x - mu u) - 2 f(x)) / mu^2 = u^T H u + O(mu)``, a scalar a federation could
log beside the gradient scalars, and read the diagonal of H from ``c * u_i^2``. On a quadratic
with known diagonal curvature (lambda log-uniform over 1e-2..1e2, as ``hiso.tasks.quadratic``)
``c`` is exact, so what remains is the estimator's own noise. For each d and number of samples N
(directions: rounds x clients x P in a federation) this prints the correlation of log lambda with
the estimate, clipped at a floor, for

* ``plain``: mean of ``c (u_i^2 - 1) / 2`` (unbiased for lambda_i with Gaussian u);
* ``centred``: the same with ``c`` minus its running mean (a baseline, which removes the tr(H)^2 term);

and the predicted signal-to-noise per coordinate, ``sqrt(2N) / d`` (plain: the noise is ~tr H) and
``sqrt(N / d)`` (centred: the noise is ~||H||_F). With Rademacher directions ``u_i^2 = 1`` and both
estimates are identically zero: the second difference then carries no per-coordinate information.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def estimate(lam: np.ndarray, n: int, rng: np.random.Generator, chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """(plain, centred) estimates of lam from n Gaussian second differences, drawn in chunks."""
    d = len(lam)
    plain = np.zeros(d)
    centred = np.zeros(d)
    c_sum, done = 0.0, 0
    rows = max(1, chunk // d)
    while done < n:
        k = min(rows, n - done)
        u2 = rng.standard_normal((k, d), dtype=np.float32) ** 2
        c = u2 @ lam.astype(np.float32)  # u^T diag(lam) u, exact for the quadratic
        w = u2 - 1.0
        plain += (c[:, None] * w).sum(0)
        # running baseline: each sample's c minus the mean of the c's before it (its own excluded)
        prev = c_sum + np.concatenate([[0.0], np.cumsum(c[:-1], dtype=np.float64)])
        base = np.where(done + np.arange(k) > 0, prev / np.maximum(done + np.arange(k), 1), c[0])
        centred += ((c - base)[:, None] * w).sum(0)
        c_sum += float(c.sum(dtype=np.float64))
        done += k
    return plain / (2 * n), centred / (2 * n)


def corr_log(est: np.ndarray, lam: np.ndarray) -> float:
    floor = 1e-3 * lam.min()
    return float(np.corrcoef(np.log(np.maximum(est, floor)), np.log(lam))[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="100,1000,10000,100000")
    ap.add_argument("--samples", default="1000,4000,16000")
    ap.add_argument("--max-work", type=float, default=1.6e9, help="skip d x N above this (memory-light, but time)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{'d':>7} {'N':>6} | {'corr plain':>10} {'SNR sqrt(2N)/d':>14} | {'corr centred':>12} "
          f"{'SNR sqrt(N/d)':>13} | s")
    for d in (int(x) for x in args.dims.split(",")):
        rng = np.random.default_rng([args.seed, d])
        lam = np.exp(rng.uniform(np.log(1e-2), np.log(1e2), size=d))
        for n in (int(x) for x in args.samples.split(",")):
            if d * n > args.max_work:
                continue
            t0 = time.perf_counter()
            plain, centred = estimate(lam, n, rng)
            print(f"{d:>7} {n:>6} | {corr_log(plain, lam):>+10.3f} {np.sqrt(2 * n) / d:>14.3g} | "
                  f"{corr_log(centred, lam):>+12.3f} {np.sqrt(n / d):>13.3g} | {time.perf_counter() - t0:.1f}")


if __name__ == "__main__":
    main()
