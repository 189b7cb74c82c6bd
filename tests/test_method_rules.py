"""Known answers for the methods' rules on several tensors and several local steps (issue 41,
item 3): Ferret's projection and reconstruction, FeedSign's zero scalar, local steps and
weighted vote. Local DP noise and the scalar formats' rounding are in test_scalar_rules.py.

Every expected number is worked in the test (float64, its own loops, the protocol's direction
definition), never copied from the code's output. Each test names the broken rule it catches."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from hiso.config import load_config
from hiso.core import Downlink, ModelState, Perturber, RoundRecord, Server, Uplink
from hiso.core.client import answer
from hiso.core.directions import direction
from hiso.methods.feedsign import FeedSign, signs
from hiso.methods.ferret import blocks_of


def _answer(state, loss_fn, batches, seeds):
    """Client 0's uplink for round 0 from ``state`` (the path of Client.train)."""
    msg = Downlink(0, np.asarray(seeds, np.uint64), 0)
    return answer(0, state, Perturber(state.model, state.params), loss_fn, lambda r, k: batches[k], msg)


def _seeds(shape, salt):
    return np.random.default_rng(salt).integers(1, 2**63, size=shape, dtype=np.uint64)


def _vs(seed, params):
    """The direction for ``seed`` as float64 tensors: tensor t from its own stream (index t)."""
    return [v.double() for v in direction(int(seed), [p.shape for p in params])]


def _x64(params):
    return [p.detach().double().clone() for p in params]


# ---------------------------------------------------------------- Ferret: 4 tensors, 2 blocks, 3 steps

class _Net(nn.Module):
    """Tensors of 6, 2, 4 and 2 values (d = 14): starts 0, 6, 8, 12, so B = 2 puts tensors
    0 and 1 in block 0 and tensors 2 and 3 in block 1 (floor(2 s / 14))."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _mse(model, batch):
    x, y = batch
    dt = next(model.parameters()).dtype
    return ((model(x.to(dt)) - y.to(dt)) ** 2).mean()


_BLOCKS = [0, 0, 1, 1]


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(n)]


def _ferret(steps, K, B=2, lr=0.1, server_lr=0.5):
    return load_config(None, algorithm="ferret", task="quadratic", lr=lr, local_steps=steps, ferret_k=K,
                       ferret_blocks=B, server_lr=server_lr).zo()


def _sgd64(model, batches, lr):
    """Plain SGD on a float64 copy (autograd of the copy, our own loop): the models x_0 .. x_n."""
    out = [copy.deepcopy(model).double()]
    for batch in batches:
        m = copy.deepcopy(out[-1])
        params = list(m.parameters())
        grads = torch.autograd.grad(_mse(m, batch), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
        out.append(m)
    return out


def _delta64(model, batches, lr):
    """Delta = x_0 - x_n per tensor."""
    xs = _sgd64(model, batches, lr)
    return [a.detach() - b.detach() for a, b in zip(xs[0].parameters(), xs[-1].parameters())]


def _project64(delta, seeds, params):
    """s_{b,k} = sum over EVERY tensor t of block b of <Delta_t, v_{b,k,t}>."""
    B, K = seeds.shape
    s = np.zeros((B, K))
    for b in range(B):
        for k in range(K):
            v = _vs(seeds[b, k], params)
            s[b, k] = sum(float(torch.dot(delta[t].reshape(-1), v[t].reshape(-1)))
                          for t in range(len(params)) if _BLOCKS[t] == b)
    return s


def test_ferret_projection_sums_every_tensor_of_a_block_each_on_its_own_stream():
    """Breaks caught: a projection that keeps only a block's last tensor, or draws every tensor
    from tensor 0's stream, or counts fewer than all local steps."""
    zo = _ferret(steps=3, K=3)
    model = _Net()
    state = ModelState(model, zo)
    assert blocks_of(state.params, 2) == _BLOCKS
    x0 = [p.detach().clone() for p in state.params]
    batches, seeds = _batches(3), _seeds((2, 3), 2)
    delta = _delta64(model, batches, 0.1)
    # the fixture can tell the rules apart: every tensor moved, and 3 steps are not 1
    assert all(float(d.abs().min()) > 1e-4 for d in delta)
    assert np.abs(_project64(_delta64(model, batches[:1], 0.1), seeds, state.params)
                  - _project64(delta, seeds, state.params)).min() > 1e-3
    up = _answer(state, _mse, batches, seeds)
    np.testing.assert_allclose(up.scalars, _project64(delta, seeds, state.params), rtol=1e-4, atol=2e-6)
    expect_loss = np.mean([float(_mse(m, b).detach()) for m, b in zip(_sgd64(model, batches, 0.1), batches)])
    assert up.loss == pytest.approx(expect_loss, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(x0, state.params))  # x_r again, bit for bit


