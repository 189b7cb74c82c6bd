"""ConMeZO: directions in a cone around the replicated momentum m, kept by every replica from the log."""

import json
import math

import numpy as np
import pytest
import torch

from hiso.config import load_config
from hiso.core import Client, Downlink, ModelState, decode_downlink, encode_downlink
from hiso.core.messages import encode_state
from hiso.core.directions import direction
from hiso.core.history import read_history
from hiso.core.seeds import round_seeds
from hiso.methods import conmezo
from hiso.runners.simulate import Simulation

from cli_helpers import run_cli
from conftest import TinyTask
from seed_method_checks import LinearTask, assert_run_refused, assert_same_model, late_client


def _zo(lr=0.05, **kw):
    opts = kw.pop("method_opts", {})
    return load_config(None, algorithm="conmezo", task="quadratic", lr=lr, method_opts=opts, **kw).zo()


def _m(state) -> list[torch.Tensor]:
    return state.slots[conmezo.SLOT]


# ---------------------------------------------------------------- known answer: two rounds by hand

_C = [(1.0, 0.0), (0.0, 2.0)]  # f_i(w) = c_i . w: the derivative along any z is c_i . z


@pytest.mark.parametrize("difference", ["forward", "central"])
def test_two_rounds_worked_by_hand(difference):
    theta, beta, lr, mu = 1.0, 0.75, 0.1, 1e-3
    zo = _zo(lr=lr, perturbations=1, mu=mu, difference=difference, method_opts={"theta": theta, "beta": beta})
    sim = Simulation(LinearTask(_C), zo, clients_per_round=2, seed=0, mode="faithful", eval_every=100)
    u = [direction(int(round_seeds(0, r, 0, 1, 1)[0, 0]), [torch.Size([1, 2])])[0].reshape(-1).double().numpy()
         for r in range(2)]
    cbar = np.mean(_C, axis=0)  # the round's mean scalar is cbar . z (both clients answer)
    # round 0, m = 0: a plain direction z_0 = u_0, then m_1 = (1 - beta) g_0 z_0
    g0 = cbar @ u[0]
    w1, m1 = -lr * g0 * u[0], (1 - beta) * g0 * u[0]
    # round 1: z_1 = cos(theta) sqrt(d) m_1 / |m_1| + sin(theta) u_1, d = 2
    z1 = math.cos(theta) * math.sqrt(2) * m1 / np.linalg.norm(m1) + math.sin(theta) * u[1]
    g1 = cbar @ z1
    w2, m2 = w1 - lr * g1 * z1, beta * m1 + (1 - beta) * g1 * z1
    r0, _ = sim.step()
    assert r0.scalars[0, 0] == pytest.approx(g0, rel=1e-5)
    assert _m(sim.state)[0].reshape(-1).tolist() == pytest.approx(m1.tolist(), rel=1e-5)
    r1, _ = sim.step()
    # the clients measured the derivative along the cone's z_1, not along u_1
    assert r1.scalars[0, 0] == pytest.approx(g1, rel=1e-4) and abs(g1 - cbar @ u[1]) > 0.1
    assert sim.state.params[0].reshape(-1).tolist() == pytest.approx(w2.tolist(), rel=1e-4)
    assert _m(sim.state)[0].reshape(-1).tolist() == pytest.approx(m2.tolist(), rel=1e-4)
    assert all(torch.equal(c.state.params[0], sim.state.params[0]) for c in sim.clients.values() if c.state.round == 2)


class _QuadraticTask(LinearTask):
    """f_i(w) = |w - a_i|^2 / 2 on a 1 x 2 weight from w = 0, a_i = ``C[i]``: a derivative along z
    depends on where it is taken, so a client's local steps (tau > 1) change its later scalars."""

    def loss(self, model, batch):
        return 0.5 * ((model(torch.eye(2)).reshape(-1) - batch.reshape(-1)) ** 2).sum()  # (w through the forward)


