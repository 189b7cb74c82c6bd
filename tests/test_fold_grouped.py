"""The fold as one launch over every tensor (CUDA, Triton) gives the bits of the per-tensor chain.

Without a GPU the grouped kernel runs under Triton's CPU interpreter (a fresh process:
TRITON_INTERPRET must be set before Triton is imported), folded against the numba kernels'
per-tensor chain; with one, the CUDA replica against the CPU replica.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_philox import _interpreter_env

# (run options, why): each a case the grouped fold takes (or a family it must refuse)
CASES = [
    ({"algorithm": "decomfl"}, "no H"),
    ({"algorithm": "hiso"}, "HiSo's defaults"),
    ({"algorithm": "hiso", "directions": "philox-gaussian", "h_bias_correction": True, "h_min": 0.5,
      "h_max": 1.0005}, "bias correction, both clips binding"),
    ({"algorithm": "hiso", "local_steps": 2, "nu": 0.5, "eps": 0.0}, "two local steps, H at the last, no eps"),
    ({"algorithm": "hiso", "local_steps": 2, "h_source": "every"}, "falls back: H at every step"),
    ({"algorithm": "hiso", "h_stat": "floor"}, "falls back: another statistic"),
    ({"algorithm": "decomfl", "momentum": 0.9}, "falls back: momentum"),
]
SHAPES = [(300,), (5, 7), (1,), (1025,), (2048,), (3, 700)]  # ragged, across BLOCK = 1024


def _model(device="cpu"):
    torch.manual_seed(3)
    m = torch.nn.Module()
    for j, s in enumerate(SHAPES):
        m.register_parameter(f"p{j}", torch.nn.Parameter(torch.randn(s, device=device)))
    return m


def _records(tau: int, P: int = 5, rounds: int = 4):
    from hiso.core.history import RoundRecord
    from hiso.core.seeds import round_seeds
    out = []
    for r in range(rounds):
        g = np.random.default_rng(r).normal(scale=50.0, size=(tau, P)).astype(np.float32)  # H moves visibly
        out.append(RoundRecord(r, round_seeds(0, r, 0, tau, P), g, (0,), 0))
    return out


def _zo(opts: dict):
    from hiso.config import RunConfig
    return RunConfig(lr=1e-2, perturbations=5, **opts).zo()


def _replica(opts: dict, device="cpu"):
    from hiso.core.state import ModelState
    return ModelState(_model(device), _zo(opts), run_seed=0)


def _differs(a, b) -> list[str]:
    da, db = a.state_dict(), b.state_dict()
    bad = []
    for part in ("model", "h", "momentum"):
        for k, t in da.get(part, {}).items():
            if isinstance(t, torch.Tensor) and not torch.equal(t.cpu(), db[part][k].cpu()):
                bad.append(f"{part}/{k}")
    return bad


_INTERPRETED = """
import sys, torch
sys.path.insert(0, {tests!r})
from triton.runtime.interpreter import InterpretedFunction
from hiso.kernels import philox_triton
from hiso.core import chain, directions
from test_fold_grouped import CASES, _records, _replica, _differs
assert isinstance(philox_triton._fold_all_kernel, InterpretedFunction)
calls = []
real = philox_triton.fold_all
def counted(*a, **k):
    calls.append(1)
    return real(*a, **k)
philox_triton.fold_all = counted
for opts, why in CASES:
    tau = opts.get("local_steps", 1)
    want, got = _replica(opts), _replica(opts)
    got.gen._tr = philox_triton  # the CPU tensors go to the interpreted kernels
    got.gen._use_triton = lambda *ts: True
    before = len(calls)
    for rec in _records(tau):
        chain.GROUPED = False
        want.apply(rec)
        chain.GROUPED = True
        got.apply(rec)
    grouped = len(calls) - before
    print(why, "grouped" if grouped else "per tensor", grouped, _differs(want, got))
    assert not _differs(want, got), why
    assert (grouped == 4 * tau) == (not why.startswith("falls back")), (why, grouped)
print("equal")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install "
                    "triton): the grouped fold cannot be run under its interpreter")
def test_grouped_fold_gives_the_per_tensor_chains_bits_under_the_interpreter():
    code = _INTERPRETED.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=_interpreter_env())
    assert out.returncode == 0 and out.stdout.strip().endswith("equal"), out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="no CUDA device with Triton here: the grouped fold is checked under Triton's "
                    "interpreter above")
@pytest.mark.parametrize("opts,why", CASES[:4], ids=[w for _, w in CASES[:4]])
def test_cuda_fold_is_one_launch_a_step_with_the_cpu_bits(opts, why, monkeypatch):
    cpu, gpu = _replica(opts), _replica(opts, "cuda")
    gpu.load_state_dict(cpu.state_dict())
    assert gpu.gen._tr is not None

    def per_tensor(*a, **k):
        raise AssertionError("the fold fell back to one launch per tensor")
    monkeypatch.setattr(gpu.gen._tr, "combine", per_tensor)
    for rec in _records(opts.get("local_steps", 1)):
        cpu.apply(rec)
        gpu.apply(rec)
    assert not _differs(cpu, gpu), why
