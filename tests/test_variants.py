"""The variants at no extra bytes (hiso.methods.momentum, PreconditionerConfig's stat, granularity and
bias correction): their arithmetic against numpy float64 by hand, and exactness (server, clients
that skip rounds, a rebuild from the log) with each of them.

The reference (see test_reference_arithmetic.py for the paper's rules) applies a round's record:

    ghat_k = (1/P) sum_p G_{k,p} H_r^{-1/2} u_{k,p}
    no momentum: x <- x - eta sum_k ghat_k;   momentum: m <- beta m + (1 - beta) sum_k ghat_k, x <- x - eta m
    for each H update t (the last step, or every step in order), S_k = (1/P) sum_p G_{k,p}^2:
      stat = ghat_k^2 | S_k / (P H_r) | max((P ghat_k^2 - S_k / H_r) / (P + 1), 0)
      block mean of stat over each tensor ('tensor') or over the whole model ('model')
      (a, b) = (1 - nu, nu), or with bias correction ((1 - nu) c_t / c_{t+1}, nu / c_{t+1}), c_t = 1 - (1 - nu)^t
      H <- clip(a H + b (stat + eps))
"""

import numpy as np
import pytest
import torch

from hiso.methods.momentum import MomentumConfig
from hiso.core import (Client, Downlink, ModelState, PreconditionerConfig, RoundRecord, decode_downlink,
                       encode_downlink)
from hiso.methods.hiso_method import decomfl, hiso
from hiso.runners.simulate import Simulation

from conftest import TinyTask
from test_reference_arithmetic import SHAPES, Net, u_of

LR, P = 0.05, 3
RTOL, ATOL = 1e-4, 1e-6  # float32 against float64 over a few rounds (observed: ~1e-5 relative)

VARIANTS = {
    "decomfl-mom": (None, 0.8),
    "hiso-mom": (PreconditionerConfig(nu=0.3), 0.8),
    "tensor": (PreconditionerConfig(nu=0.3, granularity="tensor"), None),
    "model": (PreconditionerConfig(nu=0.3, granularity="model"), None),
    "bias-corrected": (PreconditionerConfig(nu=0.3, bias_correction=True), None),
    "floor": (PreconditionerConfig(nu=0.3, stat="floor"), None),
    "denoised": (PreconditionerConfig(nu=0.3, stat="denoised"), None),
    "denoised-tensor-bc-clipped-mom": (PreconditionerConfig(nu=0.3, stat="denoised", granularity="tensor",
                                                            bias_correction=True, h_min=0.3, h_max=3.0), 0.5),
    "floor-model-every": (PreconditionerConfig(nu=0.3, stat="floor", granularity="model", source="every"), None),
}


def _zo(name, tau, lr=LR):
    pc, beta = VARIANTS[name]
    mom = None if beta is None else MomentumConfig(beta)
    if pc is None:
        return decomfl(lr=lr, perturbations=P, local_steps=tau, momentum=mom)
    return hiso(lr=lr, perturbations=P, local_steps=tau, precond=pc, momentum=mom)


