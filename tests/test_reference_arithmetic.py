"""The arithmetic against the paper's update rules, computed by hand in float64 numpy.

Every other test compares peers that all run the same ``ModelState.apply``: they agree with each
other, not necessarily with the algorithm. Here a small model (three tensors, 14 numbers) is
trained for a few rounds twice: once by the code (``local_update``, ``Server.aggregate``,
``ModelState.apply``, float32) and once from the update rules alone (numpy, float64):

    z_p = H_r^{-1/2} u_p                      u_p = direction(s_{r,k,p})  (the protocol's definition)
    g_p = (f(x_k + mu z_p) - f(x_k)) / mu     forward   (central: (f(x_k + mu z_p) - f(x_k - mu z_p)) / 2mu)
    x_{k+1} = x_k - eta (1/P) sum_p g_p z_p   local steps k = 0..tau-1 (H_r fixed)
    G_{k,p} = sum_c w_c g^c_{k,p} / sum_c w_c server mean (w_c = 1 unweighted)
    x_{r+1} = x_r - eta sum_k ghat_k,         ghat_k = (1/P) sum_p G_{k,p} H_r^{-1/2} u_{k,p}
    H_{r+1} = clip((1 - nu) H_r + nu (ghat^2 + eps))   after x; ghat of the last step ('last'),
                                              or folded over every step in order ('every'), H_r
                                              used by every step of the round either way.

The reference keeps its own float64 trajectory (it never reads the code's state back), so an
error anywhere in the chain shows up in a later round too. Tolerances are float32's: the losses
are O(1) and mu = 1e-2, so a scalar carries ~1e-5 of rounding; the changes the tests are meant to
catch (H updated before the step, |ghat| for ghat^2, H moving inside a round, weights ignored)
move numbers by 1e-2 or more.
"""

import numpy as np
import pytest
import torch
from torch import nn

from hiso.core import (Client, Downlink, MessageError, ModelState, Perturber, PreconditionerConfig,
                       RoundRecord, Uplink, Wire, decode_downlink, direction, encode_downlink, local_update)
from hiso.methods.hiso_method import decomfl, hiso
from hiso.core.server import Server

SHAPES = [(2, 3), (2,), (2, 2)]
M, m = 5, 3  # clients, sampled per round
WEIGHTS = [1.0, 3.0, 0.5, 2.0, 7.0]
LR, MU, P = 0.05, 1e-2, 3
# float32 against float64: models and H agree to about 1e-6 relative; a scalar is a float32 loss
# difference over mu, so it carries ~eps32 * |f| / mu ~ 1e-5 absolute rounding (observed: up to 1e-5)
RTOL, ATOL = 2e-4, 2e-5
ATOL_G = 1e-4


class Net(nn.Module):
    """loss(W, b, V; X, Y) = mean((tanh(X W^T + b) V^T - Y)^2): three tensors, protocol order W, b, V."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W = nn.Parameter(0.7 * torch.randn(2, 3, generator=g))
        self.b = nn.Parameter(0.7 * torch.randn(2, generator=g))
        self.V = nn.Parameter(0.7 * torch.randn(2, 2, generator=g))

    def forward(self, batch):
        X, Y = batch
        return ((torch.tanh(X @ self.W.T + self.b) @ self.V.T - Y) ** 2).mean()


def loss_fn(model, batch):
    return model(batch)


def np_loss(x, batch) -> float:
    W, b, V = x
    X, Y = (t.double().numpy() for t in batch)
    return float(((np.tanh(X @ W.T + b) @ V.T - Y) ** 2).mean())


def batch(client: int, rnd: int, k: int):
    rng = np.random.default_rng([client, rnd, k])
    return (torch.from_numpy(rng.standard_normal((6, 3)).astype(np.float32)),
            torch.from_numpy((0.5 * rng.standard_normal((6, 2))).astype(np.float32)))


def u_of(seed) -> list[np.ndarray]:
    return [t.double().numpy() for t in direction(int(seed), SHAPES)]


# ---- the reference: the paper's rules, float64 -------------------------------------------------

def ref_local(x, H, seeds, batches, difference):
    """A client's (tau, P) scalars and its last local iterate, from x_r and H_r."""
    tau, P_ = seeds.shape
    xk = [a.copy() for a in x]
    G = np.zeros((tau, P_))
    for k in range(tau):
        zs = [[u / np.sqrt(h) for u, h in zip(u_of(seeds[k, p]), H)] for p in range(P_)]
        f0 = np_loss(xk, batches[k])
        for p, z in enumerate(zs):
            fp = np_loss([a + MU * zi for a, zi in zip(xk, z)], batches[k])
            if difference == "forward":
                G[k, p] = (fp - f0) / MU
            else:
                fm = np_loss([a - MU * zi for a, zi in zip(xk, z)], batches[k])
                G[k, p] = (fp - fm) / (2 * MU)
        xk = [a - LR * sum(G[k, p] * zs[p][i] for p in range(P_)) / P_ for i, a in enumerate(xk)]
    return G, xk


