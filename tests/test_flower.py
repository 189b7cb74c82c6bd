"""hiso on a real Flower federation: a SuperLink and SuperNodes on 127.0.0.1.

Select with ``-k flower`` (or ``-m slow``). Needs the ``flower`` extra (skipped without it).
Every process is started by :class:`hiso.flower.launch.LocalFederation` in its own session
and stopped by the fixture, whatever the test does (and if the test process is killed: see
conftest.py); every wait is bounded by progress (a round logged, CPU used while starting), not
by a fixed budget, so a busy machine makes these tests slower, not failed; ports are chosen at
run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hiso import procs
from hiso.config import RunConfig
from hiso.core import Client, ModelState, Server, decode_uplink, encode_downlink
from hiso.core.history import read_history
from hiso.flower.launch import LocalFederation
from hiso.flower.replica import Replica, run_key
from hiso.runners.rundir import rebuild, run_to_dir
from hiso.tasks.registry import build_task

from conftest import rows_logged, tagged_by, wait_exit, wait_progress, wait_until
from process_helpers import kill_node, kill_serverapp, nodes_online

pytestmark = pytest.mark.flower  # pytest -m flower

needs_flwr = pytest.mark.skipif(__import__("importlib").util.find_spec("flwr") is None,
                                reason="the flower extra is not installed")

# metrics rows: "client_*" (a simulated client's work, hiso.runners.client_cost) is not seen by a Flower server
CFG = dict(task="quadratic", algorithm="hiso", clients=2, sampled=2, local_steps=2, perturbations=3,
           dim=40, lr=0.05, eval_every=100, threads=1)


# ------------------------------------------------------------- the node's replica (no Flower)


def _cfg_json(**kw) -> str:
    return RunConfig(**{**CFG, "rounds": 5, **kw}).model_dump_json()


def _open(root, cfg_json, run_id, pid):
    cfg = RunConfig.model_validate_json(cfg_json)
    state = ModelState(build_task(cfg).build_model(), cfg.zo())
    return Replica.open(root, run_key(cfg_json, run_id), pid, state)


def test_flower_replica_survives_processes_and_stays_bit_identical(tmp_path):
    """A client whose replica is reopened for every message (as a ClientApp process is) and
    whose answers are sometimes lost ends bit-identical to the server, H included."""
    cfg_json = _cfg_json(clients=3, sampled=2)
    cfg = RunConfig.model_validate_json(cfg_json)
    task = build_task(cfg)
    server = Server(3, 2, cfg.local_steps, cfg.perturbations, seed=cfg.seed)
    ref = ModelState(task.build_model(), cfg.zo())
    for r in range(12):
        plan = server.plan()
        ups = []
        for pid in plan.participants:
            rep = _open(tmp_path, cfg_json, 7, pid)  # a fresh process: nothing but the file
            client = Client(pid, rep.state, task.loss, lambda rr, k, pid=pid: task.batch(pid, rr, k, cfg.batch_size),
                            wire=server.wire)
            rep.begin()
            up = client.handle(encode_downlink(server.downlink(pid), server.wire))
            rep.commit()
            rep.close()
            if not (pid == 1 and r % 3 == 0):  # partition 1's answer is lost now and then
                ups.append(decode_uplink(up, server.wire))
        rec = server.aggregate(ups, partial=True)
        if rec is not None:
            ref.apply(rec)
    for pid in range(3):
        rep = _open(tmp_path, cfg_json, 7, pid)
        assert rep.reset_reason is None
        rep.state.replay(server.history[rep.state.round:])
        assert all(torch.equal(a, b) for a, b in zip(rep.state.params, ref.params))
        assert all(torch.equal(a, b) for a, b in zip(rep.state.h, ref.h))
    assert not torch.equal(ref.h[0], torch.ones_like(ref.h[0]))


def test_flower_replica_is_reset_when_torn_or_foreign(tmp_path):
    cfg_json = _cfg_json()
    rep = _open(tmp_path, cfg_json, 1, 0)
    with torch.no_grad():
        rep.state.params[0].add_(1.0)
    rep.state.round = 4
    rep.commit()
    again = _open(tmp_path, cfg_json, 1, 0)
    assert again.reset_reason is None and again.state.round == 4
    x0 = ModelState(build_task(RunConfig.model_validate_json(cfg_json)).build_model(),
                    RunConfig.model_validate_json(cfg_json).zo())
    assert torch.equal(again.state.params[0], x0.params[0] + 1.0)  # the values persisted
    again.begin()  # the process dies here, mid-update: the replica stays marked dirty
    torn = _open(tmp_path, cfg_json, 1, 0)
    assert torn.reset_reason and "interrupted" in torn.reset_reason
    assert torn.state.round == 0 and torch.equal(torn.state.params[0], x0.params[0])
    assert _open(tmp_path, cfg_json, 2, 0).state.round == 0  # another run never shares it
    assert run_key(cfg_json, 1) != run_key(_cfg_json(seed=9), 1)
    assert run_key(cfg_json, 1) == run_key(_cfg_json(rounds=50), 1)  # a longer run: same trajectory


# ------------------------------------------------------------- the ServerApp's logic on a fake grid


class _Msg:
    def __init__(self, fields, dst, kind, group=None):
        self.fields, self.kind = fields, kind
        self.metadata = SimpleNamespace(dst_node_id=dst, src_node_id=None, reply_to_message_id=None)


class _Reply:
    def __init__(self, fields, src, mid):
        self.content = {"hiso": fields}
        self.metadata = SimpleNamespace(src_node_id=src, reply_to_message_id=mid)
        self.error = None

    def has_error(self):
        return False


class FakeGrid:
    """Nodes are in-process ClientApp handlers over the same replica files; a node can be
    dead (never answers), garbled (answers garbage) or replaced by a new node id."""

    def __init__(self, cfg, state_dir, nodes: dict[int, int]):
        self.cfg, self.state_dir, self.nodes = cfg, str(state_dir), dict(nodes)  # node id -> partition
        self.dead, self.garbled, self.replies, self.n = set(), set(), {}, 0

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, msgs):
        from hiso.flower.app import query_fields, train_fields
        ids = []
        for m in msgs:
            self.n += 1
            mid, nid = f"m{self.n}", m.metadata.dst_node_id
            ids.append(mid)
            if nid in self.dead:
                continue
            pid = self.nodes[nid]
            if m.kind == "query":
                f = query_fields(self.cfg, 1, pid, self.state_dir, welcome=m.fields.get("welcome"))
            else:
                f = train_fields(self.cfg, 1, pid, self.state_dir, m.fields["down"])
                if nid in self.garbled:
                    f = {"up": f["up"][:-3]} if "up" in f else f
            self.replies[mid] = _Reply(f, nid, mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def test_flower_server_logic_survives_dead_garbled_and_restarted_nodes(tmp_path):
    from hiso.flower.app import FlowerFederation, Settings
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 3, "rounds": 8, "seed": 3})
    task = build_task(cfg)
    grid = FakeGrid(cfg, tmp_path / "replicas", {101: 0, 102: 1, 103: 2})
    fed = FlowerFederation(grid, task, cfg, Settings(out_dir=str(tmp_path), round_timeout=0.3, suspect_grace_s=0.05,
                                                    poll_s=0.01, wait_nodes_s=5))
    fed._message = lambda fields, nid, kind, group=None: _Msg(fields, nid, kind, group)
    fed.wait_for_nodes()
    assert fed.node_of == {0: 101, 1: 102, 2: 103}
    fed.step()
    grid.dead.add(102)        # partition 1's node dies
    grid.garbled.add(103)     # partition 2's node answers garbage
    fed.step()
    assert fed.server.history[-1].participants == (0,)
    assert 102 in fed._suspects and 103 not in fed._suspects  # garbage is an answer, dropped later
    grid.garbled.clear()
    fed.step()
    assert fed.server.history[-1].participants == (0, 2)
    # partition 1 comes back as a new node whose replica was lost (torn): it reports round 0
    rep = _open(tmp_path / "replicas", cfg.model_dump_json(), 1, 1)
    rep.begin()  # mark it torn: the next open resets it to x_0
    del grid.nodes[102]
    grid.nodes[104] = 1
    fed.step()
    assert fed.node_of[1] == 104 and fed.server.history[-1].participants == (0, 1, 2)
    # every answer lost: the round is planned again, nothing logged
    grid.dead.update({101, 103, 104})
    n = fed.server.round
    fed.settings.max_replans = 1
    with pytest.raises(RuntimeError, match="no client answered"):
        fed.step()
    assert fed.server.round == n and fed.server.replanned == 2
    grid.dead.clear()
    fed._suspects.clear()
    fed.step()
    # all three replicas, one reset and caught up from x_0 on the way, equal the server's model
    for pid in range(3):
        rep = _open(tmp_path / "replicas", cfg.model_dump_json(), 1, pid)
        assert rep.reset_reason is None
        rep.state.replay(fed.server.history[rep.state.round:])
        assert all(torch.equal(a, b) for a, b in zip(rep.state.params, fed.state.params))
        assert all(torch.equal(a, b) for a, b in zip(rep.state.h, fed.state.h))


def test_flower_serve_writes_the_simulators_run_directory(tmp_path, monkeypatch):
    """The ServerApp's body over a fake grid (partial sampling, so clients catch up): the run
    directory equals the in-process simulator's, bit for bit, and hiso rebuild reproduces it."""
    from hiso.flower.app import FlowerFederation, Settings, serve
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 2, "rounds": 6, "seed": 8, "eval_every": 2})
    grid = FakeGrid(cfg, tmp_path / "replicas", {11: 0, 12: 1, 13: 2})
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    serve(grid, cfg, Settings(out_dir=str(tmp_path / "flower"), round_timeout=5, poll_s=0.01))
    run_to_dir(cfg, tmp_path / "sim")
    a, b = _load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt")
    assert _same_model(a, b) and a["round"] == 6
    rows_f = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    rows_s = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    for f, s_ in zip(rows_f, rows_s, strict=True):
        assert {k: v for k, v in f.items() if k != "wall_s" and not k.startswith("client_")} == {k: v for k, v in s_.items() if k != "wall_s" and not k.startswith("client_")}
    state, _ = rebuild(tmp_path / "flower")
    assert all(torch.equal(p, a["model"][n]) for n, p in state.named)