def ref_apply(x, H, M, rec, pc, beta, t0):
    """x, H, m after one record, from the rules above (float64)."""
    tau = rec.seeds.shape[0]
    G = rec.scalars.astype(np.float64)
    ghats = []
    for k in range(tau):
        us = [u_of(rec.seeds[k, p]) for p in range(P)]
        ghats.append([sum(G[k, p] * us[p][i] for p in range(P)) / P / np.sqrt(H[i]) for i in range(len(x))])
    total = [sum(ghats[k][i] for k in range(tau)) for i in range(len(x))]
    if beta is None:
        x = [a - LR * g for a, g in zip(x, total)]
    else:
        M = [beta * m + (1 - beta) * g for m, g in zip(M, total)]
        x = [a - LR * m for a, m in zip(x, M)]
    if pc is None:
        return x, H, M
    Hr, Hn = H, [h.copy() for h in H]
    steps = list(range(tau)) if pc.source == "every" else [tau - 1]
    for j, k in enumerate(steps):
        S = np.mean(G[k] ** 2)
        if pc.stat == "ghat2":
            st = [g ** 2 for g in ghats[k]]
        elif pc.stat == "floor":
            st = [S / (P * h) for h in Hr]
        else:
            st = [np.maximum((P * g ** 2 - S / h) / (P + 1), 0.0) for g, h in zip(ghats[k], Hr)]
        if pc.granularity == "tensor":
            st = [np.full(s.shape, s.mean()) for s in st]
        elif pc.granularity == "model":
            mean = sum(s.sum() for s in st) / sum(s.size for s in st)
            st = [np.full(s.shape, mean) for s in st]
        t = t0 + j
        if pc.bias_correction:
            c = lambda n: 1 - (1 - pc.nu) ** n  # noqa: E731
            a, b = (1 - pc.nu) * c(t) / c(t + 1), pc.nu / c(t + 1)
        else:
            a, b = 1 - pc.nu, pc.nu
        Hn = [np.clip(a * h + b * (s + pc.eps), pc.h_min, pc.h_max) for h, s in zip(Hn, st)]
    return x, Hn, M


def _np(ts):
    return [t.detach().double().numpy().copy() for t in ts]


def _record(tau, rnd, seed):
    rng = np.random.default_rng(seed)
    return RoundRecord(rnd, rng.integers(0, 2**63, (tau, P), dtype=np.uint64),
                       (2.0 * rng.standard_normal((tau, P))).astype(np.float32))


def _close(code, ref, what):
    for i, (a, b) in enumerate(zip(code, ref)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"{what}, tensor {i}")


@pytest.mark.parametrize("tau", [1, 2])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_rounds_match_numpy_by_hand(name, tau):
    pc, beta = VARIANTS[name]
    st = ModelState(Net(), _zo(name, tau))
    plain = ModelState(Net(), hiso(lr=LR, perturbations=P, local_steps=tau, precond=PreconditionerConfig(nu=0.3)))
    x, H, M = _np(st.params), [np.ones(s) for s in SHAPES], [np.zeros(s) for s in SHAPES]
    per_round = 2 if (pc is not None and pc.source == "every") else 1
    per_round = tau if per_round == 2 else 1
    for r in range(4):
        rec = _record(tau, r, 100 + r)
        st.apply(rec)
        plain.apply(rec)
        x, H, M = ref_apply(x, H, M, rec, pc, beta, r * per_round)
        _close(_np(st.params), x, f"x_{r + 1}")
        if pc is not None:
            _close(_np(st.h), H, f"H_{r + 1}")
            if pc.granularity == "tensor":
                assert all(torch.unique(h).numel() == 1 for h in st.h)
            elif pc.granularity == "model":
                assert torch.unique(torch.cat([h.view(-1) for h in st.h])).numel() == 1
        else:
            assert st.h is None
        if beta is not None:
            _close(_np(st.m), M, f"m_{r + 1}")
            assert "momentum" in st.state_dict()
    # the variant moved x differently from plain HiSo (the comparisons above could fail)
    assert max(np.abs(a - b).max() for a, b in zip(_np(st.params), _np(plain.params))) > 1e-3


def test_bias_corrected_h1_is_the_first_statistic():
    pc = PreconditionerConfig(nu=0.05, eps=0.0, bias_correction=True)
    st = ModelState(Net(), hiso(lr=LR, perturbations=P, precond=pc))
    rec = _record(1, 0, 7)
    st.apply(rec)
    ghat = [sum(float(rec.scalars[0, p]) * u_of(rec.seeds[0, p])[i] for p in range(P)) / P for i in range(3)]
    _close(_np(st.h), [g ** 2 for g in ghat], "H_1 = ghat^2")


def test_defaults_leave_hiso_unchanged():
    """The default PreconditionerConfig takes the paper's path: same numbers as the explicit fields."""
    a = ModelState(Net(), hiso(lr=LR, perturbations=P, precond=PreconditionerConfig()))
    b = ModelState(Net(), hiso(lr=LR, perturbations=P, precond=PreconditionerConfig(
        stat="ghat2", granularity="coordinate", bias_correction=False)))
    for r in range(3):
        rec = _record(1, r, 200 + r)
        a.apply(rec)
        b.apply(rec)
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))
    assert all(torch.equal(p, q) for p, q in zip(a.h, b.h))


