"""The replicas' arithmetic does not depend on the CPU's vector unit (nor on the device).

torch's fused ``add_(x, alpha=a)`` is one rounding (FMA) with AVX2/AVX-512 kernels and two with
``ATEN_CPU_CAPABILITY=default`` (a CPU without AVX2): a client on such a machine would rebuild a
different model. :mod:`hiso.core.exact` rounds every product and every sum once, everywhere.
"""

import os
import sys

import numpy as np
import pytest
import torch

from conftest import run_within
from hiso.core import exact


def _f32(a):
    return np.float32(a)


@pytest.mark.parametrize("n", [7, 2500])  # one chunk; several chunks and a ragged tail
def test_each_product_and_sum_is_rounded_once(monkeypatch, n):
    monkeypatch.setattr(exact, "CHUNK", 1000)
    g = torch.Generator().manual_seed(n)
    y, x = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    a = -1.2345678e-3
    want = (y.numpy() + (x.numpy() * _f32(a)).astype(np.float32)).astype(np.float32)  # numpy: float32 ops
    assert np.array_equal(exact.axpy_(y.clone(), a, x).numpy(), want)
    b = 0.1
    want = (y.numpy() + ((x.numpy() * x.numpy()) * _f32(b)).astype(np.float32)).astype(np.float32)
    assert np.array_equal(exact.add_scaled_square_(y.clone(), b, x).numpy(), want)


REBUILD = """
import sys, torch
from hiso.cli import main
main(["rebuild", sys.argv[1], "--out", sys.argv[2]])
print(torch.backends.cpu.get_cpu_capability())
"""

CASES = {
    "hiso, 2 local steps, H from every step": ["--algorithm", "hiso", "--local-steps", "2", "--h-source", "every", "--lr", "0.02"],
    "hiso, momentum, denoised H": ["--algorithm", "hiso", "--momentum", "0.9", "--h-stat", "denoised", "--lr", "0.005"],
    "decomfl, philox-gaussian": ["--algorithm", "decomfl", "--directions", "philox-gaussian", "--lr", "0.02"],
}
# Not torch-normal: torch's CPU normal_ itself draws different numbers with and without AVX2
# (its vectorised Box-Muller), so that family needs peers with the same torch and CPU kind.


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="this CPU already runs torch's default (non-vector) kernels: nothing to compare")
@pytest.mark.parametrize("case", list(CASES))
def test_a_run_is_rebuilt_bit_for_bit_without_the_cpus_vector_kernels(tmp_path, case):
    """The run (this process: AVX2 or AVX-512 kernels) replayed by a process on torch's default
    kernels, as on a CPU without AVX2: the same model, H and momentum buffer. (The forwards may
    differ between the two, which is why only the replay is compared: the scalars are the log's.)"""
    from hiso.cli import main
    run = tmp_path / "run"
    assert main(["run", "--out", str(run), "--task", "quadratic", "--dim", "20000", "--clients", "4", "--sampled", "2",
                 "--rounds", "6", "--eval-every", "3", "--quiet", *CASES[case]]) == 0
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    r = run_within([sys.executable, "-c", REBUILD, str(run), str(tmp_path / "rebuilt.pt")], 300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "DEFAULT"  # the replay did run torch's default kernels
    a, b = torch.load(run / "model.pt"), torch.load(tmp_path / "rebuilt.pt")
    # the trained parameter and the buffer lam (the task's draws and exp are portable too)
    assert a["model"].keys() == b["model"].keys() == {"x", "lam"}
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for part in ("h", "m"):
        for k, v in (a.get(part) or {}).items():
            assert torch.equal(v, b[part][k]), (part, k)