def test_ferret_reconstruction_is_minus_server_lr_times_the_mean_over_k_per_block():
    """x_t <- x_t - server_lr (1/K) sum_k sbar_{b(t),k} v_{b(t),k,t}. Breaks caught: a
    reconstruction from the wrong tensor's stream or block, or without server_lr."""
    K = 3
    state = ModelState(_Net(), _ferret(steps=1, K=K, server_lr=0.5))
    x = _x64(state.params)
    seeds = _seeds((2, K), 3)
    sbar = np.array([[0.75, -1.5, 0.25], [2.0, -0.125, 1.0]], np.float32)
    state.apply(RoundRecord(0, seeds, sbar))
    expect = [xt.clone() for xt in x]
    for t in range(4):
        b = _BLOCKS[t]
        for k in range(K):
            expect[t] -= 0.5 / K * float(sbar[b, k]) * _vs(seeds[b, k], state.params)[t]
    for got, want in zip(state.params, expect):
        np.testing.assert_allclose(got.detach().double().numpy(), want.numpy(), rtol=0, atol=1e-6)
    assert state.round == 1


class _Vec(nn.Module):
    """Tensors of 4, 3, 5 and 2 values at 0 (d = 14, blocks [0, 0, 1, 1] at B = 2, 7 values each);
    loss sum_t <c_t, x_t>: every SGD step moves x by exactly -lr c."""

    def __init__(self):
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in (4, 3, 5, 2)])


def test_ferret_reconstruction_is_unbiased_at_large_k():
    """Rademacher v over a block of d values: E ||(1/K) sum_k v_k <v_k, D> - D_t||^2 over
    tensor t's values = (d_t ||D_b||^2 - ||D_t||^2) / K (relative error ~ sqrt((d - 1) / K),
    2.7 % at d = 7, K = 8000). We allow 4x that per tensor: 16x the mean squared error, which
    a 2-value tensor's (about chi-square, 2 degrees of freedom) passes with probability ~e^-16.
    Breaks caught: the projection's last-tensor-only, tensor-0-stream and first-step-only rules,
    the reconstruction's wrong stream or block (a tensor lost or mixed up: 50-100 % error)."""
    K = 8000
    zo = _ferret(steps=2, K=K, lr=0.25, server_lr=1.0)
    model = _Vec()
    c = [torch.tensor(v, dtype=torch.float32) for v in
         ([1.0, -2.0, 0.5, 1.5], [-1.0, 0.75, 2.0], [0.5, 1.0, -1.5, -0.25, 2.0], [-2.0, 1.25])]

    def loss(m, batch):
        return sum((ci * p).sum() for ci, p in zip(c, m.p))

    state = ModelState(model, zo)
    assert blocks_of(state.params, 2) == _BLOCKS
    seeds = _seeds((2, K), 4)
    up = _answer(state, loss, [None, None], seeds)
    state.apply(RoundRecord(0, seeds, up.scalars))
    D = [2 * 0.25 * ci.double() for ci in c]  # two steps of lr 0.25 from 0
    Db = [sum(float((D[t] ** 2).sum()) for t in range(4) if _BLOCKS[t] == b) for b in range(2)]
    for t in range(4):
        got = -state.params[t].detach().double()  # x_1 = 0 - Dhat
        err = float(((got - D[t]) ** 2).sum())
        expect = (D[t].numel() * Db[_BLOCKS[t]] - float((D[t] ** 2).sum())) / K
        assert err < 16 * expect, (t, err, expect)


# ---------------------------------------------------------------- FeedSign: two tensors, tau > 1

class _Two(nn.Module):
    """A 1 x 3 and a 2-value tensor (d = 5, odd, so <z, z'> of two Rademacher directions is never
    0); forward(a) is ||x - a||^2 / 2 (through forward: the perturbation hooks see the tensors)."""

    def __init__(self, init=None):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.zeros(1, 3)), nn.Parameter(torch.zeros(2))
        if init is not None:
            with torch.no_grad():
                self.w.copy_(torch.tensor([init[:3]])), self.b.copy_(torch.tensor(init[3:]))

    def forward(self, a):
        return 0.5 * (((self.w - a[0]) ** 2).sum() + ((self.b - a[1]) ** 2).sum())


def _feedsign(tau, lr, mu=1e-2):
    return load_config(None, algorithm="feedsign", task="quadratic", lr=lr, mu=mu, local_steps=tau).zo()


def _half_sq(target):
    a = [torch.tensor([target[:3]]), torch.tensor(target[3:])]
    return lambda m, batch: m(a)


