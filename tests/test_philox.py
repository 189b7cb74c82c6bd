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
from hiso.kernels import philox
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
    from numba import njit

    from hiso.kernels.philox_numba import U, philox

    @njit
    def philox_words(c0, c1, c2, c3, k0, k1):  # one block of the compiled generator
        return philox(U(c0), U(c1), U(c2), U(c3), U(k0), U(k1))

    assert tuple(int(w) for w in philox_words(*ctr, *key)) == want


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


# ---------------------------------------------------------------- shift_all: many tensors, one seed

GROUP_SHAPES = [(300,), (5, 7), (1,), (1025,), (0,), (2048,)]  # ragged, across BLOCK = 1024, empty
GROUP_INDICES = [4, 0, 9, 2**31 + 5, 3, 270]


def _group(device="cpu"):
    torch.manual_seed(1)
    xs = [torch.randn(s, device=device) for s in GROUP_SHAPES]
    hs = [torch.rand(s, device=device) * 4 + 1e-3 for s in GROUP_SHAPES]
    ds = [1e-3 * torch.randn(s, device=device) for s in GROUP_SHAPES]
    return xs, hs, ds


def _one_by_one(gen, xs, seeds, scale, hs, ds):
    return [gen.shift(torch.empty_like(x), x, s, i, scale, None if hs is None else hs[j], None if ds is None else ds[j])
            for j, (x, s, i) in enumerate(zip(xs, seeds, GROUP_INDICES))]


@pytest.mark.parametrize("family,kernel", [(f, k) for f in PHILOX for k in ("auto", "torch")] + [("torch-normal", "auto")])
def test_shift_all_gives_the_bits_of_shift_per_tensor(family, kernel):
    gen = DirectionGenerator(family, kernel=kernel)
    xs, hs, ds = _group()
    seeds = [2**64 - 3 - j for j in range(len(xs))]
    for hh in (None, hs):
        for dd in (None, ds):
            want = _one_by_one(gen, xs, [77] * len(xs), -1e-3, hh, dd)
            got = gen.shift_all([torch.empty_like(x) for x in xs], xs, 77, GROUP_INDICES, -1e-3, hh, dd)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            want = _one_by_one(gen, xs, seeds, 2e-3, hh, dd)  # a seed per tensor (the P points in one call)
            got = gen.shift_all([torch.empty_like(x) for x in xs], xs, seeds, GROUP_INDICES, 2e-3, hh, dd)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    xb = [x.to(torch.bfloat16) for x in xs]  # bfloat16 parameters: each the rounded float32 shift
    got = gen.shift_all([torch.empty_like(x) for x in xb], xb, 5, GROUP_INDICES, 1e-2)
    assert all(torch.equal(a, gen.shift(torch.empty_like(x), x, 5, i, 1e-2))
               for a, x, i in zip(got, xb, GROUP_INDICES))
    with pytest.raises(ValueError):
        gen.shift_all([torch.empty(3)], [torch.empty(3), torch.empty(3)], 5, [0], 1.0)


