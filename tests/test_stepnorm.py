"""The global step normalised by the spread of the logged scalars (--step-norm std): a pure
function of the history, so the server, late clients, snapshots and rebuild agree bit for bit."""

import json
import math

import numpy as np
import pytest
import torch

from hiso.core import ModelState, RoundRecord
from hiso.methods.hiso_method import decomfl, hiso
from hiso.methods.stepnorm import StepNormConfig
from hiso.runners.simulate import Simulation

from conftest import TinyTask


def _same(a: ModelState, b: ModelState) -> bool:
    ok = all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    if a.h is not None:
        ok = ok and all(torch.equal(x, y) for x, y in zip(a.h, b.h))
    return ok and torch.equal(a.sn, b.sn)


def _copy(state: ModelState) -> dict:
    return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in state.state_dict().items()}


@pytest.mark.parametrize("make", [hiso, decomfl], ids=["hiso", "decomfl"])
def test_two_rounds_step_by_hand(make):
    """beta = 0.5, P = 2. Round 0's scalars (3, 4): mean square 12.5, v = 6.25, w = 0.5, so sigma_0 =
    sqrt(12.5). Round 1's (1, -1): mean square 1, v = 3.625, w = 0.75, sigma_1 = sqrt(29/6). Each
    round's step equals, bit for bit, an unnormalised replica's at lr / sigma_r."""
    task = TinyTask()
    lr = 0.05
    zo = make(lr=lr, perturbations=2, step_norm=StepNormConfig(beta=0.5))
    recs = [RoundRecord(0, np.array([[11, 12]]), np.array([[3.0, 4.0]], np.float32)),
            RoundRecord(1, np.array([[13, 14]]), np.array([[1.0, -1.0]], np.float32))]
    normed = ModelState(task.build_model(), zo)
    for rec, sigma in zip(recs, (math.sqrt(12.5), math.sqrt(29 / 6))):
        before = _copy(normed)
        before.pop("step_norm")
        plain = ModelState(task.build_model(), make(lr=lr / sigma, perturbations=2))
        raw = ModelState(task.build_model(), make(lr=lr, perturbations=2))
        for st in (plain, raw):
            st.load_state_dict(before)
            st.apply(rec)
        normed.apply(rec)
        assert all(torch.equal(a, b) for a, b in zip(normed.params, plain.params))
        assert not all(torch.equal(a, b) for a, b in zip(normed.params, raw.params))
    assert normed.sn.tolist() == [3.625, 0.75]


def test_beta_zero_is_the_rounds_own_rms():
    """beta = 0 (FZOO's per-step spread): sigma is this round's RMS, whatever came before."""
    from hiso.methods import stepnorm
    st = stepnorm.init()
    cfg = StepNormConfig(beta=0.0)
    stepnorm.update_(st, np.array([[100.0, 100.0]], np.float32), cfg)
    assert stepnorm.update_(st, np.array([[3.0, 4.0], [0.0, 0.0]], np.float32), cfg) == math.sqrt(25 / 4)


@pytest.mark.parametrize("make", [hiso, decomfl], ids=["hiso", "decomfl"])
def test_late_clients_and_snapshots_match_the_server(make):
    zo = make(lr=0.005, perturbations=3, step_norm=StepNormConfig(beta=0.9))
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=10**6)
    rows = list(sim.run(50))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert min(c.state.round for c in sim.clients.values()) < 50
    sim.sync_all()
    for c in sim.clients.values():
        assert _same(c.state, sim.state), f"client {c.cid} drifted"
    late = ModelState(task.build_model(), zo)
    late.replay(sim.server.records_since(0))
    assert _same(late, sim.state)
    # a client more than 2 rounds behind gets a snapshot, which must carry (v, w)
    snap = Simulation(TinyTask(num_clients=20), zo, clients_per_round=3, seed=2, batch_size=8, mode="faithful",
                      eval_every=1000, snapshot_after=2)
    list(snap.run(30))
    snap.sync_all()
    assert float(snap.state.sn[1]) > 0
    for c in snap.clients.values():
        assert _same(c.state, snap.state), f"client {c.cid} drifted after a snapshot"


def test_config_records_step_norm_rebuild_reproduces_it_and_bad_uses_are_refused(tmp_path):
    from hiso.config import ConfigError, load_config
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="quadratic", dim=30, rounds=20, eval_every=5, threads=1, algorithm="hiso",
                      lr=0.01, step_norm="std", step_norm_beta=0.8, momentum=0.5, lr_decay=10.0)
    assert cfg.zo().step_norm == StepNormConfig("std", 0.8)
    run_to_dir(cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["step_norm"], saved["step_norm_beta"]) == ("std", 0.8)
    _, ckpt = rebuild(tmp_path)
    final = torch.load(tmp_path / "model.pt")
    for part in ("model", "h", "momentum", "step_norm"):
        assert all(torch.equal(final[part][k], v) for k, v in ckpt[part].items()), part
    with pytest.raises(ConfigError, match="step_norm is for hiso, decomfl, feedsign and conmezo"):
        load_config(None, algorithm="fedavg", task="quadratic", step_norm="std")
    with pytest.raises(ConfigError, match="local_steps 1"):
        load_config(None, task="quadratic", step_norm="std", local_steps=2)
    with pytest.raises(ConfigError, match="step_norm"):
        load_config(None, task="quadratic", step_norm="max")
    from hiso.core.messages import config_fingerprint
    same_but_unnormalised = cfg.model_copy(update={"step_norm": None}).zo()
    assert config_fingerprint(cfg.zo()) != config_fingerprint(same_but_unnormalised)