@pytest.mark.parametrize("attack", ["scale", "sign-flip", "nan"])
def test_flower_attacking_node_and_median_match_the_simulator(tmp_path, monkeypatch, attack):
    """One Byzantine node (``--byzantine 1``: the client the simulator draws from the run seed)
    lies in its answers; the ServerApp's median over a fake grid ends with the simulator's
    model and log under the same attack, bit for bit, and the attack did change the run."""
    from hiso.flower.app import FlowerFederation, Settings, serve
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 3, "rounds": 4, "seed": 8, "eval_every": 2,
                       "byzantine": 1, "attack": attack, "aggregate": "median"})
    serve(FakeGrid(cfg, tmp_path / "replicas", {11: 0, 12: 1, 13: 2}), cfg,
          Settings(out_dir=str(tmp_path / "flower"), round_timeout=5, poll_s=0.01))
    run_to_dir(cfg, tmp_path / "sim")
    a, b = _load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt")
    assert _same_model(a, b) and a["round"] == 4
    recs_f, recs_s = (read_history(tmp_path / d / "history.bin")[2] for d in ("flower", "sim"))
    assert [(r.participants, r.scalars.tobytes()) for r in recs_f] == [(r.participants, r.scalars.tobytes()) for r in recs_s]
    if attack == "nan":  # the liar's answers are refused: rounds go on with the two honest nodes
        assert all(len(r.participants) == 2 for r in recs_f)
    run_to_dir(cfg.model_copy(update={"byzantine": 0}), tmp_path / "clean")
    assert not _same_model(a, _load(tmp_path / "clean" / "model.pt"))


