"""Checks the seed-based methods' tests share (FeedSign, FedKSeed, Ferret, FedKRSO, ConMeZO, greedy):
the linear task their two rounds by hand run on, every replica holding the server's model bit for
bit, a client that skipped every round catching up to it, a bad setting refused with one line,
nothing written, and a run resumed, rebuilt and deployed over Flower as `hiso run` ran it."""

import torch
from torch import nn

from hiso.core import Client, Downlink, ModelState, decode_downlink, encode_downlink
from hiso.tasks.base import Task

from cli_helpers import run_cli


class LinearTask(Task):
    """f_i(w) = c_i . w on a 1 x 2 weight from w = 0, client i's c_i = ``C[i]``: the gradient is c_i
    and the derivative along z is c_i . z exactly, so every number of a round can be worked by hand."""

    def __init__(self, C):
        super().__init__(len(C))
        self.C = C

    def build_model(self):
        m = nn.Linear(2, 1, bias=False)
        nn.init.zeros_(m.weight)
        return m

    def batch(self, client, round, step, batch_size):
        return torch.tensor([self.C[client]])

    def loss(self, model, batch):
        return model(batch).sum()

    def evaluate(self, model):
        return {"eval_loss": 0.0}


def assert_same_model(server_state, states) -> None:
    """Each replica's trainable tensors equal the server's, bit for bit."""
    for s in states:
        assert all(torch.equal(a, b) for a, b in zip(s.params, server_state.params))


def late_client(sim, task, zo) -> Client:
    """A client that took part in no round: it joins, replays the server's whole history from one
    downlink (through the bytes), and is returned."""
    r = sim.server.round
    late = Client(99, ModelState(task.build_model(), zo), task.loss, lambda r, k: None)
    wire = late.join(sim.welcome)
    data = encode_downlink(Downlink(r, wire.seeds(r), 0, tuple(sim.server.history)), wire)
    late.catch_up(decode_downlink(data, wire, expect_since=0))
    return late


def skippers_match(zo, rounds: int = 60):
    """60 rounds of ``zo`` on 20 tiny clients, 3 a round: the loss fell, some clients skipped more
    than 10 rounds, and after catching up every client and a late joiner hold the server's model bit
    for bit. Returns the simulation."""
    from conftest import TinyTask
    from hiso.runners.simulate import Simulation
    task = TinyTask(num_clients=20)
    sim = Simulation(task, zo, clients_per_round=3, seed=1, batch_size=8, mode="faithful", eval_every=1000,
                     snapshot_after=1000)
    rows = list(sim.run(rounds))
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    gaps = [sim.server.round - c.state.round for c in sim.clients.values()]
    assert max(gaps) > 10  # some clients last took part many rounds ago
    sim.sync_all()
    assert_same_model(sim.state, [c.state for c in sim.clients.values()] + [late_client(sim, task, zo).state])
    return sim


def uplink_bytes_of_three_rounds(run, tmp_path, capsys) -> float:
    """``hiso run RUN`` with 2 clients, both answering 3 rounds: its summary's mean bytes up a client."""
    import json
    d = tmp_path / "r"
    code, _, err = run_cli(["run", "--quiet", *run, "--clients", "2", "--sampled", "2", "--rounds", "3",
                            "--out", str(d)], capsys)
    assert code == 0, err
    return json.loads((d / "summary.json").read_text())["communication_per_client"]["bytes_up_mean"]


def assert_run_refused(tmp_path, capsys, args, msg) -> None:
    """``hiso run --out DIR ARGS`` exits 2 with one line on stderr naming ``msg``; DIR is not made."""
    code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), *args], capsys)
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def assert_serverapp_runs_it_as_the_simulator(options: dict, tmp_path, monkeypatch) -> None:
    """The Flower ServerApp (three nodes in process) and the simulator, run on test_flower's CFG
    with ``options``, write the same model.pt and history.bin."""
    import pytest
    pytest.importorskip("flwr")
    from test_flower import CFG, FakeGrid, _Msg, _load, _same_model

    from hiso.config import RunConfig
    from hiso.flower.app import FlowerFederation, Settings, serve
    from hiso.runners.rundir import run_to_dir
    cfg = RunConfig(**{**CFG, "local_steps": 1, "clients": 3, "sampled": 2, "rounds": 4, "seed": 8, "eval_every": 2,
                       **options})
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    serve(FakeGrid(cfg, tmp_path / "replicas", {11: 0, 12: 1, 13: 2}), cfg,
          Settings(out_dir=str(tmp_path / "flower"), round_timeout=5, poll_s=0.01))
    run_to_dir(cfg, tmp_path / "sim")
    assert _same_model(_load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt"))
    assert (tmp_path / "flower" / "history.bin").read_bytes() == (tmp_path / "sim" / "history.bin").read_bytes()


def load_state(path):
    """A model.pt / checkpoint / rebuild file as saved (round, model, the stages' state)."""
    return torch.load(path, weights_only=False)


def resumed_and_rebuilt(run: list, tmp_path, capsys, rounds: int = 8):
    """``hiso run RUN`` for ``rounds`` rounds (in ``tmp_path/full``), the same stopped at half and
    resumed (``tmp_path/short``; the two logs asserted byte for byte) and ``hiso rebuild`` of the
    first: their saved states (full, resumed, rebuilt)."""
    full, short = tmp_path / "full", tmp_path / "short"
    for d, n in ((full, rounds), (short, rounds // 2)):
        code, _, err = run_cli(["run", "--quiet", *run, "--rounds", str(n), "--out", str(d)], capsys)
        assert code == 0, err
    code, _, err = run_cli(["run", "--quiet", "--resume", str(short), "--rounds", str(rounds)], capsys)
    assert code == 0, err
    assert (short / "history.bin").read_bytes() == (full / "history.bin").read_bytes()
    code, _, err = run_cli(["rebuild", str(full), "--out", str(tmp_path / "re.pt")], capsys)
    assert code == 0, err
    return load_state(full / "model.pt"), load_state(short / "model.pt"), load_state(tmp_path / "re.pt")


def flower_and_run(run: list, tmp_path, capsys):
    """``hiso flower`` (a SuperLink and two SuperNodes as processes) and ``hiso run`` of ``run``
    with 2 clients, both sampled, 3 rounds: the logs asserted byte for byte; their saved states."""
    args = [*run, "--clients", "2", "--sampled", "2", "--rounds", "3"]
    code, _, err = run_cli(["flower", "--nodes", "2", "--round-timeout", "120", "--out", str(tmp_path / "flower"),
                            *args], capsys)
    assert code == 0, err
    code, _, err = run_cli(["run", "--quiet", "--out", str(tmp_path / "sim"), *args], capsys)
    assert code == 0, err
    assert (tmp_path / "flower" / "history.bin").read_bytes() == (tmp_path / "sim" / "history.bin").read_bytes()
    return load_state(tmp_path / "flower" / "model.pt"), load_state(tmp_path / "sim" / "model.pt")