def _interpreter_env() -> dict:
    """This process's environment with Triton's interpreter on and hiso's src first on the path
    (the path kept: a GPU image may hold pydantic and the rest in a PYTHONPATH folder)."""
    path = os.pathsep.join(p for p in (str(Path(hiso.__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}


_INTERPRETED = """
import sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from test_philox import GROUP_INDICES, _group, _one_by_one
from triton.runtime.interpreter import InterpretedFunction
from hiso.kernels import philox_triton as _philox_triton
from hiso.core.directions import DirectionGenerator
assert isinstance(_philox_triton._shift_all_kernel, InterpretedFunction)
xs, hs, ds = _group()
seeds = [2**64 - 3, 1, 2**32, 77, 5, 2**63 + 11]
for family in ("philox-rademacher", "philox-gaussian"):
    cpu = DirectionGenerator(family)
    for hh, dd in ((None, None), (hs, ds)):
        want = _one_by_one(cpu, xs, seeds, -1e-3, hh, dd)
        got = _philox_triton.shift_all(family, [torch.full_like(x, float("nan")) for x in xs], xs, seeds,
                                       GROUP_INDICES, -1e-3, hh, dd)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (family, hh is None)
    x, h = xs[3], hs[3]  # and the per-tensor kernels: fill, shift, combine (its device arguments cached)
    assert torch.equal(_philox_triton.fill(family, torch.empty_like(x), 2**63 + 1, 7), cpu.fill(2**63 + 1, 7, x.shape))
    assert torch.equal(_philox_triton.shift(family, torch.empty_like(x), x, 9, 2, 1e-3, h, ds[3]),
                       cpu.shift(torch.empty_like(x), x, 9, 2, 1e-3, h, ds[3]))
    for ss, cc in (([3, 2**64 - 1], [1.5, -0.25]), ([3, 2**64 - 1], [1.5, 0.5]), ([4, 2**64 - 1], [1.5, -0.25])) * 2:
        seeds_, c = np.array(ss, dtype=np.uint64), np.array(cc, dtype=np.float32)
        coefs = (c.astype(np.float64) / 2).astype(np.float32)
        for hh in (None, h):
            got = _philox_triton.combine(family, torch.empty_like(x), [int(s) for s in seeds_], coefs, 5, hh)
            assert torch.equal(got, cpu.combine(5, x.shape, seeds_, c, hh)), (family, ss, cc)
print("equal")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install "
                    "triton): the grouped GPU kernel cannot be run under its interpreter")
def test_grouped_triton_shift_gives_the_cpu_bits_under_the_interpreter():
    """One launch of the grouped kernel over ragged tensors equals the CPU kernels' shift per tensor,
    for both families, run by Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before Triton
    is imported, hence a fresh process)."""
    code = _INTERPRETED.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_interpreter_env())
    assert out.returncode == 0 and out.stdout.strip() == "equal", out.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install "
                    "triton): the GPU kernels cannot be compiled here")
@pytest.mark.parametrize("kernel", ["_shift_all_kernel", "_shift_kernel", "_combine_kernel", "_fold_all_kernel"])
def test_triton_kernels_compile_for_an_h100_without_fused_multiply_add(kernel):
    """Compiled ahead of time for sm_90 (no GPU needed: Triton ships ptxas), with the module's own
    options: the PTX has no fma (a multiply then an add, each rounded, as on the CPU) and its
    square roots and divisions are the correctly rounded ones."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hiso.kernels import philox_triton as T

    ptr, i64 = "*fp32", "i64"
    sig = {"_shift_all_kernel": {"slots": "*i64", "blocks": "*i64", "table": ptr},
           "_shift_kernel": {"out": ptr, "x": ptr, "delta": ptr, "h": ptr, "n": i64, "scale": "fp32", "k0": i64,
                             "k1": i64, "index": i64, "table": ptr},
           "_combine_kernel": {"out": ptr, "h": ptr, "n": i64, "keys0": "*i64", "keys1": "*i64", "coefs": ptr,
                               "P": i64, "index": i64, "table": ptr},
           "_fold_all_kernel": {"slots": "*i64", "blocks": "*i64", "keys0": "*i64", "keys1": "*i64", "coefs": ptr,
                                "P": i64, "table": ptr, **{k: "fp32" for k in ("neg_lr", "a", "b", "b_eps", "h_min", "h_max")}},
           }[kernel]
    consts = {"HAS_H": True, "GAUSS": True, "BLOCK": T.BLOCK}
    if kernel == "_fold_all_kernel":
        consts.update(UPDATE_H=True, HAS_EPS=True, HAS_MIN=True, HAS_MAX=True)
    elif kernel != "_combine_kernel":
        consts["HAS_DELTA"] = True
    src = ASTSource(fn=getattr(T, kernel), signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(T._OPTS))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and "fma" not in ptx
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "sqrt.approx" not in ptx and "div.approx" not in ptx


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="no CUDA device with Triton here: the grouped kernel is checked under Triton's "
                    "interpreter above")
@pytest.mark.parametrize("family", PHILOX)
def test_cuda_shift_all_is_one_grouped_launch_with_the_cpu_bits(family, monkeypatch):
    cpu, gpu = DirectionGenerator(family), DirectionGenerator(family)
    assert gpu._tr is not None
    xs, hs, ds = _group()

    def per_tensor(*a, **k):
        raise AssertionError("shift_all fell back to one launch per tensor")
    monkeypatch.setattr(gpu._tr, "shift", per_tensor)
    for hh in (None, hs):
        for dd in (None, ds):
            want = _one_by_one(cpu, xs, [9] * len(xs), 1e-3, hh, dd)
            got = gpu.shift_all([torch.empty_like(x, device="cuda") for x in xs], [x.cuda() for x in xs], 9,
                                GROUP_INDICES, 1e-3, None if hh is None else [h.cuda() for h in hh],
                                None if dd is None else [d.cuda() for d in dd])
            assert all(torch.equal(a, b.cpu()) for a, b in zip(want, got))


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
