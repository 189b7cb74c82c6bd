"""Structured direction families (hiso.core.families): sparse and low-rank directions, pure
functions of (seed, tensor, shape), checked against the Philox reference and replayed exactly."""

import json
import math

import numpy as np
import pytest
import torch

from hiso.core import ModelState
from hiso.methods.hiso_method import decomfl, hiso
from hiso.core.directions import DirectionGenerator, direction
from hiso.kernels.philox import philox4x32_10
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def _ref_words(seed, index, stream, block):
    return philox4x32_10((block & 0xFFFFFFFF, block >> 32, index, stream), (seed & 0xFFFFFFFF, seed >> 32))


def _ref_signs(seed, index, stream, count):
    """Rademacher stream from the pure-Python Philox: element 128 b + 32 k + t = bit t of word k."""
    out = []
    for b in range(-(-count // 128)):
        for w in _ref_words(seed, index, stream, b):
            out += [1 - 2 * ((w >> t) & 1) for t in range(32)]
    return np.array(out[:count], dtype=np.int64)


def _ref_sparse(seed, index, n, q):
    T = round(q * 2**15)
    c = np.float32(1 / math.sqrt(T / 2**15))
    out = []
    for b in range(-(-n // 8)):
        for w in _ref_words(seed, index, 1, b):
            for v in (w & 0xFFFF, w >> 16):
                out.append(np.float32(0) if (v >> 1) >= T else (c if v % 2 == 0 else -c))
    return np.array(out[:n], dtype=np.float32)


@pytest.fixture(params=["numba", "torch"])
def kernel(request, monkeypatch):
    """The CPU's numba kernels, and torch's integer ops (the path of other devices)."""
    if request.param == "torch":
        from hiso.core import families
        monkeypatch.setattr(families, "_numba", lambda device: None)
    return request.param


@pytest.mark.parametrize("seed,index,shape,q", [(7, 0, (5, 7), 0.25), (2**40 + 3, 3, (130,), 0.1), (1, 2, (3, 4), 1.0)])
def test_sparse_known_answers(seed, index, shape, q, kernel):
    got = DirectionGenerator(f"sparse:q={q}").fill(seed, index, torch.Size(shape)).reshape(-1).numpy()
    assert np.array_equal(got, _ref_sparse(seed, index, math.prod(shape), q))
    if q == 1.0:  # every coordinate in, scale 1: random signs
        assert set(np.abs(got).tolist()) == {1.0}


@pytest.mark.parametrize("r", [1, 3, 4])
def test_lowrank_known_answers(r, kernel):
    """u = float32(S c), S = U V^T computed here with exact integer arithmetic (numpy int64)."""
    seed, index, shape = 99, 1, (4, 2, 3)  # a conv-like tensor: a 4 x 6 matrix
    m, n = 4, 6
    U = _ref_signs(seed, index, 2, m * r).reshape(m, r)
    V = _ref_signs(seed, index, 3, n * r).reshape(n, r)
    S = U @ V.T
    want = (S.astype(np.float32) * np.float32(1 / math.sqrt(r))).astype(np.float32)
    got = DirectionGenerator(f"lowrank:r={r}").fill(seed, index, torch.Size(shape)).reshape(m, n).numpy()
    assert np.array_equal(got, want)
    if r == 1:  # a rank-one sign matrix
        assert np.linalg.matrix_rank(got) == 1 and set(np.abs(got).ravel().tolist()) == {1.0}


def test_lowrank_vectors_keep_the_dense_direction(kernel):
    shapes = [torch.Size([6, 5]), torch.Size([300])]
    low = direction(5, shapes, "lowrank:r=2")
    dense = direction(5, shapes, "philox-rademacher")
    assert torch.equal(low[1], dense[1]) and not torch.equal(low[0], dense[0])


@pytest.mark.parametrize("family", ["sparse:q=0.2", "lowrank:r=2", "lowrank:r=1"])
def test_mean_zero_and_identity_covariance(family):
    """E[u] = 0 and E[u u^T] = I over seeds (a 3 x 4 matrix: 12 coordinates, 4,000 draws)."""
    gen = DirectionGenerator(family)
    U = np.stack([gen.fill(s, 0, torch.Size([3, 4])).reshape(-1).numpy().astype(np.float64) for s in range(4000)])
    cov = U.T @ U / len(U)
    assert np.abs(U.mean(0)).max() < 0.08
    assert np.abs(np.diag(cov) - 1).max() < 0.12
    assert np.abs(cov - np.diag(np.diag(cov))).max() < 0.1
    if family.startswith("sparse"):
        assert abs((U != 0).mean() - 0.2) < 0.02


def test_shift_and_combine_follow_the_protocols_arithmetic():
    """shift: (x + delta) + (u * H^{-1/2}) * scale; combine: sum_p u_p float32(g_p / P), then * H^{-1/2}."""
    gen = DirectionGenerator("lowrank:r=3")
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    h = torch.rand(5, 6, generator=g) + 0.5
    hinv = torch.sqrt(h.double()).float().reciprocal()
    out = torch.empty(5, 6)
    gen.shift(out, x, 11, 2, 1e-3, h, delta)
    u = gen.fill(11, 2, x.shape).clone()
    assert torch.equal(out, (x + delta) + (u * hinv) * np.float32(1e-3))
    seeds, scalars = np.array([3, 4]), np.array([0.7, -1.3], np.float32)
    acc = torch.zeros(5, 6)
    for s, gp in zip(seeds, scalars):
        acc = acc + gen.fill(int(s), 2, x.shape).clone() * float(np.float32(np.float64(gp) / 2))
    assert torch.equal(gen.combine(2, x.shape, seeds, scalars, h).clone(), acc * hinv)


@pytest.mark.parametrize("family,make", [("sparse:q=0.3", decomfl), ("lowrank:r=2", hiso)],
                         ids=["decomfl-sparse", "hiso-lowrank"])
def test_late_clients_and_snapshots_match_the_server(family, make):
    zo = make(lr=0.02, perturbations=3, directions=family)
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=10**6)
    rows = list(sim.run(40))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert min(c.state.round for c in sim.clients.values()) < 40
    sim.sync_all()
    late = ModelState(task.build_model(), zo)
    late.replay(sim.server.records_since(0))
    for st in [c.state for c in sim.clients.values()] + [late]:
        assert all(torch.equal(a, b) for a, b in zip(st.params, sim.state.params))
        if st.h is not None:
            assert all(torch.equal(a, b) for a, b in zip(st.h, sim.state.h))
    dense = Simulation(TinyTask(num_clients=20), make(lr=0.02, perturbations=3), clients_per_round=3, seed=1,
                       batch_size=8, eval_every=1000)
    list(dense.run(40))
    assert not all(torch.equal(a, b) for a, b in zip(dense.state.params, sim.state.params))


@pytest.mark.parametrize("flags,spec", [({"directions": "sparse", "direction_density": 0.25}, "sparse:q=0.25"),
                                        ({"directions": "lowrank", "direction_rank": 3}, "lowrank:r=3"),
                                        ({"directions": "sparse"}, "sparse:q=0.1")])
def test_config_header_fingerprint_and_rebuild(tmp_path, flags, spec):
    from hiso.config import load_config
    from hiso.core.messages import config_fingerprint
    from hiso.core.history import parse_history
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="quadratic", dim=30, rounds=20, eval_every=5, threads=1, algorithm="hiso", **flags)
    assert cfg.zo().directions == spec
    run_to_dir(cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert all(saved[k] == v for k, v in flags.items())
    assert parse_history(tmp_path / "history.bin").directions == spec
    _, ckpt = rebuild(tmp_path)
    final = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(final["model"][k], v) for k, v in ckpt["model"].items())
    other = cfg.model_copy(update={"direction_density": 0.5} if "density" in str(flags) or spec.startswith("sparse")
                           else {"direction_rank": 5})
    assert config_fingerprint(cfg.zo()) != config_fingerprint(other.zo())


def test_bad_family_options_are_one_line_errors():
    from hiso.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="direction_density is for directions sparse"):
        load_config(None, task="quadratic", direction_density=0.1)
    with pytest.raises(ConfigError, match="direction_rank is for directions lowrank"):
        load_config(None, task="quadratic", directions="sparse", direction_rank=2)
    with pytest.raises(ConfigError, match="direction_density"):
        load_config(None, task="quadratic", directions="sparse", direction_density=1.5)
    with pytest.raises(ValueError, match="bad direction family"):
        decomfl(lr=0.1, directions="lowrank:r=x")
    with pytest.raises(ValueError, match="unknown direction family"):
        decomfl(lr=0.1, directions="banded:w=3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["sparse:q=0.1", "lowrank:r=4"])
def test_cuda_gives_the_cpus_bits(family):
    gen = DirectionGenerator(family)
    g = torch.Generator().manual_seed(1)
    x, h = torch.randn(64, 300, generator=g), torch.rand(64, 300, generator=g) + 0.5
    seeds, scalars = np.array([5, 6, 7]), np.array([0.3, -2.0, 1.1], np.float32)
    out_c = gen.shift(torch.empty_like(x), x, 9, 1, 1e-3, h)
    acc_c = gen.combine(1, x.shape, seeds, scalars, h).clone()
    out_g = gen.shift(torch.empty_like(x.cuda()), x.cuda(), 9, 1, 1e-3, h.cuda())
    acc_g = gen.combine(1, x.shape, seeds, scalars, h.cuda(), "cuda")
    assert torch.equal(out_c, out_g.cpu()) and torch.equal(acc_c, acc_g.cpu())
