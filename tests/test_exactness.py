"""Server, clients and rebuild hold bit-identical models, however many rounds a client skips."""

import numpy as np
import pytest
import torch

from hiso.core import Client, Downlink, ModelState, PreconditionerConfig, decode_downlink, encode_downlink
from hiso.methods.hiso_method import decomfl, hiso
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def _same(a: ModelState, b: ModelState) -> bool:
    ok = all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    if a.h is not None:
        ok = ok and all(torch.equal(x, y) for x, y in zip(a.h, b.h))
    return ok


@pytest.mark.parametrize("zo", [
    hiso(lr=0.02, mu=1e-3, perturbations=3, local_steps=2, precond=PreconditionerConfig(source="every")),
    hiso(lr=0.02, mu=1e-3, perturbations=3, local_steps=2),
    decomfl(lr=0.02, mu=1e-3, perturbations=3, local_steps=2),
    hiso(lr=0.02, mu=1e-3, perturbations=3, local_steps=2, directions="philox-rademacher"),
    decomfl(lr=0.02, mu=1e-3, perturbations=3, local_steps=2, directions="philox-gaussian"),
], ids=["hiso-every", "hiso-last", "decomfl", "hiso-philox-rademacher", "decomfl-philox-gaussian"])
def test_faithful_clients_match_server_bit_for_bit(zo):
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)  # keep the whole history, so the late client below can replay it
    rows = list(sim.run(110))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]  # it is learning, not standing still
    if zo.precond is not None:  # H really moved away from 1, so H must be replayed too
        assert not torch.equal(sim.state.h[0], torch.ones_like(sim.state.h[0]))
    assert not torch.equal(sim.state.params[0], task.build_model()[0].weight)

    # each client holds the model of the round it last took part in; catching up must land on x_R
    behind = {c.state.round for c in sim.clients.values()}
    assert min(behind) < 110
    sim.sync_all()
    for c in sim.clients.values():
        assert _same(c.state, sim.state), f"client {c.cid} drifted"

    # a client that skipped every one of the 110 rounds rebuilds x_R from one downlink's bytes
    late = Client(99, ModelState(task.build_model(), zo), task.loss, lambda r, k: None)
    wire = late.join(sim.welcome)
    data = encode_downlink(Downlink(110, wire.seeds(110), 0, tuple(sim.server.history)), wire)
    late.catch_up(decode_downlink(data, wire, expect_since=0))
    assert late.state.round == 110 and _same(late.state, sim.state)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fast_and_faithful_modes_agree(dtype):
    zo = hiso(lr=0.02, perturbations=3, local_steps=2, scalar_dtype=dtype)
    a = Simulation(TinyTask(), zo, clients_per_round=3, seed=2, batch_size=8, mode="fast")
    b = Simulation(TinyTask(), zo, clients_per_round=3, seed=2, batch_size=8, mode="faithful")
    for _ in range(30):
        ra, _ = a.step()
        rb, _ = b.step()
        assert np.array_equal(ra.scalars, rb.scalars) and ra.participants == rb.participants
    assert _same(a.state, b.state)
    assert np.array_equal(a.comm.up, b.comm.up) and np.array_equal(a.comm.down, b.comm.down)


def test_decomfl_is_hiso_with_h_frozen_at_one():
    frozen = hiso(lr=0.02, perturbations=3, local_steps=2, precond=PreconditionerConfig(nu=0.0, eps=0.0))
    plain = decomfl(lr=0.02, perturbations=3, local_steps=2)
    a = Simulation(TinyTask(), frozen, clients_per_round=3, seed=3, batch_size=8)
    b = Simulation(TinyTask(), plain, clients_per_round=3, seed=3, batch_size=8)
    for _ in range(25):
        ra, _ = a.step()
        rb, _ = b.step()
        assert np.array_equal(ra.scalars, rb.scalars)
    assert all(torch.equal(x, y) for x, y in zip(a.state.params, b.state.params))
    assert all(torch.equal(h, torch.ones_like(h)) for h in a.state.h)
    assert b.state.h is None  # DeComFL keeps no H in memory
    # and a moving H does change the trajectory (so the comparison above can fail)
    c = Simulation(TinyTask(), hiso(lr=0.02, perturbations=3, local_steps=2), clients_per_round=3, seed=3, batch_size=8)
    for _ in range(25):
        c.step()
    assert not torch.equal(c.state.params[0], b.state.params[0])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rebuild_is_bit_exact_for_every_scalar_dtype_with_snapshots(tmp_path, dtype):
    from hiso.config import load_config
    from hiso.core.history import parse_history
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="quadratic", dim=40, clients=6, sampled=2, rounds=30, eval_every=30,
                      scalar_dtype=dtype, snapshot_after=3, mode="faithful")
    summary = run_to_dir(cfg, tmp_path)
    state, _ = rebuild(tmp_path)
    saved = torch.load(tmp_path / "model.pt")
    assert state.round == saved["round"] == 30
    assert all(torch.equal(p, saved["model"][n]) for n, p in state.named)
    assert all(torch.equal(h, saved["h"][n]) for (n, _), h in zip(state.named, state.h))
    log = parse_history(tmp_path / "history.bin")
    assert log.scalar_dtype == dtype and log.seed == cfg.seed
    # clients more than 3 rounds behind got a snapshot (40 values and H): the max is more than the history
    assert summary["communication_per_client"]["bytes_down_max"] > 2 * 40 * 4
