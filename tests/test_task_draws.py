"""The built-in tasks' x_0 and buffers are the same bits on every CPU (hiso.tasks.draws).

torch draws ``randn``, ``normal_`` and ``uniform_`` with kernels that differ with the CPU's vector
unit, and its ``exp`` rounds differently with it; a task built from them gives another x_0 (and
so another model for the same log) on another CPU. The digests below were computed once and are
written here, not on the machine running the test; they are the same under
ATEN_CPU_CAPABILITY=default, avx2 and avx512 (torch's kernels as on a CPU without AVX2, with
AVX2, with AVX-512), which is what makes them pins and not this machine's numbers.
"""

import hashlib
import json
import os
import sys
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import run_within
from hiso.tasks import draws


def _digest(tensors: dict) -> str:
    """sha256 (16 hex digits) over names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _quadratic(**kw):
    from hiso.tasks.quadratic import QuadraticTask
    task = QuadraticTask(5, **kw)
    return {**task.build_model().state_dict(), "task.b": task.b}  # x_0, the buffer lam, and the data


def _noise():
    from hiso.tasks.quadratic import QuadraticTask
    return {"xi": QuadraticTask(5, dim=40, noise=0.1).batch(2, 4, 0)[1]}


def _mnist():
    from hiso.tasks.vision import VisionTask
    return VisionTask("mnist", 4, seed=0, eval_max=50).build_model().state_dict()


def _lora(tmp_path_factory):
    pytest.importorskip("peft")
    from lm_fixtures import write_sst2, write_tiny_lm

    from hiso.tasks.language import LanguageTask
    d = tmp_path_factory.mktemp("lm")
    # hidden 24: LoRA A's bound 1/sqrt(24) (1/sqrt(16) would make torch's two roundings one)
    task = LanguageTask("sst2", 3, seed=5, model=str(write_tiny_lm(d / "lm", hidden=24)),
                        data_dir=str(write_sst2(d / "sst2")), label_words=[" terrible", " great"], min_size=2,
                        lora_r=2)
    return {n: p for n, p in task.build_model().named_parameters() if p.requires_grad}  # x_0: the adapters


PINS = {  # what: (build, digest of its tensors)
    "quadratic as the legacy fixtures (dim 24, seed 0)": (lambda f: _quadratic(dim=24), "3255fc09cb9ee3b1"),
    "quadratic, the default dim (1000), seed 3": (lambda f: _quadratic(seed=3), "d28c6d13c62ae33c"),
    "quadratic, dim 7 (under 16 numbers: torch's scalar path), sigma 2.5": (
        lambda f: _quadratic(dim=7, sigma=2.5, seed=1), "a6c8950fce335f21"),
    "quadratic, noise 0.1: client 2's noise in round 4": (lambda f: _noise(), "ed01c738459008e0"),
    "mnist CNN, seed 0": (lambda f: _mnist(), "fa1c7bd085936955"),
    "sst2 with LoRA r 2: the adapters": (_lora, "46ad22f872974391"),
}


@pytest.mark.parametrize("what", list(PINS))
def test_a_built_in_tasks_x0_and_buffers_are_the_pinned_bits(tmp_path_factory, what):
    """Any bit of them changed (another draw, another rounding) changes the digest."""
    build, want = PINS[what]
    assert _digest(build(tmp_path_factory)) == want


# ------------------------------------------------------------------------- the arithmetic

def test_fma32_rounds_once():
    """fma32 is a * b + c rounded once (against exact rationals), where float64's sum would round
    twice: products and addends of many magnitudes, cancellations, sums near float32 ties."""
    rng = np.random.default_rng(0)
    n = 4000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -rng.integers(1, 40, n))).astype(np.float32)
    got = draws.fma32(a, b, c)
    assert [i for i in range(n) if got[i] != _nearest32(a[i], b[i], c[i])] == []


def _nearest32(a, b, c) -> np.float32:
    """The float32 nearest to a * b + c (exactly), ties to even."""
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(x))
    cands = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    best = min(abs(Fraction(float(v)) - x) for v in cands)
    return min((v for v in cands if abs(Fraction(float(v)) - x) == best), key=lambda v: int(np.array(v).view(np.int32)) & 1)


def test_exp_is_correctly_rounded(monkeypatch):
    """draws.exp is the float32 nearest to exp(x) (60-digit decimal), on its fast path and on the
    decimal one it takes near a float32 tie."""
    x = (np.random.default_rng(1).standard_normal(3000) * 6).astype(np.float32)
    got = draws.exp(x)
    for xi, g in zip(x, got):
        with localcontext(prec=60):
            e = Decimal(float(xi)).exp()
            assert abs(Decimal(float(g)) - e) <= min(abs(Decimal(float(np.nextafter(g, s))) - e)
                                                      for s in (np.float32(np.inf), np.float32(-np.inf)))
    monkeypatch.setattr(draws, "_UNDECIDED", 1.0)  # every number through the decimal path
    assert np.array_equal(draws.exp(x), got)


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 24, 48, 1000])
def test_the_draws_take_what_torchs_draws_take_from_the_generator(n):
    """After a portable draw the generator is where torch's draw leaves it (the next numbers agree)."""
    for ours, theirs in ((lambda g: draws.normal(n, 0.5, 2.0, g), lambda g: torch.empty(n).normal_(0.5, 2.0, generator=g)),
                         (lambda g: draws.uniform(n, -0.3, 0.2, g), lambda g: torch.empty(n).uniform_(-0.3, 0.2, generator=g))):
        g1, g2 = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        ours(g1), theirs(g2)
        assert torch.equal(torch.rand(5, generator=g1, dtype=torch.float64), torch.rand(5, generator=g2, dtype=torch.float64))