class _ServerAppDies(Exception):
    pass


@pytest.mark.parametrize("every", ["0", "2"])
def test_flower_serverapp_resumes_from_its_run_directory(tmp_path, monkeypatch, every):
    """A ServerApp that dies after round 3 (its grid fails mid-round 4) leaves a run directory
    that a new ServerApp continues (``Settings.resume``): the nodes keep their replicas and
    are asked where they stand; the run ends equal to the uninterrupted in-process run, bit
    for bit (model, H, history, metrics and bytes), and hiso rebuild reproduces it. With a
    checkpoint every 2 rounds the new ServerApp's model and H start from round 2's."""
    from hiso.flower.app import FlowerFederation, Settings, serve
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 2, "rounds": 7, "seed": 9, "eval_every": 2,
                       "checkpoint_every": every})
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    out = tmp_path / "flower"
    st = dict(round_timeout=5, poll_s=0.01)
    grid = FakeGrid(cfg, tmp_path / "replicas", {11: 0, 12: 1, 13: 2})
    push, trains = grid.push_messages, []

    def dies_in_round_4(msgs):
        trains.extend(m for m in msgs if m.kind == "train")
        if len(trains) > 3 * cfg.sampled:
            raise _ServerAppDies()
        return push(msgs)

    grid.push_messages = dies_in_round_4
    with pytest.raises(_ServerAppDies):
        serve(grid, cfg, Settings(out_dir=str(out), **st))
    assert len(read_history(out / "history.bin")[2]) == 3 and not (out / "summary.json").exists()
    assert (out / "checkpoint.pt").exists() == (every == "2")
    lineage = (out / "flower-lineage").read_text()
    # a new ServerApp (fresh node ids: the nodes were queried again) continues the run
    grid2 = FakeGrid(cfg, tmp_path / "replicas", {21: 0, 22: 1, 23: 2})
    serve(grid2, cfg, Settings(out_dir=str(out), resume=True, **st))
    run_to_dir(cfg, tmp_path / "sim")
    a, b = _load(out / "model.pt"), _load(tmp_path / "sim" / "model.pt")
    assert _same_model(a, b) and a["round"] == 7
    assert json.loads((out / "summary.json").read_text())["checkpoints"]["resumed_from"] == (2 if every == "2" else None)
    recs_f, recs_s = read_history(out / "history.bin")[2], read_history(tmp_path / "sim" / "history.bin")[2]
    assert [(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in recs_f] == \
           [(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in recs_s]
    rows_f = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows_s = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    for f, s_ in zip(rows_f, rows_s, strict=True):
        assert {k: v for k, v in f.items() if k != "wall_s" and not k.startswith("client_")} == {k: v for k, v in s_.items() if k != "wall_s" and not k.startswith("client_")}
    state, _ = rebuild(out)
    assert all(torch.equal(p, a["model"][n]) for n, p in state.named)
    flower = json.loads((out / "flower.json").read_text())["flower"]
    assert [t["round"] for t in flower["timings"]] == [3, 4, 5, 6]  # (0-based) the new attempt ran rounds 4-7 only
    # nodes key their replicas by the run directory's lineage: kept by a resume, new for a new run
    assert (out / "flower-lineage").read_text() == lineage
    serve(FakeGrid(cfg, tmp_path / "replicas2", {31: 0, 32: 1, 33: 2}), cfg, Settings(out_dir=str(out), **st))
    assert (out / "flower-lineage").read_text() != lineage
    # a full-model run cannot be resumed (nothing logged to rebuild its optimiser from)
    with pytest.raises(ValueError, match="cannot be resumed"):
        serve(grid2, RunConfig(**{**CFG, "algorithm": "fedavg", "rounds": 2}),
              Settings(out_dir=str(tmp_path / "fa"), resume=True, **st))


def test_flower_client_keys_its_replica_by_the_lineage_it_is_sent():
    from hiso.flower.app import _trajectory
    ctx = SimpleNamespace(run_id=5)
    assert _trajectory(SimpleNamespace(content={"hiso": {"lineage": "ab12"}}), ctx) == "ab12"
    assert _trajectory(SimpleNamespace(content={"hiso": {"down": b""}}), ctx) == 5  # an older server: the run id


def test_flower_client_asks_for_history_it_lacks(tmp_path):
    """A node whose replica is older than the server thinks answers `behind`, and the server
    resends from there in the same round."""
    from hiso.flower.app import FlowerFederation, Settings
    cfg = RunConfig(**{**CFG, "clients": 2, "sampled": 2, "rounds": 4, "seed": 5})
    grid = FakeGrid(cfg, tmp_path / "replicas", {1: 0, 2: 1})
    fed = FlowerFederation(grid, build_task(cfg), cfg, Settings(out_dir=str(tmp_path), round_timeout=0.3, poll_s=0.01))
    fed._message = lambda fields, nid, kind, group=None: _Msg(fields, nid, kind, group)
    fed.wait_for_nodes()
    for _ in range(3):
        fed.step()
    rep = _open(tmp_path / "replicas", cfg.model_dump_json(), 1, 1)
    rep.begin()  # torn on disk, but the server still believes it holds round 2
    rep.close()
    sent = []
    orig = grid.push_messages
    grid.push_messages = lambda msgs: sent.extend((m.kind, m.metadata.dst_node_id) for m in msgs) or orig(msgs)
    fed.step()
    assert sent.count(("train", 2)) == 2  # once refused (behind), once from round 0
    assert fed.server.history[-1].participants == (0, 1)
    rep = _open(tmp_path / "replicas", cfg.model_dump_json(), 1, 1)
    assert rep.state.round == 3
    rep.state.replay(fed.server.history[3:])
    assert all(torch.equal(a, b) for a, b in zip(rep.state.params, fed.state.params))


# ------------------------------------------------------------- a federation on loopback


@pytest.fixture
def federation(tmp_path):
    feds = []

    def make(**kw):
        fed = LocalFederation(workdir=tmp_path / "fed", **kw)
        feds.append(fed)
        return fed.start()

    try:
        yield make
    finally:
        for fed in feds:
            fed.stop()
    for fed in feds:
        assert not fed.procs
        # every process of the federation (Flower's detached SuperExecs and the ClientApps
        # included: they all inherit its FLWR_HOME) is gone
        assert tagged_by(f"FLWR_HOME={fed.home}") == []
    # and none is left a zombie of this process (a subreaper: Flower's orphans are ours to collect)
    assert procs.orphans() == []


def _load(path) -> dict:
    return torch.load(path, weights_only=False)


def _same_model(a: dict, b: dict) -> bool:
    ok = a["round"] == b["round"] and a["model"].keys() == b["model"].keys()
    ok = ok and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    if "h" in a or "h" in b:
        ok = ok and all(torch.equal(a["h"][k], b["h"][k]) for k in a["h"])
    return ok


def _replica(fed: LocalFederation, cfg: RunConfig, out: Path, partition: int):
    """A node's replica: keyed by the run directory's lineage (the ServerApp sends it)."""
    from hiso.flower.app import open_replica
    from hiso.flower.replica import run_key
    lineage = (out / "flower-lineage").read_text().strip()
    assert (fed.state_dir / run_key(fed.config_text(cfg), lineage) / f"p{partition}" / "meta.json").exists()
    _, rep = open_replica(cfg, lineage, partition, str(fed.state_dir), fed.config_text(cfg))
    return rep


@pytest.mark.slow
@needs_flwr
def test_flower_deployment_matches_the_simulator_bit_for_bit(federation, tmp_path):
    cfg = RunConfig(**CFG, rounds=3, seed=4)
    fed = federation(nodes=2)
    run_id = fed.submit(cfg, tmp_path / "flower", round_timeout=60)
    st = fed.wait(run_id, timeout=240)
    assert st["status"] == "finished:completed"
    run_to_dir(cfg, tmp_path / "sim")
    a, b = _load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt")
    assert a["round"] == 3 and _same_model(a, b)
    assert not torch.equal(a["h"][next(iter(a["h"]))], torch.ones(cfg.dim))  # H really moved
    # the same run directory: history, metrics and hiso rebuild
    _, _, recs_f = read_history(tmp_path / "flower" / "history.bin")
    _, _, recs_s = read_history(tmp_path / "sim" / "history.bin")
    assert [(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in recs_f] == \
           [(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in recs_s]
    rows_f = [json.loads(x) for x in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    rows_s = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    for f, s in zip(rows_f, rows_s, strict=True):  # same losses, same protocol bytes
        assert {k: v for k, v in f.items() if k != "wall_s" and not k.startswith("client_")} == {k: v for k, v in s.items() if k != "wall_s" and not k.startswith("client_")}
    state, _ = rebuild(tmp_path / "flower")
    assert all(torch.equal(p, a["model"][n]) for n, p in state.named)
    # each node's replica holds x_2 (the start of the last round) and replays to the server's x_3
    for pid in (0, 1):
        rep = _replica(fed, cfg, tmp_path / "flower", pid)
        assert rep.state.round == 2
        rep.state.replay(recs_f[2:])
        assert all(torch.equal(p, a["model"][n]) for n, p in rep.state.named)


def _wait_rows(path: Path, n: int, timeout: float) -> None:
    """Wait for round ``n``'s row; ``timeout`` bounds the time without a new round, not the total."""
    wait_progress(lambda: rows_logged(path.parent), n, f"round {n} in {path}", stall_s=timeout)


@needs_flwr
def test_a_flower_run_from_python_leaves_no_defunct_process(tmp_path):
    """``hiso flower`` from a long-lived process (a notebook, a service): every process Flower
    started was waited for when it ended, also those re-parented to this one (a subreaper)."""
    from hiso.flower.launch import run_local

    assert procs.become_subreaper()  # as the tests and the hiso command are: orphans come to us
    run_local(RunConfig(**CFG, rounds=2, seed=1), tmp_path / "run", 2, workdir=tmp_path / "fed")
    assert (tmp_path / "run" / "summary.json").exists()
    assert procs.orphans() == []


@needs_flwr
def test_flower_failed_run_says_where_its_logs_and_replicas_are(tmp_path, monkeypatch, capsys):
    """A run that fails (or is stopped) keeps its temporary work directory (Flower's logs, the
    nodes' replicas): it names it, and how to resume from those replicas instead of x_0."""
    from hiso.flower.launch import FlowerRunError, run_local
    cfg = RunConfig(**CFG, rounds=3)
    out = tmp_path / "run"
    run_to_dir(RunConfig(**CFG, rounds=1), out)  # a run directory with rounds logged ...
    (out / "summary.json").unlink()  # ... whose ServerApp died
    monkeypatch.setattr(LocalFederation, "start", lambda self: self)

    def dies(self, *a, **kw):
        raise FlowerRunError("run 1 finished:failed: No heartbeat received from the task")
    monkeypatch.setattr(LocalFederation, "submit", dies)
    with pytest.raises(FlowerRunError):
        run_local(cfg, out, 1, resume=True)
    err = capsys.readouterr().err
    work = err.split("kept in ")[1].split(";")[0]
    assert Path(work).is_dir() and f"hiso flower --resume {out} --nodes 1 --workdir {work}" in err
    import shutil
    shutil.rmtree(work)


@needs_flwr
def test_flower_federation_refuses_a_port_in_use(federation):
    """A SuperLink port someone else listens on fails at once, in one line, with nothing started
    (the launcher used to take the other listener for the SuperLink, start the nodes, and fail
    half a minute later with "Connection to the SuperLink is unavailable")."""
    import socket
    from hiso.flower.launch import FlowerRunError
    with socket.create_server(("127.0.0.1", 0)) as busy:
        with pytest.raises(FlowerRunError, match="already in use"):
            federation(nodes=1, port=busy.getsockname()[1])


@pytest.mark.slow
@needs_flwr
def test_flower_run_finishes_with_the_survivor_when_a_node_dies(federation, tmp_path):
    """Node 1 is killed after round 1: node 0 carries the next rounds and stays bit-identical.
    Node 1 is then restarted on the same disk: it catches up and ends in step too."""
    cfg = RunConfig(**CFG, rounds=6, seed=1)
    fed = federation(nodes=2)
    out = tmp_path / "flower"
    # a round waits 60 s for a node: the restarted one starts a ClientApp per message, slowly on a
    # loaded machine (at 20 s it missed every round left there)
    run_id = fed.submit(cfg, out, round_timeout=60)
    _wait_rows(out / "metrics.jsonl", 1, timeout=120)  # round 1 logged
    kill_node(fed, 1)
    _wait_rows(out / "metrics.jsonl", 2, timeout=120)  # a round without it
    fed.start_node(1)
    fed.wait(run_id, timeout=240)
    _, _, recs = read_history(out / "history.bin")
    parts = [r.participants for r in recs]
    assert len(recs) == 6 and parts[0] == (0, 1)
    assert (0,) in parts[1:]  # rounds closed with the survivor alone
    assert parts[-1] == (0, 1)  # the restarted node is back
    final = _load(out / "model.pt")
    state, _ = rebuild(out)
    assert all(torch.equal(p, final["model"][n]) for n, p in state.named)
    for pid in (0, 1):  # both replicas hold x_5 and replay to the server's x_6, H included
        rep = _replica(fed, cfg, out, pid)
        assert rep.state.round == 5
        rep.state.replay(recs[5:])
        assert all(torch.equal(p, final["model"][n]) for n, p in rep.state.named)
        assert all(torch.equal(h, final["h"][n]) for (n, _), h in zip(rep.state.named, rep.state.h))
    flower = json.loads((out / "flower.json").read_text())["flower"]
    assert any(t["participants"] != t["sampled"] for t in flower["timings"])


@pytest.mark.slow
@needs_flwr
def test_flower_with_tls_and_node_authentication(federation, tmp_path):
    cfg = RunConfig(**CFG, rounds=2, seed=2)
    fed = federation(nodes=2, tls=True, auth=True)
    st = fed.run(cfg, tmp_path / "flower", timeout=240, round_timeout=60)
    assert st["status"] == "finished:completed"
    run_to_dir(cfg, tmp_path / "sim")
    assert _same_model(_load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt"))
    # node authentication: a node whose key was never registered is refused and exits
    intruder = fed.start_node(7, register=False, wait=False)
    assert wait_exit(intruder, 60) != 0
    assert len(nodes_online(fed)) == 2
    # TLS: the SuperLink answers no plain-HTTP request
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", fed.port, timeout=5)
    try:
        conn.request("GET", "/")
        status = conn.getresponse().status
    except (http.client.HTTPException, OSError):
        status = None
    finally:
        conn.close()
    assert status is None or status >= 400


@pytest.mark.slow
@needs_flwr
def test_flower_run_resumes_after_its_serverapp_is_killed(federation, tmp_path):
    """The ServerApp is killed (SIGKILL) after round 2; ``flwr run`` with ``resume`` continues
    the run directory on the same SuperNodes and ends equal to the uninterrupted simulator."""
    cfg = RunConfig(**CFG, rounds=4, seed=7)
    fed = federation(nodes=2)
    out = tmp_path / "flower"
    run_id = fed.submit(cfg, out, round_timeout=60)
    _wait_rows(out / "metrics.jsonl", 2, timeout=180)
    wait_until(lambda: kill_serverapp(fed), "a ServerApp process to kill", 30, poll=0.2)
    fed._flwr("stop", run_id, "local", "--format", "json")
    assert not (out / "summary.json").exists()
    done = len(read_history(out / "history.bin")[2])
    assert 2 <= done < 4
    st = fed.run(cfg, out, timeout=240, round_timeout=60, resume=True)
    assert st["status"] == "finished:completed"
    run_to_dir(cfg, tmp_path / "sim")
    a, b = _load(out / "model.pt"), _load(tmp_path / "sim" / "model.pt")
    assert a["round"] == 4 and _same_model(a, b)
    recs_f, recs_s = read_history(out / "history.bin")[2], read_history(tmp_path / "sim" / "history.bin")[2]
    assert [(r.participants, r.scalars.tobytes()) for r in recs_f] == [(r.participants, r.scalars.tobytes()) for r in recs_s]
    flower = json.loads((out / "flower.json").read_text())["flower"]
    assert [t["round"] for t in flower["timings"]] == list(range(done, 4))
    # the nodes kept their replicas (keyed by the run directory's lineage, not the Flower run):
    # no catch-up from x_0, so even the bytes per round are the uninterrupted run's
    rows_f = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows_s = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    for f, s in zip(rows_f, rows_s, strict=True):
        assert {k: v for k, v in f.items() if k != "wall_s" and not k.startswith("client_")} == {k: v for k, v in s.items() if k != "wall_s" and not k.startswith("client_")}


@pytest.mark.slow
@needs_flwr
def test_flower_fullmodel_deployment_matches_the_in_process_runner(federation, tmp_path):
    """FedAdam on a SuperLink and 2 SuperNodes (model and updates in ArrayRecords through the
    SuperLink): the same model and metrics as the in-process runner, bit for bit. (Every
    baseline and wire dtype is checked against the in-process runner over a fake grid in
    tests/test_flower_fullmodel.py; this one checks the real transport.)"""
    fed = federation(nodes=2)
    for algorithm in ("fedadam",):
        cfg = RunConfig(**{**CFG, "algorithm": algorithm, "rounds": 2, "seed": 3})
        st = fed.run(cfg, tmp_path / algorithm, timeout=240, round_timeout=60)
        assert st["status"] == "finished:completed"
        run_to_dir(cfg, tmp_path / f"{algorithm}-sim")
        a, b = _load(tmp_path / algorithm / "model.pt"), _load(tmp_path / f"{algorithm}-sim" / "model.pt")
        assert a["round"] == 2 and _same_model(a, b)
        rows_f = [json.loads(x) for x in (tmp_path / algorithm / "metrics.jsonl").read_text().splitlines()]
        rows_s = [json.loads(x) for x in (tmp_path / f"{algorithm}-sim" / "metrics.jsonl").read_text().splitlines()]
        for f, s in zip(rows_f, rows_s, strict=True):
            assert {k: v for k, v in f.items() if k != "wall_s" and not k.startswith("client_")} == {k: v for k, v in s.items() if k != "wall_s" and not k.startswith("client_")}


@needs_flwr
def test_flower_cli_resume_checks_its_arguments(tmp_path, capsys):
    """`hiso flower --resume DIR` continues DIR as configured: no --out with it, no option that
    would change its config.json, nothing to do for a finished run (no Flower process starts)."""
    from cli_helpers import run_cli
    run = tmp_path / "r"
    run_to_dir(RunConfig(**CFG, rounds=2), run)
    code, _, err = run_cli(["flower", "--nodes", "2"], capsys)
    assert code == 2 and "--out DIR" in err
    code, _, err = run_cli(["flower", "--resume", str(run), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "--resume" in err
    code, _, err = run_cli(["flower", "--resume", str(run), "--lr", "0.5"], capsys)
    assert code == 2 and "drop --lr" in err
    code, out, _ = run_cli(["flower", "--resume", str(run), "--lr", "0.05", "--threads", "1"], capsys)
    assert code == 0 and "nothing to resume" in out  # same values as its config: allowed


@needs_flwr
@pytest.mark.parametrize("args,needle", [(["--drop-rate", "0.1"], "network faults"),
                                         (["--byzantine", "1", "--byzantine-per-round"], "fixed Byzantine"),
                                         (["--byzantine", "1", "--attack", "scale,random"], "fixed Byzantine")])
def test_flower_cli_refuses_what_nodes_cannot_simulate(tmp_path, capsys, args, needle):
    from cli_helpers import run_cli
    code, _, err = run_cli(["flower", "--nodes", "2", "--out", str(tmp_path / "r"), *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@needs_flwr
def test_flower_cli_refuses_to_resume_a_full_model_run(tmp_path, capsys, monkeypatch):
    """One line, before any Flower process starts (the ServerApp used to start and fail)."""
    from cli_helpers import run_cli
    import hiso.flower.launch as launch

    def started(*a, **kw):
        raise AssertionError("a federation was started")
    monkeypatch.setattr(launch, "run_local", started)
    run = tmp_path / "r"
    run_to_dir(RunConfig(**{**CFG, "algorithm": "fedadam"}, rounds=1), run)
    (run / "summary.json").unlink()  # as if its ServerApp had died
    code, _, err = run_cli(["flower", "--resume", str(run)], capsys)
    assert code == 2 and "fedadam runs cannot be resumed" in err and len(err.strip().splitlines()) == 1, err
    assert "full-model algorithms keep no log" in err
    pool = tmp_path / "pool"  # a seed pool keeps a log, but no node replica catches up on it
    run_to_dir(RunConfig(**{**CFG, "algorithm": "fedkseed", "perturbations": 1}, rounds=1), pool)
    (pool / "summary.json").unlink()
    code, _, err = run_cli(["flower", "--resume", str(pool)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "fedkseed runs cannot be resumed on Flower: its nodes keep no replica" in err and "full-model" not in err


@needs_flwr
@pytest.mark.parametrize("args,needle", [(["--nodes", "0"], "--nodes must be 1 to --clients (2)"),
                                         (["--nodes", "3"], "--nodes must be 1 to --clients (2)"),
                                         (["--round-timeout", "0"], "--round-timeout must be a positive"),
                                         (["--round-timeout", "-5"], "--round-timeout must be a positive")])
def test_flower_cli_refuses_bad_federation_options_before_starting_anything(tmp_path, capsys, monkeypatch,
                                                                            args, needle):
    """One line and exit 2, before any Flower process starts (they used to start: --nodes 0
    ran --clients nodes, --nodes 3 waited a minute for a node that has no partition, a
    non-positive round timeout failed every round)."""
    from cli_helpers import run_cli
    import hiso.flower.launch as launch

    def started(*a, **kw):
        raise AssertionError("a federation was started")
    monkeypatch.setattr(launch, "run_local", started)
    code, _, err = run_cli(["flower", "--task", "quadratic", "--clients", "2", "--sampled", "2",
                            "--out", str(tmp_path / "r"), *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@needs_flwr
def test_flower_cli_refuses_a_run_directory_it_cannot_write(tmp_path, capsys, monkeypatch):
    """The ServerApp writes --out: a directory that cannot be made is refused in one line before
    the federation starts (it used to fail half a minute later with the ServerApp's traceback)."""
    from cli_helpers import run_cli
    import hiso.flower.launch as launch

    def started(*a, **kw):
        raise AssertionError("a federation was started")
    monkeypatch.setattr(launch, "run_local", started)
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc (a directory nobody, root included, can make folders in)")
    code, _, err = run_cli(["flower", "--task", "quadratic", "--clients", "2", "--sampled", "2",
                            "--out", "/proc/hiso-no-such-dir/r"], capsys)
    assert code == 2 and "cannot write the run directory" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@needs_flwr
def test_flower_deployment_with_an_attacking_node_and_median_matches_the_simulator(federation, tmp_path):
    """Three SuperNodes (per-node workers), one of them Byzantine (scaling its scalars by 1e3),
    the ServerApp aggregating by median: the simulator's model under the same attack."""
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 3, "rounds": 2, "seed": 6, "byzantine": 1, "attack": "scale",
                       "aggregate": "median"})
    fed = federation(nodes=3, worker=True)
    st = fed.run(cfg, tmp_path / "flower", timeout=240, round_timeout=120)
    assert st["status"] == "finished:completed"
    run_to_dir(cfg, tmp_path / "sim")
    a = _load(tmp_path / "flower" / "model.pt")
    assert a["round"] == 2 and _same_model(a, _load(tmp_path / "sim" / "model.pt"))
    run_to_dir(cfg.model_copy(update={"byzantine": 0}), tmp_path / "clean")
    assert not _same_model(a, _load(tmp_path / "clean" / "model.pt"))  # the lie reached the median


@pytest.mark.slow
@needs_flwr
def test_flower_deployment_with_per_node_workers_matches_the_simulator(federation, tmp_path):
    """SuperNodes whose ClientApp is the thin relay to a long-lived worker: bit-identical to
    the simulator, and every train message answered by the worker (no per-message build)."""
    cfg = RunConfig(**CFG, rounds=2, seed=5)
    fed = federation(nodes=2, worker=True)
    st = fed.run(cfg, tmp_path / "flower", timeout=240, round_timeout=60)
    assert st["status"] == "finished:completed"
    run_to_dir(cfg, tmp_path / "sim")
    assert _same_model(_load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt"))
    rows = [json.loads(x) for f in fed.state_dir.glob("*/p*/timings.jsonl") for x in f.read_text().splitlines()]
    assert len(rows) == 4 and all(r.get("worker") for r in rows)
    assert {n for n in fed.procs if n.startswith("worker")} == {"worker0", "worker1"}


def test_a_run_whose_sampled_clients_did_not_all_answer_says_so(tmp_path):
    # flwr reports such a run as completed: the note is what tells the terminal a node was lost
    from hiso.flower.launch import missed_answers_note

    def write(rounds):
        (tmp_path / "flower.json").write_text(json.dumps({"flower": {"timings": [
            {"round": r + 1, "sampled": s, "participants": p} for r, (s, p) in enumerate(rounds)]}}))
    write([([0, 1], [0, 1])] * 3)
    assert missed_answers_note(tmp_path) is None
    write([([0, 1], [0, 1]), ([0, 1], [0]), ([1, 2], [2]), ([0, 2], [0, 2])])
    note = missed_answers_note(tmp_path)
    assert note.startswith("note: 2 of 4 rounds closed without every sampled client's answer")
    assert "partition 1 missed 2 of its 3" in note and "partition 0" not in note
    assert missed_answers_note(tmp_path / "nothing-here") is None