def _reference_rounds(A, rounds, tau, P, lr, mu, theta, beta, difference):
    """ConMeZO worked in float64 from its definition (the module docstring), no hiso code but the
    run's seeds and directions: each client's tau local steps along the cone's z, the server's
    fold of the mean scalars, m the EMA of the round's update direction summed over its steps.
    Returns each round's (mean scalars, x, m)."""
    def f(w, a):
        return 0.5 * float(np.sum((w - a) ** 2))

    def deriv(w, a, z):
        if difference == "central":
            return (f(w + mu * z, a) - f(w - mu * z, a)) / (2 * mu)
        return (f(w + mu * z, a) - f(w, a)) / mu

    x, m, out = np.zeros(2), np.zeros(2), []
    for r in range(rounds):
        seeds = round_seeds(0, r, 0, tau, P)
        u = [[direction(int(seeds[k, p]), [torch.Size([1, 2])])[0].reshape(-1).double().numpy() for p in range(P)]
             for k in range(tau)]
        nm = np.linalg.norm(m)
        z = [[u[k][p] if nm == 0 else math.cos(theta) * math.sqrt(2) * m / nm + math.sin(theta) * u[k][p]
              for p in range(P)] for k in range(tau)]
        g = np.zeros((len(A), tau, P))
        for i, a in enumerate(A):
            y = x.copy()
            for k in range(tau):
                g[i, k] = [deriv(y, np.array(a, float), z[k][p]) for p in range(P)]
                y = y - lr * sum(g[i, k, p] * z[k][p] for p in range(P)) / P
        gbar = g.mean(axis=0)
        ghat = sum(gbar[k, p] * z[k][p] for k in range(tau) for p in range(P)) / P
        x, m = x - lr * ghat, beta * m + (1 - beta) * ghat
        out.append((gbar, x.copy(), m.copy()))
    return out


@pytest.mark.parametrize("difference", ["forward", "central"])
def test_local_steps_in_the_cone_against_a_reference_worked_in_float64(difference):
    """tau = 2, P = 2, three rounds: every local step's direction is in the cone of the round's m,
    a client's second step is measured where its first left it, and m takes the round's update
    summed over its steps. Replicas agreeing cannot show this (they share the code)."""
    A, theta, beta, lr, mu = [(1.0, -2.0), (3.0, 1.0)], 1.1, 0.6, 0.1, 0.05
    zo = _zo(lr=lr, perturbations=2, local_steps=2, mu=mu, difference=difference,
             method_opts={"theta": theta, "beta": beta})
    sim = Simulation(_QuadraticTask(A), zo, clients_per_round=2, seed=0, mode="faithful", eval_every=100)
    want = _reference_rounds(A, 3, 2, 2, lr, mu, theta, beta, difference)
    for r, (gbar, x, m) in enumerate(want):
        rec, _ = sim.step()
        assert rec.scalars.astype(np.float64) == pytest.approx(gbar, rel=2e-4, abs=1e-5), r
        assert sim.state.params[0].reshape(-1).tolist() == pytest.approx(x.tolist(), rel=2e-4, abs=1e-6), r
        assert _m(sim.state)[0].reshape(-1).tolist() == pytest.approx(m.tolist(), rel=2e-4, abs=1e-6), r


