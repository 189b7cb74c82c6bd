"""Full-model baselines: they learn, FedAvg is GD when it should be, the server optimisers follow
Reddi et al. 2021 number for number, bytes are counted exactly, bad messages fail cleanly, and
the CLI runs them (but cannot rebuild them)."""

import json
import math
import struct

import numpy as np
import pytest
import torch

from hiso.baselines import fedadagrad, fedadam, fedyogi, fedzo_seeds
from hiso.baselines import messages as fm
from hiso.cli import main
from hiso.config import RunConfig
from hiso.core import MessageError, ModelState, Perturber, ZOConfig, local_update
from hiso.core.messages import Uplink
from hiso.core.server import Server
from hiso.runners import fullmodel
from hiso.runners.fullmodel import FullModelSimulation
from hiso.tasks.quadratic import QuadraticTask

BASELINES = ["fedzo", "fedavg", "fedadam", "fedyogi", "fedadagrad"]


def _sim(task, **kw):
    kw = {"clients": task.num_clients, "dim": task.dim, **kw}
    return FullModelSimulation(task, RunConfig(**kw))


def _x(sim):
    return sim.model.x.detach().double().numpy().copy()


@pytest.mark.parametrize("algorithm", BASELINES)
def test_each_baseline_decreases_the_gap(algorithm):
    task = QuadraticTask(6, seed=0, dim=20)
    server_lr = None if algorithm in ("fedavg", "fedzo") else 0.05
    sim = _sim(task, algorithm=algorithm, sampled=3, lr=0.1, server_lr=server_lr, eval_every=30)
    rows = list(sim.run(30))
    assert [r["round"] for r in rows] == list(range(31))
    assert rows[0]["train_loss"] is None and rows[0]["bytes_up"] == 0 and rows[0]["bytes_down"] == 0
    assert [r["round"] for r in rows if "gap" in r] == [0, 30]
    assert rows[-1]["gap"] < 0.7 * rows[0]["gap"]
    assert rows[-1]["wall_s"] > 0 and rows[-1]["bytes_up"] > rows[1]["bytes_up"] > 0


class _Weighted(QuadraticTask):
    """Clients of unequal size, so weighted and plain averaging differ."""

    def client_sizes(self):
        return [1 + 2 * i for i in range(self.num_clients)]


@pytest.mark.parametrize("weighted,server_lr", [(False, None), (False, 0.5), (True, None)])
def test_fedavg_full_participation_one_step_is_gradient_descent(weighted, server_lr):
    M, lr = 5, 0.3
    task = _Weighted(M, seed=3, dim=12)
    sim = _sim(task, algorithm="fedavg", sampled=M, local_steps=1, lr=lr, server_lr=server_lr, weighted=weighted)
    lam, b = task.lam.double().numpy(), task.b.double().numpy()
    w = np.array(task.client_sizes(), float) if weighted else np.ones(M)
    target = (w / w.sum()) @ b  # grad F = lam (x - target) for F = sum_i w_i f_i
    eta = lr * (server_lr or 1.0)
    x = np.zeros(task.dim)
    for _ in range(8):
        sim.step()
        x = x - eta * lam * (x - target)
        np.testing.assert_allclose(_x(sim), x, rtol=1e-5, atol=1e-6)
    assert np.abs(x).max() > 0.1  # it moved: the comparison is not trivial