def ref_mean(G_by_client: dict[int, np.ndarray], weights) -> np.ndarray:
    cs = sorted(G_by_client)
    w = np.array([1.0 if weights is None else weights[c] for c in cs])
    return sum(wi * G_by_client[c] for wi, c in zip(w, cs)) / w.sum()


def ref_apply(x, H, seeds, G, pc: PreconditionerConfig | None):
    """x_{r+1} and H_{r+1} from x_r, H_r and the round's mean scalars G (tau, P)."""
    tau, P_ = seeds.shape
    ghats = []
    for k in range(tau):
        us = [u_of(seeds[k, p]) for p in range(P_)]
        ghats.append([sum(G[k, p] * us[p][i] for p in range(P_)) / P_ / np.sqrt(H[i]) for i in range(len(x))])
    x_new = [a - LR * sum(ghats[k][i] for k in range(tau)) for i, a in enumerate(x)]
    if pc is None:
        return x_new, H
    H_new = [h.copy() for h in H]
    for k in (range(tau) if pc.source == "every" else [tau - 1]):
        H_new = [np.clip((1 - pc.nu) * h + pc.nu * (gh ** 2 + pc.eps), pc.h_min, pc.h_max)
                 for h, gh in zip(H_new, ghats[k])]
    return x_new, H_new


# ---- helpers ---------------------------------------------------------------------------------

def _np(ts) -> list[np.ndarray]:
    return [t.detach().double().numpy().copy() for t in ts]


def _close(code, ref, what):
    for i, (a, b) in enumerate(zip(code, ref)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"{what}, tensor {i}")


def _config(precond, tau, difference):
    if precond is None:
        return decomfl(lr=LR, mu=MU, perturbations=P, local_steps=tau, difference=difference)
    return hiso(lr=LR, mu=MU, perturbations=P, local_steps=tau, difference=difference, precond=precond)


PRECONDS = {
    "decomfl": None,
    "last": PreconditionerConfig(nu=0.3, source="last"),
    "every": PreconditionerConfig(nu=0.3, source="every"),
    "every-clipped": PreconditionerConfig(nu=0.3, source="every", h_min=0.45, h_max=0.6),
    "last-clipped": PreconditionerConfig(nu=0.3, source="last", h_min=0.45, h_max=0.6),
}