def test_the_normalised_step_divides_the_rounds_lr_by_the_scalars_spread():
    # --step-norm std (beta 0.9): sigma_r = sqrt(v / w) over the rounds' mean squares; one direction
    # a round, so round 0's sigma is |g_0| and round 1's sqrt((0.9 * 0.1 g0^2 + 0.1 g1^2) / 0.19)
    theta, beta, lr, mu = 1.0, 0.75, 0.1, 1e-3
    zo = _zo(lr=lr, perturbations=1, mu=mu, step_norm="std", method_opts={"theta": theta, "beta": beta})
    sim = Simulation(LinearTask(_C), zo, clients_per_round=2, seed=0, mode="faithful", eval_every=100)
    u = [direction(int(round_seeds(0, r, 0, 1, 1)[0, 0]), [torch.Size([1, 2])])[0].reshape(-1).double().numpy()
         for r in range(2)]
    cbar = np.mean(_C, axis=0)
    g0 = cbar @ u[0]
    s0 = abs(g0)
    w1, m1 = -lr / s0 * g0 * u[0], (1 - beta) * g0 * u[0]
    z1 = math.cos(theta) * math.sqrt(2) * m1 / np.linalg.norm(m1) + math.sin(theta) * u[1]
    g1 = cbar @ z1
    s1 = math.sqrt((0.9 * 0.1 * g0 ** 2 + 0.1 * g1 ** 2) / 0.19)
    w2, m2 = w1 - lr / s1 * g1 * z1, beta * m1 + (1 - beta) * g1 * z1  # m takes ghat, not the scaled step
    sim.step()
    assert sim.state.params[0].reshape(-1).tolist() == pytest.approx(w1.tolist(), rel=1e-5)
    sim.step()
    assert sim.state.params[0].reshape(-1).tolist() == pytest.approx(w2.tolist(), rel=1e-4)
    assert _m(sim.state)[0].reshape(-1).tolist() == pytest.approx(m2.tolist(), rel=1e-4)
    assert sim.state.slots["step_norm"][1].item() == pytest.approx(0.19)  # (v, w) kept by the replica


def test_the_cone_direction_has_its_axis_share_and_the_norm_of_u():
    # d = 10,000: z = c m + b u with |z|^2 ~ d and <z, m/|m|> = cos(theta) sqrt(d) + sin(theta) <u, m/|m|>
    m = [torch.linspace(-1, 1, 6000).reshape(60, 100), torch.ones(4000)]
    d, theta = 10_000, 1.2
    c = conmezo.axis_scale(m, theta)  # the helpers a replica and a client share
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in m))
    assert c == pytest.approx(math.cos(theta) * math.sqrt(d) / norm)
    assert conmezo.axis_scale([torch.zeros(3)], theta) is None
    from hiso.core.directions import DirectionGenerator
    g = DirectionGenerator()
    z = [conmezo.cone_combine(g, i, t, np.array([7], np.uint64), np.array([1.0], np.float32), t, c,
                              math.sin(theta)).clone() for i, t in enumerate(m)]
    flat, mhat = torch.cat([t.reshape(-1) for t in z]).double(), torch.cat([t.reshape(-1) for t in m]).double()
    mhat = mhat / mhat.norm()
    along = float(flat @ mhat)
    assert abs(along - math.cos(theta) * math.sqrt(d)) < 4 * math.sin(theta)  # u's share along m is N(0, 1)-sized
    assert float(flat.norm() ** 2) == pytest.approx(d, rel=0.05)


# ---------------------------------------------------------------- exact replicas, late clients, snapshots

def snapshot_client(sim, task, zo) -> Client:
    """A client that took part in no round, brought to the server's round by a snapshot downlink
    (through the bytes): x and m from the snapshot alone."""
    r = sim.server.round
    late = Client(99, ModelState(task.build_model(), zo), task.loss, lambda r, k: None)
    wire = late.join(sim.welcome)
    data = encode_downlink(Downlink(r, wire.seeds(r), r, (), 0, encode_state(sim.state)), wire)
    late.catch_up(decode_downlink(data, wire))
    return late


@pytest.mark.parametrize("local_steps, snapshot_after, extra", [
    (1, 1000, {}), (2, 1000, {}), (1, 4, {}),
    (1, 1000, {"step_norm": "std", "scalar_dtype": "int4", "lr": 0.01}),  # the many-direction low-bit step
    (1, 4, {"step_norm": "std", "scalar_dtype": "int4", "lr": 0.01})])