def _same(a: ModelState, b: ModelState) -> bool:
    ok = all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    for u, v in ((a.h, b.h), (a.m, b.m)):
        if u is not None:
            ok = ok and all(torch.equal(x, y) for x, y in zip(u, v))
    return ok


@pytest.mark.parametrize("name", ["hiso-mom", "decomfl-mom", "tensor", "model", "bias-corrected", "floor",
                                  "denoised-tensor-bc-clipped-mom"])
def test_faithful_clients_and_a_late_client_match_the_server(name):
    # bias correction makes H's first estimates from one round's ghat^2 (small): its steps start
    # large, and at 0.02 the tiny task diverges (finite) with the v2 seeds; exactness is the point here
    zo = _zo(name, 2, lr=0.005 if name == "bias-corrected" else 0.02)
    task = TinyTask(num_clients=20)
    # snapshot_after: never snapshot, so the server keeps the whole history for the late client
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=10**6)
    rows = list(sim.run(60))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert min(c.state.round for c in sim.clients.values()) < 60  # some clients skipped rounds
    sim.sync_all()
    for c in sim.clients.values():
        assert _same(c.state, sim.state), f"client {c.cid} drifted"
    late = ModelState(task.build_model(), zo)  # joins at round 60 and replays everything
    late.replay(sim.server.records_since(0))
    assert _same(late, sim.state)
    if zo.momentum is not None:
        assert any(float(m.abs().max()) > 0 for m in sim.state.m)


@pytest.mark.parametrize("flags", [
    {"momentum": 0.9}, {"h_granularity": "tensor", "h_bias_correction": True},
    {"h_stat": "denoised", "h_granularity": "model", "momentum": 0.5}], ids=["mom", "tensor-bc", "denoised-model-mom"])
def test_config_records_the_variant_and_rebuild_reproduces_it(tmp_path, flags):
    import json

    from hiso.config import load_config
    from hiso.runners.rundir import rebuild, run_to_dir
    cfg = load_config(None, task="quadratic", dim=30, rounds=25, eval_every=5, threads=1, **flags)
    run_to_dir(cfg, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert all({**saved, **saved["method_opts"]}[k] == v for k, v in flags.items())  # HiSo's in its method_opts
    state, ckpt = rebuild(tmp_path)
    final = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(final["model"][k], v) for k, v in ckpt["model"].items())
    assert all(torch.equal(final["h"][k], v) for k, v in ckpt["h"].items())
    if "momentum" in flags:
        assert set(final["momentum"]) == set(ckpt["momentum"])
        assert all(torch.equal(final["momentum"][k], v) for k, v in ckpt["momentum"].items())


def test_bad_variant_options_are_one_line_errors():
    from hiso.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="h_granularity"):
        load_config(None, h_granularity="layer")
    with pytest.raises(ConfigError, match="momentum"):
        load_config(None, momentum=1.0)
    with pytest.raises(ConfigError, match="needs nu > 0"):
        load_config(None, h_bias_correction=True, nu=0.0)
    with pytest.raises(ValueError, match="beta"):
        MomentumConfig(beta=0.0)


@pytest.mark.parametrize("name", ["hiso-mom", "decomfl-mom"])
def test_snapshots_carry_the_momentum_buffer(name):
    """A client more than K rounds behind is sent a snapshot: with momentum it must carry the
    buffer too, or the client's next rounds drift from the server's."""
    zo = _zo(name, 1, lr=0.02)
    sim = Simulation(TinyTask(num_clients=20), zo, clients_per_round=3, seed=2, batch_size=8, mode="faithful",
                     eval_every=1000, snapshot_after=2)
    list(sim.run(40))
    sim.sync_all()
    assert any(float(m.abs().max()) > 0 for m in sim.state.m)
    for c in sim.clients.values():
        assert _same(c.state, sim.state), f"client {c.cid} drifted"