def _run_both(zo, weights, rounds=3, seed=4):
    """Train with the code and with the reference side by side; check every number of every round.

    Returns the reference H of every round (for tests that need to know what H did)."""
    tau = zo.local_steps
    server = Server(M, m, tau, P, seed=seed, weights=weights)
    state = ModelState(Net(), zo)
    perturber = Perturber(state.model, state.params)
    x = _np(state.params)
    H = [np.ones(s) for s in SHAPES]
    Hs = [H]
    for r in range(rounds):
        plan = server.plan()
        uplinks, G_ref = [], {}
        for c in plan.participants:
            batches = [batch(c, r, k) for k in range(tau)]
            scalars, _, delta, _ = local_update(state, perturber, loss_fn, batches, plan.seeds, return_delta=True)
            G_ref[c], x_local = ref_local(x, H, plan.seeds, batches, zo.difference)
            np.testing.assert_allclose(scalars, G_ref[c], rtol=RTOL, atol=ATOL_G, err_msg=f"round {r} client {c} scalars")
            _close([xi + d for xi, d in zip(_np(state.params), _np(delta))], x_local, f"round {r} client {c} local iterate")
            uplinks.append(Uplink(c, r, scalars))
        rec = server.aggregate(uplinks)
        # the server's mean of the code's own scalars is exact (float64 sum, one rounding) ...
        code_G = {u.client: u.scalars.astype(np.float64) for u in uplinks}
        np.testing.assert_allclose(rec.scalars, ref_mean(code_G, weights), rtol=1e-6, atol=1e-7,
                                   err_msg=f"round {r} server mean")
        # ... and agrees with the reference's mean of the reference's scalars
        G = ref_mean(G_ref, weights)
        np.testing.assert_allclose(rec.scalars, G, rtol=RTOL, atol=ATOL_G, err_msg=f"round {r} mean scalars")
        state.apply(rec)
        x, H = ref_apply(x, H, plan.seeds, G, zo.precond)
        Hs.append(H)
        _close(_np(state.params), x, f"x_{r + 1}")
        if zo.precond is None:
            assert state.h is None
        else:
            _close(_np(state.h), H, f"H_{r + 1}")
    assert state.round == rounds
    # the rounds moved x and H by far more than the tolerances (the comparisons could fail)
    assert max(np.abs(a - b).max() for a, b in zip(x, _np(Net().parameters()))) > 100 * ATOL
    if zo.precond is not None:
        assert max(np.abs(h - 1).max() for h in H) > 0.05
    return Hs


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("difference", ["forward", "central"])
@pytest.mark.parametrize("tau", [1, 2])
@pytest.mark.parametrize("precond", list(PRECONDS), ids=list(PRECONDS))
def test_rounds_match_the_update_rules_computed_by_hand(precond, tau, difference, weighted):
    zo = _config(PRECONDS[precond], tau, difference)
    Hs = _run_both(zo, WEIGHTS if weighted else None)
    pc = PRECONDS[precond]
    if pc is not None and pc.h_min is not None:  # the clipped cases really clip, at both ends
        flat = np.concatenate([h.ravel() for H in Hs[1:] for h in H])
        assert np.isclose(flat, pc.h_min).any() and np.isclose(flat, pc.h_max).any(), flat


def _record(tau, rnd=0, seed=11):
    rng = np.random.default_rng(seed)
    return RoundRecord(rnd, rng.integers(0, 2**63, (tau, P), dtype=np.uint64),
                       rng.standard_normal((tau, P)).astype(np.float32))


@pytest.mark.parametrize("source", ["last", "every"])
def test_round_one_steps_with_h0_and_h_moves_only_after_the_step(source):
    """H_0 = 1, so x_1 must be exactly DeComFL's x_1 for the same record; H_1 is the EMA of ghat^2."""
    pc = PreconditionerConfig(nu=0.5, source=source)
    rec = _record(tau=1)
    a, b = ModelState(Net(), _config(pc, 1, "forward")), ModelState(Net(), _config(None, 1, "forward"))
    a.apply(rec)
    b.apply(rec)
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params)), "round 1 did not step with H_0 = 1"
    ghat = [sum(float(rec.scalars[0, p]) * u_of(rec.seeds[0, p])[i] for p in range(P)) / P for i in range(3)]
    _close(_np(a.h), [0.5 + 0.5 * (g ** 2 + pc.eps) for g in ghat], "H_1")
    # round 2 steps with H_1, not with H_2
    rec2 = _record(tau=1, rnd=1, seed=12)
    x1, h1 = _np(a.params), _np(a.h)
    a.apply(rec2)
    x2, h2 = ref_apply(x1, h1, rec2.seeds, rec2.scalars.astype(np.float64), pc)
    _close(_np(a.params), x2, "x_2")
    _close(_np(a.h), h2, "H_2")


