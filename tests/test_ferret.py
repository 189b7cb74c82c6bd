"""Ferret: first-order local steps, the update projected on K seeded directions per block."""

import pytest
import torch

from hiso.config import load_config
from hiso.core.directions import direction
from hiso.core.seeds import round_seeds
from hiso.methods.ferret import blocks_of
from hiso.runners.simulate import Simulation

from conftest import TinyTask
from seed_method_checks import LinearTask, assert_run_refused, assert_same_model, late_client


def _zo(**kw):
    return load_config(None, algorithm="ferret", task="quadratic", **kw).zo()


_C = [(1.0, 0.0), (-1.0, -2.0)]  # the gradient is c_i: one SGD step from 0 moves by exactly -lr c_i


def test_two_rounds_worked_by_hand():
    # run seed 0, B = 1, K = 2: round 0's directions are (-1, -1) twice; round 1's (1, -1), (1, 1)
    v = [[direction(int(s), [torch.Size([1, 2])])[0].flatten().tolist() for s in round_seeds(0, r, 0, 1, 2)[0]]
         for r in range(2)]
    assert v == [[[-1.0, -1.0], [-1.0, -1.0]], [[1.0, -1.0], [1.0, 1.0]]]
    zo = _zo(clients=2, sampled=2, lr=0.5, ferret_k=2, ferret_blocks=1)
    assert zo.shape == (1, 2) and zo.method.steps == 1 and zo.method.resolved_server_lr == 1.0
    sim = Simulation(LinearTask(_C), zo, clients_per_round=2, seed=0, mode="faithful", eval_every=100)
    # Delta_0 = 0.5 (1, 0), Delta_1 = 0.5 (-1, -2); round 0: projections on (-1, -1): -0.5 and 1.5,
    # mean 0.5 (both k); x_1 = 0 - (1/2)(0.5 v + 0.5 v) = (0.5, 0.5)
    r0, _ = sim.step()
    assert r0.scalars.tolist() == [[0.5, 0.5]] and sim.state.params[0].tolist() == [[0.5, 0.5]]
    # round 1 (the gradient does not depend on w): mean Delta = (0, -0.5); projections on (1, -1)
    # and (1, 1): 0.5 and -0.5; x_2 = x_1 - (1/2)(0.5 (1, -1) - 0.5 (1, 1)) = (0.5, 1.0)
    r1, _ = sim.step()
    assert r1.scalars.tolist() == [[0.5, -0.5]] and sim.state.params[0].tolist() == [[0.5, 1.0]]
    # each client holds x_1 again after its local steps of round 1 (no trace of its own SGD steps)
    assert all(c.state.round == 1 and c.state.params[0].tolist() == [[0.5, 0.5]] for c in sim.clients.values())


def test_blocks_are_contiguous_groups_by_size():
    shapes = [torch.zeros(6), torch.zeros(2), torch.zeros(8)]  # starts 0, 6, 8 of d = 16
    assert blocks_of(shapes, 2) == [0, 0, 1] and blocks_of(shapes, 1) == [0, 0, 0]
    assert blocks_of(shapes, 4) == [0, 1, 2]


def test_replicas_and_a_client_that_skipped_every_round_match_bit_for_bit():
    zo = _zo(local_steps=2, ferret_k=4, ferret_blocks=3, lr=0.05)
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    rows = list(sim.run(60))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, zo).state])
    assert not torch.equal(sim.state.params[0], task.build_model()[0].weight)


BLACK_BOX = '''
import torch
from torch import nn
from hiso.tasks.base import Task


class Box(Task):
    differentiable = False
    default_lr = {"zo": 0.01, "first-order": 0.01}

    def build_model(self):
        return nn.Linear(2, 1)

    def batch(self, client, round, step, batch_size):
        return None

    def loss(self, model, batch):
        with torch.no_grad():
            return model.weight.sum()

    def evaluate(self, model):
        return {"eval_loss": 0.0}
'''


@pytest.mark.parametrize("flags, msg", [
    (["--ferret-k", "0"], "ferret_k >= 1"),
    (["--ferret-k", "8193", "--ferret-blocks", "8"], "more than the format allows"),
    (["--task", "BOX"], "has no gradients"),
])
def test_bad_settings_fail_with_one_line(tmp_path, capsys, flags, msg):
    box = tmp_path / "box.py"
    box.write_text(BLACK_BOX)
    flags = [f"{box}:Box" if f == "BOX" else f for f in flags]
    assert_run_refused(tmp_path, capsys, ["--algorithm", "ferret", "--task", "quadratic", "--rounds", "2", "--quiet",
                                          *flags], msg)
