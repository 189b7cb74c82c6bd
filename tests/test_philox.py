"""The Philox direction families: known answers, the definition, and equality of the kernels."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hiso
from hiso.core import philox
from hiso.core.directions import DEFAULT_FAMILY, FAMILIES, DirectionGenerator, direction

PHILOX = ["philox-rademacher", "philox-gaussian"]

# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter (4 words), key (2 words), output.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

needs_numba = pytest.mark.skipif(DirectionGenerator("philox-rademacher").kernel != "numba",
                                 reason="numba is not importable here: only the torch kernels run")


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_known_answers_reference_and_torch(ctr, key, want):
    assert philox.philox4x32_10(ctr, key) == want
    out = philox.philox_torch([torch.tensor([c], dtype=torch.int64) for c in ctr], key)
    assert tuple(int(w) for w in out) == want


@needs_numba
@pytest.mark.parametrize("ctr,key,want", KAT)
def test_known_answers_numba(ctr, key, want):
    from hiso.core import _philox_numba
    assert tuple(int(w) for w in _philox_numba.philox_words(*ctr, *key)) == want


def _reference_element(family: str, seed: int, index: int, j: int) -> float:
    """Element j of tensor index, straight from the definition in hiso.core.directions."""
    per = philox.PER_BLOCK[family]
    b, r = divmod(j, per)
    w = philox.philox4x32_10((b & 0xFFFFFFFF, b >> 32, index, 0), (seed & 0xFFFFFFFF, seed >> 32))
    if family == "philox-rademacher":
        k, t = divmod(r, 32)
        return -1.0 if (w[k] >> t) & 1 else 1.0
    k, h = divmod(r, 2)
    return float(philox.gaussian_table()[(w[k] >> (16 * h)) & 0xFFFF])


@pytest.mark.parametrize("family", PHILOX)
@pytest.mark.parametrize("kernel", ["torch", "numba"])
def test_fill_follows_the_definition(family, kernel):
    if kernel == "numba" and DirectionGenerator(family).kernel != "numba":
        pytest.skip("numba is not importable here")
    seed, index, n = 2**64 - 3, 5, 70_001  # more than one numba work item, and a ragged tail
    z = DirectionGenerator(family, kernel=kernel).fill(seed, index, torch.Size([n]))
    for j in [0, 1, 7, 8, 31, 32, 127, 128, 65_535, 65_536, n - 1]:
        assert float(z[j]) == _reference_element(family, seed, index, j), j
    # blocks far along the counter (the high counter word), through the torch kernel
    first = 2**32 - 1
    w = philox.words_torch(seed, index, first, 2, "cpu")
    for r in range(2):
        b = first + r
        assert tuple(int(v) for v in w[r]) == philox.philox4x32_10((b & 0xFFFFFFFF, b >> 32, index, 0),
                                                                   philox.key_of(seed))


def test_families_are_named_and_every_layer_has_the_same_default():
    assert DEFAULT_FAMILY in FAMILIES and set(PHILOX) <= set(FAMILIES)
    from hiso.config import RunConfig
    from hiso.core import ZOConfig
    assert ZOConfig(lr=0.1).directions == DEFAULT_FAMILY == RunConfig().directions
    with pytest.raises(ValueError, match="unknown direction family"):
        DirectionGenerator("philox-uniform")
    with pytest.raises(ValueError, match="unknown direction kernel"):
        DirectionGenerator(DEFAULT_FAMILY, kernel="cuda")


def test_distributions():
    r = direction(11, [torch.Size([400_000])], "philox-rademacher")[0]
    assert set(torch.unique(r).tolist()) == {-1.0, 1.0} and abs(float(r.mean())) < 0.01
    g = direction(11, [torch.Size([400_000])], "philox-gaussian")[0]
    assert abs(float(g.mean())) < 0.01 and abs(float(g.std()) - 1) < 0.01
    t = philox.gaussian_table().astype(np.float64)
    assert np.array_equal(t, -t[::-1]) and np.all(np.diff(t) > 0) and abs(np.mean(t * t) - 1) < 1e-6
    # every 16-bit level is equally likely: the fraction below 0 is one half, below T[u] is (u+1)/2^16
    assert abs(float((g < 0).double().mean()) - 0.5) < 0.005
    # tensors of one direction, and directions of consecutive seeds, are different streams
    a, b = direction(5, [torch.Size([256]), torch.Size([256])])
    assert not torch.equal(a, b) and not torch.equal(a, direction(6, [torch.Size([256])])[0])


def _cases(device="cpu"):
    torch.manual_seed(0)
    n = 70_001
    x = torch.randn(n, device=device)
    d = 1e-3 * torch.randn(n, device=device)
    h = torch.rand(n, device=device) * 4 + 1e-3
    return n, x, d, h


@needs_numba
@pytest.mark.parametrize("family", PHILOX)
def test_numba_and_torch_kernels_give_identical_bits(family):
    n, x, d, h = _cases()
    nb, tt = DirectionGenerator(family, kernel="numba"), DirectionGenerator(family, kernel="torch")
    for hh in (None, h):
        for dd in (None, d):
            a = nb.shift(torch.empty(n), x, 99, 3, -1e-3, hh, dd)
            b = tt.shift(torch.empty(n), x, 99, 3, -1e-3, hh, dd)
            assert torch.equal(a, b)
        seeds = np.array([1, 2**63 + 7, 42, 9], dtype=np.uint64)
        scalars = np.array([0.5, -3.25, 1e-4, 7.0], dtype=np.float32)
        assert torch.equal(nb.combine(2, x.shape, seeds, scalars, hh).clone(), tt.combine(2, x.shape, seeds, scalars, hh))


@pytest.mark.parametrize("family", PHILOX)
def test_fused_arithmetic_is_the_defined_binary32_sequence(family):
    """shift and combine compute the documented operations, each rounded once (checked in numpy)."""
    n, x, d, h = _cases()
    gen = DirectionGenerator(family)
    r = np.float32(1) / np.sqrt(h.numpy())  # numpy's float32 sqrt and division are IEEE, correctly rounded
    z = gen.fill(8, 1, x.shape).numpy().copy()
    s = np.float32(2e-3)
    want = (x.numpy() + d.numpy()) + (z * r) * s
    assert np.array_equal(gen.shift(torch.empty(n), x, 8, 1, 2e-3, h, d).numpy(), want)
    seeds, scalars = np.array([8, 9], dtype=np.uint64), np.array([0.3, -1.1], dtype=np.float32)
    c = (scalars.astype(np.float64) / 2).astype(np.float32)
    z2 = gen.fill(9, 1, x.shape).numpy().copy()
    want = ((np.float32(0) + z * c[0]) + z2 * c[1]) * r
    assert np.array_equal(gen.combine(1, x.shape, seeds, scalars, h).numpy(), want)


@pytest.mark.parametrize("family", PHILOX)
def test_bfloat16_parameters_get_the_rounded_float32_shift(family):
    n, x, d, h = _cases()
    xb = x.to(torch.bfloat16)
    gen = DirectionGenerator(family)
    out = gen.shift(torch.empty(n, dtype=torch.bfloat16), xb, 4, 0, 1e-2, h, d)
    want = DirectionGenerator(family).shift(torch.empty(n), xb.float(), 4, 0, 1e-2, h, d).to(torch.bfloat16)
    assert torch.equal(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the CPU-vs-CUDA equality "
                    "test runs only where a GPU is present (the known-answer tests above run everywhere)")
@pytest.mark.parametrize("family", PHILOX)
@pytest.mark.parametrize("kernel", ["auto", "torch"])  # auto: the fused Triton kernels where Triton imports
def test_cpu_and_cuda_give_identical_directions_and_arithmetic(family, kernel):
    n, x, d, h = _cases()
    cpu, gpu = DirectionGenerator(family), DirectionGenerator(family, kernel=kernel)
    if kernel == "auto" and importlib.util.find_spec("triton") is not None:
        assert gpu._tr is not None  # the CUDA tensors below go through the Triton kernels
    assert torch.equal(cpu.fill(77, 4, x.shape).clone(), gpu.fill(77, 4, x.shape, "cuda").cpu())
    for hh in (None, h):
        for dd in (None, d):
            a = cpu.shift(torch.empty(n), x, 77, 4, 1e-3, hh, dd)
            b = gpu.shift(torch.empty(n, device="cuda"), x.cuda(), 77, 4, 1e-3,
                          None if hh is None else hh.cuda(), None if dd is None else dd.cuda())
            assert torch.equal(a, b.cpu())
        seeds, scalars = np.array([3, 2**64 - 1], dtype=np.uint64), np.array([1.5, -0.25], dtype=np.float32)
        a = cpu.combine(4, x.shape, seeds, scalars, hh).clone()
        b = gpu.combine(4, x.shape, seeds, scalars, None if hh is None else hh.cuda(), "cuda")
        assert torch.equal(a, b.cpu())


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: numba's pool cannot change torch's thread count")
def test_numba_kernels_leave_torchs_thread_count_alone():
    """numba's OpenMP pool, once started, must not raise torch's thread count (with --threads 1
    and --jobs 2 that oversubscribes the cores with spinning threads); a fresh process, since the
    pool starts once per process."""
    code = ("import torch, numpy as np\n"
            "torch.set_num_threads(1)\n"
            "from hiso.core.directions import DirectionGenerator\n"
            "g = DirectionGenerator('philox-rademacher', kernel='numba')\n"
            "g.fill(3, 0, torch.Size([300000]))\n"
            "g.combine(0, torch.Size([300000]), np.arange(1, 4, dtype=np.uint64), np.ones(3, np.float32))\n"
            "print(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if k not in _THREAD_VARS},  # conftest sets them to 1
                              "PYTHONPATH": str(Path(hiso.__file__).parents[1])})
    assert out.stdout.strip() == "1"