# --------------------------------------------------- against torch's own vector kernels

COMPARE = """
import json, math, torch, numpy as np
from torch import nn
from hiso.tasks import draws
from hiso.tasks.vision import MnistCNN
differ = []
for n in (1, 7, 15, 16, 17, 24, 100, 4099, 300000):
    for mean, std in ((0.0, 1.0), (0.3, 0.7), (-1.5, 2.5e-3)):
        t = torch.empty(n).normal_(mean, std, generator=torch.Generator().manual_seed(n))
        if not np.array_equal(t.numpy(), draws.normal(n, mean, std, torch.Generator().manual_seed(n))):
            differ.append(f"normal_({mean}, {std}) of {n}")
    for lo, hi in ((-1 / math.sqrt(24), 1 / math.sqrt(24)), (2.0, 7.3)):
        t = torch.empty(n).uniform_(lo, hi, generator=torch.Generator().manual_seed(n))
        if not np.array_equal(t.numpy(), draws.uniform(n, lo, hi, torch.Generator().manual_seed(n))):
            differ.append(f"uniform_({lo}, {hi}) of {n}")
    if not torch.equal(torch.randn(3, n, generator=torch.Generator().manual_seed(1)),
                       draws.randn(3, n, generator=torch.Generator().manual_seed(1))):
        differ.append(f"randn(3, {n})")
torch.manual_seed(7)
a = MnistCNN()
torch.manual_seed(7)
with draws.PortableDraws():
    b = MnistCNN()
differ += [f"MnistCNN {k}" for k, v in a.state_dict().items() if not torch.equal(v, b.state_dict()[k])]
try:
    from peft import LoraConfig, get_peft_model
    from hiso.tasks.lm import add_lora
    net = lambda: nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 40))
    base = net()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        a = get_peft_model(base, LoraConfig(r=3, lora_alpha=8.0, target_modules=["0", "1"], lora_dropout=0.0, bias="none"))
    b = add_lora(net(), 3, 8.0, ["0", "1"], seed=3)
    differ += [f"LoRA {k}" for k, v in a.state_dict().items() if "lora_" in k and not torch.equal(v, b.state_dict()[k])]
except ImportError:
    pass
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "differ": differ}))
"""


def test_the_draws_are_torchs_own_where_it_runs_its_vector_kernels():
    """On a CPU with AVX2 the portable draws are torch's (AVX2 or AVX-512 kernels: a process with
    torch's default capability checks AVX2's), so tasks draw the numbers they always drew there."""
    env = dict(os.environ)
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        env["ATEN_CPU_CAPABILITY"] = "avx2"  # this run is on the default kernels: compare with AVX2's
    r = run_within([sys.executable, "-c", COMPARE], 600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    if got["capability"] == "DEFAULT":
        pytest.skip("this CPU has no AVX2: torch's vector draws, which the portable ones are, do not run here")
    assert got["differ"] == [], got["capability"]
