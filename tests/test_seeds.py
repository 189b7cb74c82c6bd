"""Known answers for the protocol's identities: direction seeds and direction elements.

Every value checked here comes from outside the code under test: SplitMix64's published
outputs, Random123's Philox vectors, or a derivation written out below from the formula in
:mod:`hiso.core.seeds`'s docstring (the protocol a foreign peer would implement). A change to
the seed derivation (a swapped field, a shifted bit, another domain constant) or to how a seed
becomes a direction fails these fast tests, not only the slow end-to-end ones.
"""

import numpy as np
import pytest
import torch

from hiso.core import Server
from hiso.core.directions import DirectionGenerator
from hiso.core.seeds import round_seeds, run_key, seeds_of

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64_stream(state: int, n: int) -> list[int]:
    """Vigna's splitmix64.c ``next()``, n times from ``state``: written here, not imported."""
    out = []
    for _ in range(n):
        state = (state + GOLDEN) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


def mix(x: int) -> int:
    """mix64(x) of the protocol = the first output of SplitMix64 started at state x."""
    return splitmix64_stream(x, 1)[0]


def protocol_seed(run_seed: int, rnd: int, attempt: int, k: int, p: int, P: int) -> int:
    """The docstring's derivation, field by field."""
    key = mix(run_seed ^ int.from_bytes(b"hiso-see", "big"))
    counter = rnd << 28 | attempt << 16 | (k * P + p)
    return mix(counter ^ key)


def test_reference_splitmix64_matches_published_outputs():
    # Rosetta Code, "Pseudo-random numbers/Splitmix64": the first five outputs for seed 1234567.
    assert splitmix64_stream(1234567, 5) == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                             4593380528125082431, 16408922859458223821]
    # Vigna's splitmix64.c started at 0 (the usual xoshiro seeding test vector).
    assert splitmix64_stream(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_run_key_is_splitmix_of_the_seed_xor_the_domain():
    domain = 0x6869736F2D736565  # b"hiso-see"
    assert int.from_bytes(b"hiso-see", "big") == domain
    # run seed chosen so that seed ^ domain is Rosetta's 1234567: the key is its first output
    assert run_key(domain ^ 1234567) == 6457827717110365317
    assert run_key(domain) == 0xE220A8397B1DCDAF  # seed ^ domain == 0: Vigna's first output


def test_pinned_seed_from_published_vectors():
    """A counter chosen so that counter ^ key == 0: the seed is SplitMix64(0)'s first output."""
    run_seed = 0x6869736F2D736565 ^ 1234567     # key = 6457827717110365317 (Rosetta, above)
    key = 6457827717110365317
    rnd, attempt, j = key >> 28, (key >> 16) & 0xFFF, key & 0xFFFF  # every field non-zero and distinct
    assert (rnd, attempt, j) == (24057282943, 2824, 64645)
    P = 7
    k, p = divmod(j, P)
    tau = k + 1
    assert round_seeds(run_seed, rnd, attempt, tau, P)[k, p] == 0xE220A8397B1DCDAF
    # the next perturbation's counter is key ^ 1 ... and one attempt later key ^ (1 << 16):
    # neither is a SplitMix64 state of the published streams, so they are checked by the derivation
    assert round_seeds(run_seed, rnd, attempt, tau + 1, P)[k + 1, p] == protocol_seed(run_seed, rnd, attempt, k + 1, p, P)


@pytest.mark.parametrize("run_seed", [0, 7, 2**64 - 1, 0x0123456789ABCDEF])
def test_round_seeds_follow_the_published_derivation(run_seed):
    # distinct small fields, tau != P, and a round above 2^12 and 2^16 so no field can stand in
    # for another: swapping round/attempt, k/p, the order of k * P + p, or the key and the
    # counter changes these values
    tau, P = 3, 5
    for rnd, attempt in [(0, 0), (1, 0), (0, 1), (3, 2), (2, 3), (70_001, 5), (5, 4095), (2**36 - 1, 1)]:
        got = round_seeds(run_seed, rnd, attempt, tau, P)
        assert got.shape == (tau, P) and got.dtype == np.uint64
        want = [[protocol_seed(run_seed, rnd, attempt, k, p, P) for p in range(P)] for k in range(tau)]
        assert got.tolist() == want, (rnd, attempt)
    # the batched form gives the same rows
    many = seeds_of(run_seed, [3, 2], [2, 3], tau, P)
    assert many[0].tolist() == round_seeds(run_seed, 3, 2, tau, P).tolist()
    assert many[1].tolist() == round_seeds(run_seed, 2, 3, tau, P).tolist()


def test_server_plans_the_derived_seeds():
    srv = Server(10, 3, 2, 5, seed=11)
    plan = srv.plan()
    assert plan.round == 0 and plan.attempt == 0
    assert plan.seeds.tolist() == [[protocol_seed(11, 0, 0, k, p, 5) for p in range(5)] for k in range(2)]


# Random123's kat_vectors, "philox4x32 10", counter 0 and key 0: the block of direction seed 0,
# tensor 0, block 0 (counter = (block, 0, tensor, 0), key = (seed low, seed high)).
PHILOX_ZERO = (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)


@pytest.mark.parametrize("kernel", ["torch", "numba"])
def test_direction_elements_from_random123_vector(kernel):
    gen = DirectionGenerator("philox-rademacher", kernel=kernel)
    if gen.kernel != kernel:
        pytest.skip(f"{kernel} kernel not available")
    z = gen.fill(0, 0, torch.Size([130])).clone()
    # element 32 k + t is -1 where bit t of word k is set
    want = [-1.0 if (PHILOX_ZERO[i // 32] >> (i % 32)) & 1 else 1.0 for i in range(128)]
    assert z[:128].tolist() == want
    assert z[:8].tolist() == [-1, 1, -1, 1, -1, 1, -1, -1]  # 0x...D5 = 1101 0101, low bit first
    # the Gaussian family reads the same words 16 bits at a time through its pinned table
    g = DirectionGenerator("philox-gaussian", kernel=kernel).fill(0, 0, torch.Size([8])).clone()
    from hiso.kernels.philox import gaussian_table
    t = gaussian_table()
    halves = [(w >> s) & 0xFFFF for w in PHILOX_ZERO for s in (0, 16)]
    assert halves[:2] == [0xE8D5, 0x6627]
    assert g.tolist() == [float(t[h]) for h in halves]
    # the table is the quantised inverse normal CDF: entry u near Phi^{-1}((u + 1/2) / 2^16)
    from statistics import NormalDist
    for h in halves:
        assert abs(float(t[h]) - NormalDist().inv_cdf((h + 0.5) / 65536)) < 2e-4 * (1 + abs(float(t[h])))
