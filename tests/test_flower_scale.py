"""Population scale over Flower (issue 44): nodes join when first sampled, nothing per round
reads the population, and every replica, those of clients last sampled long ago included,
stays bit-identical to the in-process run. The fake grid of test_flower.py, and once the
real simulation engine (Ray)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from hiso.config import RunConfig
from hiso.core.history import read_history
from hiso.runners.rundir import run_to_dir

from test_flower import CFG, FakeGrid, _load, _Msg, _open, _same_model

pytestmark = pytest.mark.flower

needs_flwr = pytest.mark.skipif(__import__("importlib").util.find_spec("flwr") is None,
                                reason="the flower extra is not installed")


class PlacedGrid(FakeGrid):
    """A fake grid whose node list may not be read (the population's worth of ids), counting
    the messages it is sent by kind and node."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent = Counter()

    def get_node_ids(self):
        raise AssertionError("the ServerApp read the whole node list")

    def push_messages(self, msgs):
        msgs = list(msgs)
        self.sent.update((m.kind, m.metadata.dst_node_id) for m in msgs)
        return super().push_messages(msgs)


def _rows(path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s" and not k.startswith("client_")} for r in rows]


def _longest_gap(records) -> int:
    """The most rounds a client went unsampled between two of its rounds."""
    last, gap = {}, 0
    for r in records:
        for c in r.participants:
            if c in last:
                gap = max(gap, r.round - last[c])
            last[c] = r.round
    return gap


def _check_replicas(root, cfg: RunConfig, run_key_id, records, final: dict) -> int:
    """Every partition's replica on disk holds the round of its last train and replays the
    log from there onto the run's final model and H, bit for bit; returns how many there are."""
    last = {c: r.round for r in records for c in r.participants}
    for c, rnd in last.items():
        rep = _open(root, cfg.model_dump_json(), run_key_id, c)
        assert rep.reset_reason is None and rep.state.round == rnd, c
        rep.state.replay(records[rnd:])
        assert all(torch.equal(p, final["model"][n]) for n, p in rep.state.named), c
        assert all(torch.equal(h, final["h"][n]) for (n, _), h in zip(rep.state.named, rep.state.h)), c
    return len(last)


def _matches_the_simulator(cfg, tmp_path):
    """Run ``cfg`` in process into tmp_path/sim and check tmp_path/flower against it (model, every
    record, metrics and bytes); return the Flower run's final model and records."""
    run_to_dir(cfg, tmp_path / "sim")
    a = _load(tmp_path / "flower" / "model.pt")
    assert _same_model(a, _load(tmp_path / "sim" / "model.pt")) and a["round"] == cfg.rounds
    recs_f, recs_s = (read_history(tmp_path / d / "history.bin")[2] for d in ("flower", "sim"))
    assert [(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in recs_f] == \
           [(r.participants, r.seeds.tobytes(), r.scalars.tobytes()) for r in recs_s]
    assert _rows(tmp_path / "flower" / "metrics.jsonl") == _rows(tmp_path / "sim" / "metrics.jsonl")
    return a, recs_f


def test_placed_nodes_join_when_first_sampled_and_match_the_simulator(tmp_path, monkeypatch):
    """300 placed nodes, 2 a round for 60 rounds, no snapshots (a returning client replays
    every round it missed, over 40 for one of them): the ServerApp never reads the node list,
    asks each node to join once, when its partition is first sampled (no query, no replica
    for the others), and the run directory, bytes included, equals the in-process run's."""
    from hiso.flower.app import FlowerFederation, Settings, serve
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    cfg = RunConfig(**{**CFG, "clients": 300, "sampled": 2, "rounds": 60, "seed": 2, "eval_every": 30,
                       "snapshot_after": 10**6})
    placement = {pid: 5000 + pid for pid in range(cfg.clients)}
    grid = PlacedGrid(cfg, tmp_path / "replicas", {nid: pid for pid, nid in placement.items()})
    serve(grid, cfg, Settings(out_dir=str(tmp_path / "flower"), round_timeout=5, poll_s=0.01, placement=placement))
    a, recs_f = _matches_the_simulator(cfg, tmp_path)
    sampled = {c for r in recs_f for c in r.participants}
    assert len(sampled) < cfg.clients * 0.5 and _longest_gap(recs_f) > 40
    assert {nid for (kind, nid), k in grid.sent.items() if kind == "query"} == {placement[c] for c in sampled}
    assert all(k == 1 for (kind, _), k in grid.sent.items() if kind == "query")
    assert len(list((tmp_path / "replicas").glob("*/p*"))) == len(sampled)
    assert _check_replicas(tmp_path / "replicas", cfg, 1, recs_f, a) == len(sampled)


def test_the_first_join_waits_for_the_engine_to_start(tmp_path, monkeypatch):
    """Ray's workers start (and build the task) on the first messages: under a placement the
    first round's joins wait ``wait_nodes_s`` for them, not ``round_timeout``, so a slow start
    does not cost a re-planned round (which would leave the in-process run's sample and seeds)."""
    import time
    from hiso.flower.app import FlowerFederation, Settings, serve
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    cfg = RunConfig(**{**CFG, "clients": 20, "sampled": 2, "rounds": 3, "seed": 4})
    placement = {pid: 700 + pid for pid in range(cfg.clients)}
    grid = PlacedGrid(cfg, tmp_path / "replicas", {nid: pid for pid, nid in placement.items()})
    pull, first = grid.pull_messages, []

    def starting(ids):  # no answer in the first second after the first pull: the workers are starting
        first.append(first[0] if first else time.monotonic())
        return pull(ids) if time.monotonic() > first[0] + 1.0 else []
    grid.pull_messages = starting
    serve(grid, cfg, Settings(out_dir=str(tmp_path / "flower"), round_timeout=0.3, poll_s=0.01, wait_nodes_s=20,
                              placement=placement))
    assert json.loads((tmp_path / "flower" / "flower.json").read_text())["flower"]["rounds_replanned"] == 0
    run_to_dir(cfg, tmp_path / "sim")
    assert _same_model(_load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt"))


def test_an_engine_that_gives_no_placement_falls_back_to_querying_every_node(tmp_path, monkeypatch):
    """A Flower whose engine no longer reports its placement (the hook never fires): once the
    grid lists nodes the ServerApp queries them all, as in a deployment, and still ends with
    the in-process run's model."""
    from hiso.flower.app import FlowerFederation, Settings, serve
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    cfg = RunConfig(**{**CFG, "clients": 6, "sampled": 2, "rounds": 3, "seed": 4})
    grid = FakeGrid(cfg, tmp_path / "replicas", {900 + pid: pid for pid in range(cfg.clients)})
    settings = Settings(out_dir=str(tmp_path / "flower"), round_timeout=5, poll_s=0.01, wait_nodes_s=1, placement={})
    serve(grid, cfg, settings)
    assert settings.placement is None and len(list((tmp_path / "replicas").glob("*/p*"))) == cfg.clients
    run_to_dir(cfg, tmp_path / "sim")
    assert _same_model(_load(tmp_path / "flower" / "model.pt"), _load(tmp_path / "sim" / "model.pt"))


@needs_flwr
def test_the_engines_dispatcher_asks_only_the_nodes_with_a_message(monkeypatch):
    """Flower's dispatcher asks every node of the population for a message every 0.1 s
    (scanning every stored message each time); under ``engine_patches`` it asks only the nodes
    that have one waiting, delivers each message once, and the engine's placement reaches the
    ServerApp's settings. Flower's own in-memory state and registration, 2,000 nodes."""
    import threading
    from queue import Empty, Queue

    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid import InMemoryGrid

    from hiso.flower.records import Settings
    from hiso.flower.sim import engine_patches
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=4242)
    run.primary_task_id, run.federation_id = 77, NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[77] = Task(task_id=77, run_id=run.run_id)
    for k, v in (("_task_id", 77), ("_run_id", run.run_id), ("_node_id", 1)):  # as run_simulation sets them
        monkeypatch.setattr(TaskIdentity, k, v)
    settings, original = Settings(out_dir="unused", placement={}), vce_api.add_messages_to_queue
    with engine_patches(settings):
        mapping = vce_api._register_nodes(num_nodes=2000, state_factory=factory)
        assert settings.placement == {pid: nid for nid, pid in mapping.items()}
        grid = InMemoryGrid(state_factory=factory)
        grid.set_run(run)
        dst = [settings.placement[p] for p in (3, 1999, 640, 77, 1000)]
        grid.push_messages([Message(RecordDict({"hiso": ConfigRecord({"x": i})}), dst_node_id=n, message_type="train")
                            for i, n in enumerate(dst)])
        asked, ask = [], state.get_message_ins
        state.get_message_ins = lambda node_id, limit: asked.append(node_id) or ask(node_id=node_id, limit=limit)
        queue, stop = Queue(), threading.Event()
        th = threading.Thread(target=vce_api.add_messages_to_queue, args=(state, queue, mapping, stop))
        th.start()
        got = []
        try:
            while len(got) < len(dst):
                got.append(queue.get(timeout=10).metadata.dst_node_id)
            stop.wait(0.3)  # a few more sweeps: nothing is handed out twice
        except Empty:
            pass
        finally:
            stop.set()
            th.join()
    assert vce_api.add_messages_to_queue is original  # the patch ends with the block
    assert sorted(got) == sorted(dst) and queue.empty()
    assert set(asked) == set(dst) and len(asked) == len(dst)


@pytest.mark.slow
@needs_flwr
def test_simulation_engine_with_hundreds_of_nodes_matches_the_simulator(tmp_path):
    """Flower's simulation engine (Ray) with 400 virtual nodes, 2 a round for 40 rounds, no
    snapshots: history, model, metrics and bytes equal hiso run's; only sampled partitions
    have a replica, and each one (clients last sampled over 25 rounds before included)
    replays onto the final model bit for bit."""
    from hiso.flower.sim import run_simulation
    cfg = RunConfig(**{**CFG, "clients": 400, "sampled": 2, "rounds": 40, "seed": 1, "eval_every": 20,
                       "snapshot_after": 10**6})
    # a round that times out is planned again with other clients and the histories part: under a
    # load of ~4 on 2 cores Ray's start and the first joins took over 60 s, so wait long, and fail
    # at the first timeout (no replan) so that a dead engine costs one wait, not 21
    run_simulation(cfg, tmp_path / "flower", state_dir=tmp_path / "replicas", num_cpus=1, round_timeout=300,
                   max_replans=0)
    a, recs_f = _matches_the_simulator(cfg, tmp_path)
    assert _longest_gap(recs_f) > 25
    lineage = (tmp_path / "flower" / "flower-lineage").read_text().strip()
    n = _check_replicas(tmp_path / "replicas", cfg, lineage, recs_f, a)
    assert len(list((tmp_path / "replicas").glob("*/p*"))) == n < cfg.clients / 2
