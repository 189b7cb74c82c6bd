"""Known answers for what happens to a client's scalars before and on the wire (issue 41, item
3): local DP noise is independent per client, and every scalar format rounds as documented.

The reference rounding here is exact rational arithmetic (fractions), not numpy's or torch's
casts; ties are built from the formats' bit patterns. Each test names the broken rule it catches."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from hiso.config import load_config
from hiso.core import Downlink, ModelState, Perturber
from hiso.core.client import answer
from hiso.core.scalars import encode_scalars, int8_scale, quantize
from hiso.methods.privacy import DPConfig, private_answer


# ---------------------------------------------------------------- local DP: one draw per client

class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.full((2, 3), 0.5)), nn.Parameter(torch.ones(2))

    def forward(self, x):
        return ((self.w @ x + self.b) ** 2).sum()


def _local_dp_answer(cid, attempt=0):
    zo = load_config(None, algorithm="decomfl", task="quadratic", lr=0.01, perturbations=3, local_steps=2,
                     dp_clip=1.0, dp_noise_multiplier=1.0, dp_mode="local").zo()
    state = ModelState(_Lin(), zo)
    seeds = np.arange(1, 7, dtype=np.uint64).reshape(2, 3)
    x = torch.tensor([1.0, -2.0, 0.5])
    up = answer(cid, state, Perturber(state.model, state.params), lambda m, b: m(b), lambda r, k: x,
                Downlink(0, seeds, 0, attempt=attempt), dp_seed=11)
    return up.scalars


def test_local_dp_clients_with_the_same_scalars_get_different_noise_and_a_client_its_own_again():
    """Two clients with the same model, batches, seeds, round, attempt and noise secret (the
    simulator shares one secret): only the client id keeps their noise apart. Break caught: a
    local draw that ignores the client id (or is the server's draw)."""
    a, b = _local_dp_answer(3), _local_dp_answer(4)
    assert np.array_equal(a, _local_dp_answer(3))  # the same client, round and attempt: the same draw
    # what is sent is clip(g) + noise with std z C = 1: two clients' answers differ by their noise
    assert np.abs(a - b).min() > 1e-4 and np.std(a - b) > 0.3
    assert not np.array_equal(a, _local_dp_answer(3, attempt=1))


def test_local_dp_draws_of_many_clients_are_uncorrelated_with_the_configured_std():
    """40 clients, 2,000 entries each, the same zero scalars: every pairwise correlation is
    within 5/sqrt(2000) = 0.11 of 0 (one pair's sd is 1/sqrt(2000)), every std within 5 % of
    z C = 0.5. Break caught: draws that ignore the client id."""
    cfg = DPConfig(clip=0.25, noise_multiplier=2.0, mode="local")
    n, L = 40, 2000
    draws = np.stack([private_answer(np.zeros((4, L // 4)), cfg, 99, 7, 0, c).reshape(-1).astype(np.float64)
                      for c in range(n)])
    assert np.allclose(draws.std(axis=1), 0.5, rtol=0.05)
    corr = np.corrcoef(draws)
    off = corr[~np.eye(n, dtype=bool)]
    assert np.abs(off).max() < 5 / math.sqrt(L)


# ---------------------------------------------------------------- float formats: nearest, ties to even

# significand bits (with the implicit one) and the exponent floor (e of frexp's 2^e at the
# smallest normal value, below which the grid's spacing stays 2^(emin - p)) of each format
_FORMATS = {"float16": (11, -13), "bfloat16": (8, -125), "float32": (24, -125)}


def _exponent(q: Fraction) -> int:
    """e with 2^(e-1) <= |q| < 2^e (q != 0)."""
    e = math.floor(math.log2(abs(q))) + 1
    while Fraction(2) ** (e - 1) > abs(q):
        e -= 1
    while Fraction(2) ** e <= abs(q):
        e += 1
    return e


def _nearest_even(q: Fraction, p: int, emin: int) -> Fraction:
    """q rounded to p significant bits, ties to even, subnormal below 2^(emin - 1) (exact)."""
    if q == 0:
        return q
    e = max(_exponent(q), emin)
    return round(q * Fraction(2) ** (p - e)) * Fraction(2) ** (e - p)  # Fraction's round: half to even


def _grid(dtype, bits):
    """Values of the format from raw bit patterns (as float64)."""
    bits = np.asarray(bits)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _ties(dtype, n=400, seed=0):
    """Midpoints between neighbouring finite values (positive and negative, subnormal and normal),
    with the neighbour whose last significand bit is 0: ties to even picks it."""
    rng = np.random.default_rng(seed)
    top = {"float16": 0x7BFF, "bfloat16": 0x7F7F, "float32": 0x7F7FFFFF}[dtype]  # the largest finite value
    lo = rng.integers(0, top, n)
    lo[:4] = [0, 1, 2, top - 1]  # 0 | smallest subnormal, and the top of the range
    sign = rng.integers(0, 2, n) * -2 + 1
    a, b = _grid(dtype, lo), _grid(dtype, lo + 1)
    return sign * (a + b) / 2, sign * np.where(lo % 2 == 0, a, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_float_formats_round_ties_to_even_in_both_directions(dtype):
    """Break caught: rounding half up (or half away from zero), or truncating."""
    x, even = _ties(dtype)
    src = x.astype(np.float64 if dtype == "float32" else np.float32)  # float32 from float64 scalars
    assert np.array_equal(src.astype(np.float64), x)  # the ties are exact in the input
    assert (np.abs(even) < np.abs(x)).any() and (np.abs(even) > np.abs(x)).any()  # down and up both occur
    assert np.array_equal(quantize(src, dtype).astype(np.float64), even)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_float_formats_round_to_nearest(dtype):
    """Random values near and far from ties against the exact reference. Break caught: any
    rounding that is not to nearest (a tie +- one input ulp goes to the nearer neighbour)."""
    p, emin = _FORMATS[dtype]
    rng = np.random.default_rng(1)
    big = 6e4 if dtype == "float16" else 1e30
    x = np.concatenate([rng.standard_normal(300) * 10.0 ** rng.uniform(-9, 4, 300), rng.uniform(-big, big, 50)])
    ties = _ties(dtype, 100, seed=2)[0]
    src_t = np.float64 if dtype == "float32" else np.float32
    x = np.concatenate([x, np.nextafter(ties.astype(src_t), np.inf), np.nextafter(ties.astype(src_t), -np.inf)])
    src = x.astype(src_t)
    want = [float(_nearest_even(Fraction(float(v)), p, emin)) for v in src]
    assert quantize(src, dtype).astype(np.float64).tolist() == want


def test_float16_overflow_past_the_last_tie_is_refused():
    """65520 is the tie between 65504 (odd) and 2^16 (not finite): ties to even overflows."""
    assert quantize(np.float32(65519.99), "float16") == 65504
    with pytest.raises(FloatingPointError):
        encode_scalars(np.array([65520.0], np.float32), "float16")


def test_bfloat16_refuses_every_nan_payload():
    """A NaN whose low 16 bits would carry into the sign under rounding (0x7FFFFFFF -> -0.0 once)
    is still refused, not sent as a zero."""
    for bits in (0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000):
        with pytest.raises(FloatingPointError):
            encode_scalars(np.array([bits], np.uint32).view(np.float32), "bfloat16")


# ---------------------------------------------------------------- int8: the block's scale, codes to even

def _int8_ref(x32):
    """Scale: max|x| / 127 rounded to float32, then up to 17 significant bits; codes: the float32
    quotient x / s rounded half to even, clipped to +-127 (scalars.py's rule, in fractions)."""
    m = Fraction(float(np.max(np.abs(x32))))
    q = _nearest_even(m / 127, 24, -125)
    e = _exponent(q)
    s = math.ceil(q * Fraction(2) ** (17 - e)) * Fraction(2) ** (e - 17)
    codes = [max(-127, min(127, round(_nearest_even(Fraction(float(v)) / s, 24, -125)))) for v in x32]
    return s, codes


def test_int8_ties_go_to_the_even_code_and_the_largest_is_127():
    """s = 15.875 / 127 = 1/8 exactly; x = (k + 1/2) / 8 is a tie between codes k and k + 1.
    Break caught: codes rounded half up or half away from zero."""
    halves = np.array([0.5, 1.5, 2.5, 3.5, 125.5, 126.5], np.float32)
    x = np.concatenate([[15.875], halves / 8, -halves / 8]).astype(np.float32)
    assert int8_scale(x) == np.float32(0.125)
    want = [127, 0, 2, 2, 4, 126, 126, 0, -2, -2, -4, -126, -126]
    assert quantize(x, "int8").tolist() == [c / 8 for c in want]
    assert _int8_ref(x) == (Fraction(1, 8), want)


def test_int8_scale_is_rounded_up_to_17_bits_and_codes_match_the_exact_rule():
    """Random blocks over 40 decades. Break caught: a scale rounded to nearest or down (then
    max|x| / s may pass 127.5 and clip), or to another width; codes that are not the rule's."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        x = (rng.standard_normal(rng.integers(1, 12)) * 10.0 ** rng.uniform(-20, 20)).astype(np.float32)
        s, codes = _int8_ref(x)
        assert Fraction(float(int8_scale(x))) == s
        assert max(abs(c) for c in codes) == 127
        assert [Fraction(float(v)) for v in quantize(x, "int8")] == [c * s for c in codes]


def test_bfloat16_ties_on_the_wire_go_to_the_even_neighbour_worked_by_hand():
    """bfloat16 keeps 8 significant bits: 1 + 2^-8 lies halfway between 1 (0x3F80, even) and
    1 + 2^-7 (0x3F81, odd), so it goes down; 1 + 3 2^-8 halfway between 0x3F81 (odd) and
    1 + 2^-6 (0x3F82, even), so up; the same for their negatives. Half-up (or away from zero)
    sends the first up; truncation the second down."""
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8)], np.float32)
    assert np.frombuffer(encode_scalars(x, "bfloat16"), "<u2").tolist() == [0x3F80, 0x3F82, 0xBF80, 0xBF82]