def test_feedsign_zero_scalar_counts_as_minus_one_and_the_next_step_moves_by_plus_eta_z():
    """f = ||x||^2 / 2 from x = 0: g_0 = 0 exactly, so b_0 = -1, x_1 = +eta z_0 and
    g_1 = eta <z_0, z_1>. Breaks caught: a zero sent (or stepped with) as +1; a step taken
    with the scalar (0 here: x_1 = x_0, g_1 = 0)."""
    assert signs(np.array([0.0, -0.0, 1e-30, -1e-30])).tolist() == [-1.0, -1.0, 1.0, -1.0]
    eta, mu = 0.1, 1e-2
    state = ModelState(_Two(), _feedsign(tau=2, lr=eta, mu=mu))
    seeds = _seeds((2, 1), 5)
    z0, z1 = (torch.cat([v.reshape(-1) for v in _vs(s, state.params)]) for s in seeds[:, 0])
    dot = float(torch.dot(z0, z1))
    assert dot != 0
    up = _answer(state, _half_sq([0.0] * 5), [None, None], seeds)
    assert up.scalars.tolist() == [[-1.0], [1.0 if dot > 0 else -1.0]]
    # mean over steps of (f(x_k + mu z) + f(x_k - mu z)) / 2 = f(x_k) + mu^2 d / 2
    assert up.loss == pytest.approx(np.mean([0.0, 0.5 * eta**2 * 5]) + 0.5 * mu**2 * 5, rel=1e-5)


def _feedsign_local64(x0, a, zs, eta, mu, with_sign=True):
    """Signs and mean loss of tau central-difference steps, x_{k+1} = x_k - eta b_k z_k
    (with_sign False: the scalar g_k instead of b_k, the rule the test must tell apart)."""
    x, out, losses = x0.clone(), [], []
    for z in zs:
        g = float(torch.dot(x - a, z))  # (f(x + mu z) - f(x - mu z)) / (2 mu) for f = ||x - a||^2 / 2
        assert abs(g) > 0.05  # far from 0: float32's estimate has the same sign
        b = 1.0 if g > 0 else -1.0
        out.append([b])
        losses.append(0.5 * float(((x - a) ** 2).sum()) + 0.5 * mu**2 * len(x))
        x = x - eta * (b if with_sign else g) * z
    return out, float(np.mean(losses))


def test_feedsign_each_local_step_starts_from_the_last_minus_eta_sign_z_on_both_tensors():
    """Break caught: a local step taken with the scalar g_k (or without delta) instead of its sign."""
    eta, mu, tau = 0.3, 1e-2, 4
    init, target = [0.5, -1.0, 2.0, 0.25, -0.75], [2.0, 1.0, -1.0, -1.5, 0.5]
    state = ModelState(_Two(init), _feedsign(tau=tau, lr=eta, mu=mu))
    seeds = _seeds((tau, 1), 7)
    zs = [torch.cat([v.reshape(-1) for v in _vs(s, state.params)]) for s in seeds[:, 0]]
    x0, a = torch.tensor(init, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)
    b, loss = _feedsign_local64(x0, a, zs, eta, mu)
    assert len({s[0] for s in b}) == 2  # both signs occur
    _, scalar_loss = _feedsign_local64(x0, a, zs, eta, mu, with_sign=False)
    assert abs(scalar_loss - loss) > 0.1  # the fixture tells the two rules apart
    up = _answer(state, _half_sq(target), [None] * tau, seeds)
    assert up.scalars.tolist() == b
    assert up.loss == pytest.approx(loss, rel=1e-5)


def test_feedsign_global_step_is_minus_eta_times_the_votes_along_each_step_direction():
    """x <- x - eta sum_k v_k z_k on both tensors; a tied step (v = 0) does not move x."""
    eta = 0.25
    init = [0.5, -1.0, 2.0, 0.25, -0.75]
    state = ModelState(_Two(init), _feedsign(tau=3, lr=eta))
    seeds = _seeds((3, 1), 7)
    votes = np.array([[1.0], [0.0], [-1.0]], np.float32)
    state.apply(RoundRecord(0, seeds, votes))
    zs = [torch.cat([v.reshape(-1) for v in _vs(s, state.params)]) for s in seeds[:, 0]]
    expect = torch.tensor(init, dtype=torch.float64) - eta * (zs[0] - zs[2])
    got = torch.cat([p.detach().reshape(-1) for p in state.params]).double()
    assert torch.equal(got, expect)  # eta z is exact in float32 here


def test_feedsign_vote_is_the_sign_of_the_weighted_sum_and_an_exact_tie_is_zero():
    """Weights 1, 2, 3, 6 (integers, as the clients' data sizes are). Breaks caught: an
    unweighted vote (rows 0 and 1 differ), a tie voted +1 or -1 (row 0)."""
    srv = Server(4, 4, 3, 1, seed=0, weights=[1, 2, 3, 6], method=FeedSign())
    plan = srv.plan()
    s = np.array([[1, -1, -1], [1, -1, 1], [1, 1, 1], [-1, 1, -1]], np.float32)  # client x step
    # step 0: 1 + 2 + 3 - 6 = 0 (a tie; 3 of 4 say +); step 1: -1 - 2 + 3 + 6 = 6 (2 against 2);
    # step 2: -1 + 2 + 3 - 6 = -2 (2 against 2)
    rec = srv.aggregate([Uplink(c, plan.round, s[c].reshape(3, 1), 0.0) for c in plan.participants])
    assert rec.scalars.tolist() == [[0.0], [1.0], [-1.0]]
