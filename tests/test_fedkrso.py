"""FedKRSO: first-order local steps restricted to K seeded directions per block, their
coefficients (accumulators) uploaded, Ferret's fold on every replica."""

import json

import numpy as np
import pytest
import torch

from hiso.config import load_config
from hiso.core import ModelState
from hiso.core.directions import direction
from hiso.core.seeds import round_seeds
from hiso.methods import fedkrso, ferret
from hiso.methods.ferret import blocks_of
from hiso.runners.simulate import Simulation

from cli_helpers import run_cli
from conftest import TinyTask
from seed_method_checks import LinearTask, skippers_match


def _zo(**kw):
    return load_config(None, algorithm="fedkrso", task="quadratic", **kw).zo()


class QuadTask(LinearTask):
    """f_i(w) = |w - c_i|^2 / 2 on a 1 x 2 weight from w = 0: the gradient is w - c_i, so a local
    step's numbers depend on where the previous steps went (unlike a linear loss)."""

    def loss(self, model, batch):
        return 0.5 * ((model.weight - batch) ** 2).sum()


_C = [(1.0, 0.0), (-1.0, -2.0)]


def test_a_round_of_two_subspace_steps_worked_by_hand():
    # run seed 0, B = 1, K = 2: round 0's two directions are both v = (-1, -1) (test_ferret's), so
    # the subspace is the line through (1, 1) and a step is x <- x - lr (1/2) sum_k <g, v> v
    v = [direction(int(s), [torch.Size([1, 2])])[0].flatten().tolist() for s in round_seeds(0, 0, 0, 1, 2)[0]]
    assert v == [[-1.0, -1.0], [-1.0, -1.0]]
    zo = _zo(clients=2, sampled=2, lr=0.25, local_steps=2, ferret_k=2, ferret_blocks=1)
    assert zo.shape == (1, 2) and zo.method.steps == 2 and zo.method.resolved_server_lr == 1.0
    task = QuadTask(_C)
    seeds = round_seeds(0, 0, 0, 1, 2)
    # client 0, c = (1, 0): g_0 = (-1, 0), <g_0, v> = 1, a = 0.25 (each k); x = -(1/2) 2 (0.25) v =
    # (0.25, 0.25); g_1 = (-0.75, 0.25), <g_1, v> = 0.5, a = 0.25 + 0.25 (0.5) = 0.375; the losses
    # there are 0.5 and 0.3125, their mean is reported
    state = ModelState(task.build_model(), zo)
    res = fedkrso.local_update(state, task.loss, [task.batch(0, 0, t, 1) for t in range(2)], seeds)
    assert res.scalars.tolist() == [[0.375, 0.375]] and res.loss == (0.5 + 0.3125) / 2
    assert state.params[0].tolist() == [[0.0, 0.0]]  # x_r again
    # Ferret's unrestricted steps go to (0.25, 0), then (0.4375, 0): it sends <x_r - x_2, v> = 0.4375
    assert ferret.local_update(state, task.loss, [task.batch(0, 0, t, 1) for t in range(2)],
                               seeds).scalars.tolist() == [[0.4375, 0.4375]]
    # client 1, c = (-1, -2): g_0 = (1, 2), <g_0, v> = -3, a = -0.75, x = (-0.75, -0.75);
    # g_1 = (0.25, 1.25), <g_1, v> = -1.5, a = -1.125. The mean -0.375 is logged and x_1 =
    # -(1/2) 2 (-0.375) v = (-0.375, -0.375), the mean of the clients' local models (0.375, 0.375)
    # and (-1.125, -1.125)
    sim = Simulation(task, zo, clients_per_round=2, seed=0, mode="faithful", eval_every=100)
    r0, _ = sim.step()
    assert r0.scalars.tolist() == [[-0.375, -0.375]] and sim.state.params[0].tolist() == [[-0.375, -0.375]]
    sim.step()  # each client holds the round's x again after its own local steps
    assert all(c.state.round == 1 and c.state.params[0].tolist() == [[-0.375, -0.375]] for c in sim.clients.values())


def _reference(task, zo, seeds, batches, lr):
    """Subspace SGD in float64 with the directions as explicit matrices: per block b, V_b (K x d_b),
    x <- x - lr (1/K) V_b^T V_b g; the accumulators a_b = lr sum_t V_b g_t."""
    model = task.build_model()
    params = [p for p in model.parameters()]
    shapes = [p.shape for p in params]
    B, K = zo.shape
    blocks = blocks_of(params, B)
    dirs = [direction(int(s), shapes) for s in seeds.reshape(-1)]  # seed (b, k) at b K + k
    V = [torch.stack([torch.cat([dirs[b * K + k][i].reshape(-1).double() for i in range(len(params))
                                 if blocks[i] == b] or [torch.zeros(0, dtype=torch.float64)]) for k in range(K)])
         for b in range(B)]
    x0 = [p.detach().double().clone() for p in params]
    acc = np.zeros((B, K))
    for batch in batches:
        with torch.no_grad():  # x = x_r - (1/K) sum_k a_k v_k, block by block
            for b in range(B):
                step = (V[b].T @ torch.from_numpy(acc[b])) / K
                idx = [i for i in range(len(params)) if blocks[i] == b]
                flat = torch.cat([x0[i].reshape(-1) for i in idx]) - step if idx else step
                start = 0
                for i in idx:
                    n = params[i].numel()
                    params[i].copy_(flat[start:start + n].reshape(params[i].shape).float())
                    start += n
        grads = torch.autograd.grad(task.loss(model, batch), params)
        for b in range(B):
            g = torch.cat([grads[i].reshape(-1).double() for i in range(len(params)) if blocks[i] == b]
                          or [torch.zeros(0, dtype=torch.float64)])
            acc[b] += lr * (V[b] @ g).numpy()
    return acc