def test_fedavg_local_steps_are_sgd_steps_on_the_client():
    task = QuadraticTask(1, seed=2, dim=7)
    sim = _sim(task, algorithm="fedavg", sampled=1, local_steps=3, lr=0.2)
    lam, b = task.lam.double().numpy(), task.b[0].double().numpy()
    x = np.zeros(7)
    for _ in range(3):
        sim.step()
        for _ in range(3):
            x = x - 0.2 * lam * (x - b)
        np.testing.assert_allclose(_x(sim), x, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- server optimisers by hand

LR, B1, B2, TAU = 0.1, 0.9, 0.5, 0.1  # beta2 and tau far from defaults so every term shows


def _by_hand(kind, deltas):
    """Reddi et al. 2021 Algorithm 2, coordinate by coordinate in plain floats."""
    n = len(deltas[0])
    x, m, v = [0.0] * n, [0.0] * n, [TAU * TAU] * n
    out = []
    for delta in deltas:
        for j, g in enumerate(delta):
            m[j] = B1 * m[j] + (1 - B1) * g
            if kind == "fedadagrad":
                v[j] = v[j] + g * g
            elif kind == "fedadam":
                v[j] = B2 * v[j] + (1 - B2) * g * g
            else:
                diff = v[j] - g * g
                v[j] = v[j] - (1 - B2) * g * g * ((diff > 0) - (diff < 0))
            x[j] += LR * m[j] / (math.sqrt(v[j]) + TAU)
        out.append(list(x))
    return out


def test_hand_reference_first_round_numbers():
    """Pin the reference itself on round 1 (Delta = 0.5): m = 0.05, v as each rule says."""
    m = 0.05
    v = {"fedadagrad": 0.01 + 0.25, "fedadam": 0.5 * 0.01 + 0.5 * 0.25, "fedyogi": 0.01 + 0.5 * 0.25}
    for kind, vk in v.items():
        assert _by_hand(kind, [[0.5]])[0][0] == pytest.approx(LR * m / (math.sqrt(vk) + TAU), rel=1e-12)
    assert _by_hand("fedadam", [[0.5]])[0][0] == pytest.approx(0.005 / (math.sqrt(0.13) + 0.1), rel=1e-12)


@pytest.mark.parametrize("kind", ["fedadagrad", "fedadam", "fedyogi"])
def test_server_optimiser_matches_hand_computation(kind):
    opt = {"fedadagrad": fedadagrad(LR, B1, TAU), "fedadam": fedadam(LR, B1, B2, TAU),
           "fedyogi": fedyogi(LR, B1, B2, TAU)}[kind]
    deltas = [[0.5, -0.2], [0.05, 0.3], [-0.4, 0.01]]  # two one-value tensors: per-tensor state
    x = [torch.zeros(1), torch.zeros(1)]
    state = first = opt.init(x)
    before = [t.clone() for t in first.m + first.v]
    for want, delta in zip(_by_hand(kind, deltas), deltas):
        step, state = opt.update(state, [torch.tensor([delta[0]]), torch.tensor([delta[1]])])
        x = [xi + si for xi, si in zip(x, step)]
        np.testing.assert_allclose([float(x[0]), float(x[1])], want, rtol=1e-5, atol=1e-9)
    assert all(torch.equal(a, b) for a, b in zip(before, first.m + first.v))  # pure: no in-place updates


@pytest.mark.parametrize("kind", ["fedadagrad", "fedadam", "fedyogi"])
def test_runner_applies_the_adaptive_server_update(kind):
    """Through the runner on a two-parameter quadratic: Delta = -lr grad F (all clients, tau=1)."""
    task = QuadraticTask(3, seed=1, dim=2)
    sim = _sim(task, algorithm=kind, sampled=3, local_steps=1, lr=0.2, server_lr=LR, beta1=B1, beta2=B2,
               server_tau=TAU)
    lam, xs = task.lam.tolist(), task.x_star.tolist()
    x = [0.0, 0.0]
    deltas = []
    for _ in range(3):
        deltas.append([-0.2 * lam[j] * (x[j] - xs[j]) for j in range(2)])
        x = _by_hand(kind, deltas)[-1]
        sim.step()
        np.testing.assert_allclose(_x(sim), x, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- FedZO and sampling

def test_fedzo_clients_use_private_seeds_from_the_round_start():
    task = QuadraticTask(4, seed=0, dim=9)
    cfg = RunConfig(algorithm="fedzo", clients=4, sampled=2, dim=9, local_steps=2, perturbations=3, lr=0.05, seed=7)
    sim = FullModelSimulation(task, cfg)
    sim.step()
    sim.step()  # round 1 starts from a trained model
    x1 = sim.model.x.detach().clone()
    zo = ZOConfig(lr=0.05, mu=cfg.mu, perturbations=3, local_steps=2)
    ref = torch.zeros(9)
    sim.step()
    for cid in sim.participants:
        model = task.build_model()
        model.x.data.copy_(x1)
        st = ModelState(model, zo)
        batches = [task.batch(cid, 2, k, cfg.batch_size) for k in range(2)]
        delta = local_update(st, Perturber(model, st.params), task.loss, batches,
                             fedzo_seeds(7, cid, 2, 2, 3), return_delta=True).delta
        ref += delta[0] / 2
    torch.testing.assert_close(sim.model.x.detach(), x1 + ref, rtol=1e-6, atol=1e-7)
    s = fedzo_seeds(7, 0, 2, 2, 3)
    assert np.array_equal(s, fedzo_seeds(7, 0, 2, 2, 3))
    assert not np.array_equal(s, fedzo_seeds(7, 1, 2, 2, 3)) and not np.array_equal(s, fedzo_seeds(7, 0, 3, 2, 3))


def test_baselines_sample_the_same_clients_as_hiso():
    task = QuadraticTask(10, seed=0, dim=5)
    sim = _sim(task, algorithm="fedadam", sampled=3, seed=11)
    server = Server(10, 3, local_steps=2, perturbations=4, seed=11)
    for _ in range(6):
        sim.step()
        plan = server.plan()
        assert sim.participants == plan.participants
        server.aggregate([Uplink(c, plan.round, np.zeros((2, 4), np.float32)) for c in plan.participants])


# ---------------------------------------------------------------- bytes on the wire

@pytest.mark.parametrize("dtype,bpv", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_bytes_per_client_are_header_plus_d_values(dtype, bpv):
    d, M = 37, 5
    task = QuadraticTask(M, seed=0, dim=d)
    sim = _sim(task, algorithm="fedavg", sampled=2, wire_dtype=dtype)
    times = np.zeros(M, dtype=np.int64)
    rows = list(sim.run(6))
    sampler = np.random.default_rng([0, 0])  # client_sampler(seed=0)
    for _ in range(6):
        times[np.sort(sampler.choice(M, size=2, replace=False))] += 1
    assert times.sum() == 12
    np.testing.assert_array_equal(sim.comm.down, times * (17 + d * bpv))
    np.testing.assert_array_equal(sim.comm.up, times * (25 + d * bpv))
    assert rows[-1]["bytes_up"] == 12 * (25 + d * bpv) and rows[-1]["bytes_down"] == 12 * (17 + d * bpv)


def test_wire_dtypes_round_trip():
    v = torch.tensor([1.0, -2.5, 3.140625, 1e-3, 65504.0, 0.0])
    for dtype, tdt in [("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)]:
        data = fm.encode_uplink(fm.FullUplink(3, 4, v, 0.5), dtype)
        back = fm.decode_uplink(data, expect_round=4, expect_d=6, expect_dtype=dtype)
        assert back.client == 3 and back.round == 4 and back.loss == 0.5 and back.delta.dtype == torch.float32
        assert torch.equal(back.delta, v.to(tdt).float())  # exactly the wire type's rounding
        assert len(data) == fm.uplink_size(6, dtype)
    x = torch.randn(11)
    back = fm.decode_downlink(fm.encode_downlink(fm.FullDownlink(9, x)), expect_round=9, expect_d=11)
    assert back.round == 9 and torch.equal(back.model, x)


# ---------------------------------------------------------------- malformed messages

def _damage(data: bytes, how: str, head: int) -> bytearray:
    b = bytearray(data)
    if how == "truncate":
        return b[:-1]
    if how == "pad":
        return b + b"\0"
    if how == "header":
        return b[:head - 1]
    if how == "magic":
        b[0:2] = b"HS"
    elif how == "version":
        b[2] = 9
    elif how == "kind":
        b[3] = 3
    elif how == "dtype":
        b[4] = 7
    elif how == "length":
        b[head - 8 - (4 if head == 25 else 0):head - (4 if head == 25 else 0)] = (4).to_bytes(8, "little")
    elif how == "nan":
        b[head:head + 4] = struct.pack("<f", float("nan"))
    return b


DAMAGES = ["truncate", "pad", "header", "magic", "version", "kind", "dtype", "length", "nan"]


@pytest.mark.parametrize("how", DAMAGES)
def test_malformed_full_model_messages_raise(how):
    v = torch.arange(5, dtype=torch.float32)
    with pytest.raises(MessageError):
        fm.decode_downlink(bytes(_damage(fm.encode_downlink(fm.FullDownlink(2, v)), how, 17)))
    with pytest.raises(MessageError):
        fm.decode_uplink(bytes(_damage(fm.encode_uplink(fm.FullUplink(1, 2, v, 0.1)), how, 25)))


def test_mismatched_messages_raise():
    v = torch.ones(5)
    down = fm.encode_downlink(fm.FullDownlink(2, v), "bfloat16")
    up = fm.encode_uplink(fm.FullUplink(1, 2, v, 0.1))
    for kw in ({"expect_round": 3}, {"expect_d": 6}, {"expect_dtype": "float32"}):
        with pytest.raises(MessageError):
            fm.decode_downlink(down, **kw)
    for kw in ({"expect_round": 3}, {"expect_d": 4}, {"expect_dtype": "float16"}):
        with pytest.raises(MessageError):
            fm.decode_uplink(up, **kw)
    with pytest.raises(MessageError):
        fm.decode_uplink(fm.encode_uplink(fm.FullUplink(1, 2, v, float("inf"))))
    with pytest.raises(MessageError):  # overflows float16: caught, not applied as inf
        fm.decode_uplink(fm.encode_uplink(fm.FullUplink(1, 2, v * 1e6, 0.1), "float16"))
    with pytest.raises(MessageError):
        fm.decode_downlink("not bytes")


def test_a_bad_uplink_mid_round_changes_nothing(monkeypatch):
    task = QuadraticTask(4, seed=0, dim=6)
    sim = _sim(task, algorithm="fedadam", sampled=3)
    sim.step()
    x, state = sim.model.x.detach().clone(), sim.opt_state
    calls = []
    real = fullmodel.encode_uplink

    def flaky(msg, dtype):
        calls.append(msg.client)
        data = real(msg, dtype)
        return data[:-2] if len(calls) == 2 else data

    monkeypatch.setattr(fullmodel, "encode_uplink", flaky)
    with pytest.raises(MessageError):
        sim.step()
    assert len(calls) == 2 and sim.round == 1
    assert torch.equal(sim.model.x.detach(), x) and sim.opt_state is state


# ---------------------------------------------------------------- the command line

def test_cli_runs_a_baseline_and_refuses_to_rebuild_it(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--algorithm", "fedadam", "--task", "quadratic", "--dim", "30",
                 "--clients", "6", "--sampled", "2", "--rounds", "12", "--eval-every", "5", "--quiet",
                 "--wire-dtype", "bfloat16"])
    assert code == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "metrics.jsonl", "summary.json", "model.pt"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["algorithm"] == "fedadam" and cfg["method_opts"]["wire_dtype"] == "bfloat16"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "gap" in r] == [0, 5, 10, 12]
    summary = json.loads((out / "summary.json").read_text())
    comm = summary["communication_per_client"]
    assert comm["bytes_up_mean"] * 6 == rows[-1]["bytes_up"] == 12 * 2 * (25 + 30 * 2)
    state = torch.load(out / "model.pt")
    assert state["round"] == 12 and not torch.equal(state["model"]["x"], torch.zeros(30))
    capsys.readouterr()
    code = main(["rebuild", str(out), "--out", str(tmp_path / "m.pt")])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("hiso: error:") and "fedadam" in err
    assert not (tmp_path / "m.pt").exists()