def test_replicas_and_clients_that_skipped_many_rounds_match_bit_for_bit(local_steps, snapshot_after, extra):
    zo = _zo(**({"lr": 0.02, "local_steps": local_steps, "perturbations": 3} | extra))
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=snapshot_after)
    rows = list(sim.run(60))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert max(sim.server.round - c.state.round for c in sim.clients.values()) > 10  # some skipped many rounds
    assert all(bool(t.abs().sum() > 0) for t in _m(sim.state))
    sim.sync_all()
    late = late_client(sim, task, zo) if snapshot_after > 60 else snapshot_client(sim, task, zo)
    replicas = [c.state for c in sim.clients.values()] + [late.state]
    assert_same_model(sim.state, replicas)
    for s in replicas:  # m too (and step_norm's (v, w)): the next round's cone and step agree everywhere
        assert all(torch.equal(a, b) for a, b in zip(_m(s), _m(sim.state)))
        if "step_norm" in extra:
            assert torch.equal(s.slots["step_norm"], sim.state.slots["step_norm"])


# ---------------------------------------------------------------- the command line: rebuild, resume, refusals

RUN = ["--task", "quadratic", "--dim", "30", "--clients", "5", "--sampled", "2", "--lr", "0.05",
       "--eval-every", "2", "--threads", "1", "--algorithm", "conmezo", "--method-opt", "theta=1.3"]


def _model(path):
    return torch.load(path, weights_only=False)


def _same(a, b) -> bool:
    return a["round"] == b["round"] and all(torch.equal(a[part][k], b[part][k]) for part in ("model", "cone")
                                            for k in a[part])


def test_rebuild_and_resume_are_bit_for_bit(tmp_path, capsys):
    from seed_method_checks import resumed_and_rebuilt
    full = tmp_path / "full"
    a, resumed, rebuilt = resumed_and_rebuilt(RUN, tmp_path, capsys)
    assert set(a) == {"round", "model", "cone"} and _same(a, resumed)
    assert _same(a, rebuilt)
    cfg = json.loads((full / "config.json").read_text())
    assert cfg["algorithm"] == "conmezo" and cfg["method_opts"] == {"theta": 1.3}
    # theta is the run's: another value gives another log
    code, _, err = run_cli(["run", "--quiet", *RUN, "--method-opt", "theta=0.5", "--rounds", "8",
                            "--out", str(tmp_path / "other")], capsys)
    assert code == 0, err
    assert (tmp_path / "other" / "history.bin").read_bytes() != (full / "history.bin").read_bytes()