@pytest.mark.parametrize("steps", [1, 4])
def test_the_accumulators_are_subspace_sgd_with_explicit_direction_matrices(steps):
    zo = _zo(lr=0.1, local_steps=steps, ferret_k=5, ferret_blocks=3)
    task = TinyTask(num_clients=2)
    seeds = round_seeds(3, 0, 0, 3, 5)
    batches = [task.batch(0, 0, t, 8) for t in range(steps)]
    state = ModelState(task.build_model(), zo)
    got = fedkrso.local_update(state, task.loss, batches, seeds).scalars
    assert set(blocks_of(state.params, 3)) == {0, 1, 2}  # every block holds tensors (8 of them)
    np.testing.assert_allclose(got, _reference(task, zo, seeds, batches, 0.1), rtol=1e-4, atol=1e-6)
    # one step: Ferret's numbers (the same eta <g, v>); from two steps on, Ferret's leave the span
    theirs = ferret.local_update(state, task.loss, batches, seeds).scalars
    assert np.allclose(got, theirs, rtol=1e-4, atol=1e-6) == (steps == 1)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_replicas_and_clients_that_skipped_many_rounds_match_bit_for_bit(dtype):
    sim = skippers_match(_zo(local_steps=2, ferret_k=4, ferret_blocks=3, lr=0.05, scalar_dtype=dtype))
    assert not torch.equal(sim.state.params[0], sim.task.build_model()[0].weight)


RUN = ["--task", "quadratic", "--dim", "30", "--clients", "5", "--sampled", "2", "--lr", "0.05", "--eval-every", "2",
       "--threads", "1", "--algorithm", "fedkrso", "--ferret-k", "16", "--ferret-blocks", "2", "--local-steps", "3"]


def _model(path):
    return torch.load(path, weights_only=False)


def test_rebuild_and_resume_are_bit_for_bit_and_the_uplink_is_k_scalars_a_block(tmp_path, capsys):
    from seed_method_checks import resumed_and_rebuilt
    full = tmp_path / "full"
    a, b, rebuilt = resumed_and_rebuilt(RUN, tmp_path, capsys)
    assert a["round"] == 8 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["model"][k], rebuilt["model"][k]) for k in a["model"])
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert losses[-1] < losses[0]
    # per answer: header 6, B K = 32 float32 accumulators, the float32 loss; plus each client's 4-byte hello
    comm = json.loads((full / "summary.json").read_text())["communication_per_client"]
    assert rows[-1]["client_answers"] == 16 and comm["bytes_up_mean"] * 5 == 5 * 4 + 16 * (6 + 32 * 4 + 4)


def test_runs_on_lora_adapters_and_rebuilds_bit_for_bit(tmp_path, capsys):
    pytest.importorskip("transformers")
    from lm_fixtures import write_sst2, write_tiny_lm
    lm, sst2 = write_tiny_lm(tmp_path / "lm"), write_sst2(tmp_path / "sst2")
    out = tmp_path / "run"
    code, _, err = run_cli(["run", "--out", str(out), "--algorithm", "fedkrso", "--task", "sst2", "--model", str(lm),
                            "--data-dir", str(sst2), "--label-words", " terrible, great", "--clients", "3",
                            "--sampled", "2", "--rounds", "3", "--min-size", "2", "--lr", "0.05", "--batch-size", "4",
                            "--lora-r", "2", "--ferret-k", "4", "--ferret-blocks", "2", "--local-steps", "2",
                            "--eval-every", "3", "--threads", "1", "--quiet"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = _model(out / "model.pt"), _model(tmp_path / "rb.pt")
    assert a["model"] and all("lora_" in k for k in a["model"])  # the adapters only
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert sum(float(v.abs().sum()) for k, v in a["model"].items() if "lora_B" in k) > 0  # lora_B starts at 0


def test_the_flower_serverapp_runs_it_as_the_simulator_does(tmp_path, monkeypatch):
    from seed_method_checks import assert_serverapp_runs_it_as_the_simulator
    assert_serverapp_runs_it_as_the_simulator({"algorithm": "fedkrso", "ferret_k": 8, "ferret_blocks": 2,
                                               "local_steps": 2}, tmp_path, monkeypatch)


def test_a_ferret_peer_cannot_join_a_fedkrso_run():
    # the same options, another rule: the join fingerprint names the method's class
    from hiso.core.join import config_blob, config_fingerprint
    krso, fer = (load_config(None, algorithm=a, local_steps=2).zo() for a in ("fedkrso", "ferret"))
    assert json.loads(config_blob(krso))["method"]["class"] == "hiso.methods.fedkrso.FedKRSOConfig"
    assert config_fingerprint(krso) != config_fingerprint(fer)