def test_h_ema_is_of_the_square_of_ghat_not_its_magnitude():
    pc = PreconditionerConfig(nu=1.0, eps=0.0)  # H_1 = ghat^2 exactly
    rec = _record(tau=1, seed=13)
    st = ModelState(Net(), _config(pc, 1, "forward"))
    st.apply(rec)
    ghat = [sum(float(rec.scalars[0, p]) * u_of(rec.seeds[0, p])[i] for p in range(P)) / P for i in range(3)]
    _close(_np(st.h), [g ** 2 for g in ghat], "H_1 = ghat^2")
    # |ghat| differs from ghat^2 wherever |ghat| is not 0 or 1: the comparison above can fail
    assert max(np.abs(np.abs(g) - g ** 2).max() for g in ghat) > 0.1


def test_h_stays_fixed_inside_a_round_with_source_every():
    """tau = 2, 'every': both steps' directions use H_r; H folds both steps' ghat after the step."""
    pc = PreconditionerConfig(nu=0.5, source="every")
    st = ModelState(Net(), _config(pc, 2, "forward"))
    st.h[0].fill_(4.0)  # an H far from 1, so a moving H would change step 2's direction a lot
    rec = _record(tau=2, seed=14)
    x0, h0 = _np(st.params), _np(st.h)
    st.apply(rec)
    x1, h1 = ref_apply(x0, h0, rec.seeds, rec.scalars.astype(np.float64), pc)
    _close(_np(st.params), x1, "x_1")
    _close(_np(st.h), h1, "H_1")


@pytest.mark.parametrize("partial", [False, True], ids=["strict", "partial"])
def test_server_mean_is_weighted_by_the_client_weights(partial):
    w = [1.0, 10.0, 0.5, 2.0, 7.0]
    weighted, plain = Server(M, 4, 2, P, seed=1, weights=w), Server(M, 4, 2, P, seed=1)
    rng = np.random.default_rng(0)
    for srv in (weighted, plain):
        plan = srv.plan()
    answer = plan.participants[:-1] if partial else plan.participants  # partial: one answer lost
    g = {c: rng.standard_normal((2, P)).astype(np.float32) for c in answer}
    rw = weighted.aggregate([Uplink(c, 0, g[c]) for c in answer], partial=partial)
    rp = plain.aggregate([Uplink(c, 0, g[c]) for c in answer], partial=partial)
    stack = np.stack([g[c].astype(np.float64) for c in answer])
    ww = np.array([w[c] for c in answer])
    np.testing.assert_allclose(rw.scalars, np.tensordot(ww / ww.sum(), stack, axes=1), rtol=1e-6)
    np.testing.assert_allclose(rp.scalars, stack.mean(0), rtol=1e-6)
    assert np.abs(rw.scalars - rp.scalars).max() > 0.05  # the weights matter here


def _nan_history_downlink(zo, bad=float("nan")):
    """A downlink whose history scalar [0, 1] of round 1 is ``bad`` (our encoder refuses to
    write one, so the bytes are patched: a faulty or hostile sender)."""
    recs = [_record(zo.local_steps, rnd=r, seed=20 + r) for r in range(3)]
    data = bytearray(encode_downlink(Downlink(3, np.arange(1, 1 + zo.local_steps * P, dtype=np.uint64).reshape(zo.shape),
                                              0, tuple(recs))))
    at = 6 + 4 * (zo.local_steps * P + 1)  # header (6 varints), record 0, then [0, 1] of record 1
    data[at:at + 4] = np.array([bad], "<f4").tobytes()
    return bytes(data)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_decode_downlink_rejects_a_non_finite_history_scalar(bad):
    zo = _config(PRECONDS["last"], 1, "forward")
    with pytest.raises(MessageError, match="non-finite"):
        decode_downlink(_nan_history_downlink(zo, bad), Wire(*zo.shape))


def test_a_client_refuses_a_nan_history_and_keeps_its_model():
    zo = _config(PRECONDS["last"], 1, "forward")
    client = Client(0, ModelState(Net(), zo), loss_fn, lambda r, k: batch(0, r, k), wire=Wire(*zo.shape))
    before = [p.detach().clone() for p in client.state.params]
    with pytest.raises(MessageError):
        client.handle(_nan_history_downlink(zo))
    assert client.state.round == 0
    assert all(torch.equal(p, q) for p, q in zip(client.state.params, before))
    assert all(torch.equal(h, torch.ones_like(h)) for h in client.state.h)
