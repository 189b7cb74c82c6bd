"""Subspaces kept across rounds (hiso.core.families): lowrank's V refreshed every k rounds (LOZO)
and sparse directions inside a mask fixed at round 0 from |x_0|; exact under replay and rebuild."""

import json
import math

import numpy as np
import pytest
import torch

from hiso.core import ModelState
from hiso.methods.hiso_method import decomfl, hiso
from hiso.core.directions import DirectionGenerator
from hiso.core.families import magnitude_mask
from hiso.core.seeds import mix64, round_seeds
from hiso.kernels.philox import philox4x32_10
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def _ref_signs(seed, index, stream, count):
    """Rademacher stream from the pure-Python Philox: element 128 b + 32 k + t = bit t of word k."""
    out = []
    for b in range(-(-count // 128)):
        for w in philox4x32_10((b & 0xFFFFFFFF, b >> 32, index, stream), (seed & 0xFFFFFFFF, seed >> 32)):
            out += [1 - 2 * ((w >> t) & 1) for t in range(32)]
    return np.array(out[:count], dtype=np.int64)


@pytest.fixture(params=["numba", "torch"])
def kernel(request, monkeypatch):
    if request.param == "torch":
        from hiso.core import families
        monkeypatch.setattr(families, "_numba", lambda device: None)
    return request.param


def _dirs(family, run_seed, rounds, shape, index=1, attempt=0):
    gen = DirectionGenerator(family).bind(run_seed=run_seed)
    return [gen.fill(int(round_seeds(run_seed, r, attempt, 2, 3)[1, 2]), index, torch.Size(shape)).clone().numpy()
            for r in rounds]


def test_refresh_known_answer(kernel):
    """u = float32(U V^T / sqrt(r)): U from the step seed, V from the window seed
    mix64(w ^ mix64(run_seed ^ "hiso-V=V")), w = round // k (the published mixing function)."""
    run_seed, r, k, rnd, index, (m, n) = 7, 2, 5, 13, 1, (4, 6)
    seed = int(round_seeds(run_seed, rnd, 0, 2, 3)[1, 2])
    vseed = mix64((rnd // k) ^ mix64(run_seed ^ 0x6869736F2D563D56))
    U = _ref_signs(seed, index, 2, m * r).reshape(m, r)
    V = _ref_signs(vseed, index, 3, n * r).reshape(n, r)
    want = ((U @ V.T).astype(np.float32) * np.float32(1 / math.sqrt(r))).astype(np.float32)
    got = DirectionGenerator(f"lowrank:r={r},refresh={k}").bind(run_seed=run_seed).fill(seed, index, torch.Size((m, n)))
    assert np.array_equal(got.numpy(), want)


def test_v_is_kept_within_a_window_and_changes_across(kernel):
    """The rows of u = U V^T lie in V's column space: within a window (rounds 10..19, retried
    attempts too) all directions' rows span rank r; across a window boundary (19, 20) more."""
    r, shape = 2, (12, 10)
    rank = lambda us: np.linalg.matrix_rank(np.vstack(us).astype(np.float64))  # noqa: E731
    fam = f"lowrank:r={r},refresh=10"
    assert rank(_dirs(fam, 3, range(10, 20), shape) + _dirs(fam, 3, [15], shape, attempt=2)) == r
    assert rank(_dirs(fam, 3, [19, 20], shape)) == 2 * r
    other = _dirs(fam, 4, [10], shape)  # another run seed: another V
    assert rank(_dirs(fam, 3, [10], shape) + other) == 2 * r
    assert rank(_dirs(f"lowrank:r={r}", 3, range(10, 20), shape)) > r  # without refresh V is fresh per step
    vectors = zip(_dirs(fam, 3, [12], (30,)), _dirs("philox-rademacher", 3, [12], (30,)))
    assert all(np.array_equal(a, b) for a, b in vectors)  # a vector keeps the dense direction


def test_refresh_needs_the_run_seed():
    gen = DirectionGenerator("lowrank:r=2,refresh=4")
    with pytest.raises(ValueError, match="run's seed"):
        gen.fill(5, 0, torch.Size([3, 4]))


def test_magnitude_mask_of_a_hand_made_tensor(kernel):
    """|x0| = 0.3 2.0 0.1 / 1.5 0.3 0: q = 0.5 keeps 3 of 6: 2.0 (1), 1.5 (3) and the 0.3 of the lower
    index (0, not 4); the direction is stream 4's signs there, times sqrt(6 / 3), zeros elsewhere."""
    x0 = torch.tensor([[0.3, -2.0, 0.1], [1.5, -0.3, 0.0]])
    assert magnitude_mask(x0, 0.5).tolist() == [0, 1, 3]
    assert magnitude_mask(x0, 0.01).tolist() == [1]  # at least one
    assert magnitude_mask(x0, 0.75).tolist() == [0, 1, 2, 3, 4]  # floor(0.75 * 6 + 1/2) = 5: all but the 0
    gen = DirectionGenerator("sparse:q=0.5,mask=magnitude").bind(params=[torch.zeros(4), x0])
    u = gen.fill(21, 1, x0.shape).reshape(-1).numpy()
    want = np.zeros(6, np.float32)
    want[[0, 1, 3]] = _ref_signs(21, 1, 4, 3).astype(np.float32) * np.float32(1 / math.sqrt(3 / 6))
    assert np.array_equal(u, want)
    assert np.count_nonzero(gen.fill(22, 0, torch.Size([4]))) == 2  # the all-zero tensor: its first half


def test_mask_needs_x0():
    with pytest.raises(ValueError, match="initial model"):
        DirectionGenerator("sparse:q=0.5,mask=magnitude").fill(1, 0, torch.Size([4]))
    task = TinyTask()
    with pytest.raises(ValueError, match="x_0"):
        ModelState(task.build_model(), decomfl(lr=0.1, directions="sparse:q=0.5,mask=magnitude"), round=3)


@pytest.mark.parametrize("family,make", [("lowrank:r=2,refresh=3", decomfl), ("sparse:q=0.3,mask=magnitude", hiso)],
                         ids=["decomfl-refresh", "hiso-mask"])
def test_late_clients_match_the_server(family, make):
    zo = make(lr=0.02, perturbations=3, directions=family)
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=10**6)
    rows = list(sim.run(30))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert min(c.state.round for c in sim.clients.values()) < 30
    sim.sync_all()
    late = ModelState(task.build_model(), zo, run_seed=1)
    late.replay(sim.server.records_since(0))
    for st in [c.state for c in sim.clients.values()] + [late]:
        assert all(torch.equal(a, b) for a, b in zip(st.params, sim.state.params))
    plain = Simulation(TinyTask(num_clients=20), make(lr=0.02, perturbations=3, directions=family.split(",")[0]),
                       clients_per_round=3, seed=1, batch_size=8, eval_every=1000)
    list(plain.run(30))
    assert not all(torch.equal(a, b) for a, b in zip(plain.state.params, sim.state.params))


@pytest.mark.parametrize("flags,spec", [
    ({"directions": "lowrank", "direction_rank": 2, "direction_refresh": 5}, "lowrank:r=2,refresh=5"),
    ({"directions": "sparse", "direction_density": 0.2, "direction_mask": "magnitude"}, "sparse:q=0.2,mask=magnitude")])
def test_config_header_fingerprint_and_rebuild(tmp_path, flags, spec):
    from hiso.config import load_config
    from hiso.core.messages import config_fingerprint
    from hiso.core.history import parse_history
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="mnist", train_max=256, eval_max=64, clients=6, sampled=2, rounds=12, eval_every=6,
                      batch_size=8, threads=1, algorithm="decomfl", seed=3, **flags)
    assert cfg.zo().directions == spec
    run_to_dir(cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert all(saved[k] == v for k, v in flags.items())
    assert parse_history(tmp_path / "history.bin").directions == spec
    state, ckpt = rebuild(tmp_path)
    final = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(final["model"][k], v) for k, v in ckpt["model"].items())
    key = "direction_refresh" if "direction_refresh" in flags else "direction_mask"
    plain = cfg.model_copy(update={key: None})
    assert config_fingerprint(cfg.zo()) != config_fingerprint(plain.zo())


def test_bad_options_are_one_line_errors():
    from hiso.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="direction_refresh is for directions lowrank"):
        load_config(None, task="quadratic", directions="sparse", direction_refresh=3)
    with pytest.raises(ConfigError, match="direction_mask is for directions sparse"):
        load_config(None, task="quadratic", directions="lowrank", direction_mask="magnitude")
    with pytest.raises(ConfigError, match="direction_refresh"):
        load_config(None, task="quadratic", directions="lowrank", direction_refresh=0)
    with pytest.raises(ConfigError, match="direction_mask"):
        load_config(None, task="quadratic", directions="sparse", direction_mask="gradient")
    with pytest.raises(ValueError, match="bad direction family"):
        decomfl(lr=0.1, directions="lowrank:r=2,refresh=x")
    with pytest.raises(ValueError, match="bad direction family"):
        decomfl(lr=0.1, directions="sparse:q=0.1,mask=random")