def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_run(tmp_path, capsys):
    import contextlib
    import io

    from crash_harness import Crash
    from hiso.cli import main
    args = [*RUN, "--checkpoint-every", "2", "--quiet"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    code, _, err = run_cli(["run", *args, "--rounds", "6", "--out", str(full)], capsys)
    assert code == 0, err
    with Crash(cut, 16) as crash, contextlib.suppress(BaseException), \
            contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        main(["run", *args, "--rounds", "6", "--out", str(cut)])
    assert crash.dead, "the run finished before the kill: kill it earlier"
    code, _, err = run_cli(["run", "--quiet", "--resume", str(cut)], capsys)
    assert code == 0, err
    assert (cut / "history.bin").read_bytes() == (full / "history.bin").read_bytes()
    assert _same(_model(cut / "model.pt"), _model(full / "model.pt"))


def test_the_cone_is_perturbed_alike_in_every_perturb_mode(tmp_path, capsys):
    # the cone's axis rides as the shifted points' delta: hooks and swap give the same scalars, batched
    # (one stacked forward) the same up to the rounding of a differently shaped product
    logs = {}
    for mode in ("hooks", "swap", "batched"):
        code, _, err = run_cli(["run", "--quiet", *RUN, "--rounds", "6", "--difference", "central",
                                "--perturb-mode", mode, "--out", str(tmp_path / mode)], capsys)
        assert code == 0, err
        logs[mode] = np.stack([r.scalars for r in read_history(tmp_path / mode / "history.bin")[2]])
    assert np.abs(logs["hooks"]).max() > 1 and np.array_equal(logs["hooks"], logs["swap"])
    assert np.allclose(logs["batched"], logs["hooks"], rtol=1e-3, atol=1e-3)


def test_faults_attackers_and_a_robust_rule_fold_like_any_record(tmp_path, capsys):
    # what it declares (faults, robust, weighted, int8): lost, late, duplicated and damaged answers and a
    # lying client change which records the server logs, never how a replica folds them
    d = tmp_path / "f"
    code, _, err = run_cli(["run", "--quiet", *RUN, "--clients", "8", "--sampled", "4", "--rounds", "10",
                            "--drop-rate", "0.2", "--late-rate", "0.1", "--duplicate-rate", "0.1",
                            "--corrupt-rate", "0.1",
                            "--byzantine", "1", "--attack", "scale", "--aggregate", "trimmed-mean", "--trim", "0.25",
                            "--weighted", "--scalar-dtype", "int8", "--lr", "0.01", "--out", str(d)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["rebuild", str(d), "--out", str(tmp_path / "re.pt")], capsys)
    assert code == 0, err
    assert _same(_model(d / "model.pt"), _model(tmp_path / "re.pt"))
    assert json.loads((d / "config.json").read_text())["aggregate"] == "trimmed-mean"


def test_the_uplink_is_p_scalars(tmp_path, capsys):
    from seed_method_checks import uplink_bytes_of_three_rounds
    up = uplink_bytes_of_three_rounds(RUN, tmp_path, capsys)
    # the hello (4 bytes), then 3 uplinks: header 6, P = 5 float32 scalars, the float32 loss: DeComFL's
    assert up == 4 + 3 * (6 + 5 * 4 + 4)


def test_a_clients_resident_memory_counts_m(tmp_path, capsys):
    resident = {}
    for alg in ("decomfl", "conmezo"):
        code, _, err = run_cli(["run", "--quiet", *RUN[:-4], "--algorithm", alg, "--rounds", "2",
                                "--out", str(tmp_path / alg)], capsys)
        assert code == 0, err
        summary = json.loads((tmp_path / alg / "summary.json").read_text())
        resident[alg], d = summary["client"]["resident_bytes"], summary["parameters"]
    assert resident["conmezo"] - resident["decomfl"] == 4 * d  # m: a float32 per trainable value


def test_the_flower_serverapp_runs_it_as_the_simulator_does(tmp_path, monkeypatch):
    from seed_method_checks import assert_serverapp_runs_it_as_the_simulator
    assert_serverapp_runs_it_as_the_simulator({"algorithm": "conmezo", "method_opts": {"theta": "1.2", "beta": "0.5"}},
                                             tmp_path, monkeypatch)


@pytest.mark.slow
def test_hiso_flower_deploys_it_as_hiso_run_runs_it(tmp_path, capsys):
    """``hiso flower``: a SuperLink and two SuperNodes as processes; the run is ``hiso run``'s, bit for bit."""
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from seed_method_checks import flower_and_run
    assert _same(*flower_and_run(RUN, tmp_path, capsys))


@pytest.mark.parametrize("flags, msg", [
    (["--method-opt", "theta=2"], "conmezo: theta must be in (0, pi/2] radians, got 2.0"),
    (["--method-opt", "beta=1"], "conmezo: beta must be in [0, 1), got 1.0"),
    (["--method-opt", "gamma=1"], "no such option (its options: theta, beta)"),
    (["--momentum", "0.9"], "momentum is for hiso, decomfl and greedy, not conmezo"),
])
def test_bad_settings_fail_with_one_line(tmp_path, capsys, flags, msg):
    assert_run_refused(tmp_path, capsys, ["--task", "quadratic", "--algorithm", "conmezo", *flags], msg)
