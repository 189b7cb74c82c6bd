"""hiso on Flower under network faults (issue 43): the ServerApp's answers to lost messages
over a fake grid (fast), and real federations on 127.0.0.1 whose SuperNodes reach the
SuperLink through fault proxies (tests/flower_fault_harness.py; longer runs and the figures:
bench/flower_faults.py, docs/flower.md).

Each real run checks that it finished, that every partition's replica replays to the server's
final model and H bit for bit, that every logged round is what the in-process simulator
computes for that round's participants, and that the log equals a fault-free ``hiso run``
up to the first round that lost an answer (all of it when none did).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hiso.config import RunConfig
from hiso.core.history import read_history
from hiso.tasks.registry import build_task

from flower_fault_harness import cut_off_one_node, superlink_killed
from test_flower import CFG, FakeGrid, _Msg, needs_flwr

pytestmark = pytest.mark.flower


def _fed(tmp_path, cfg, nodes, grid_cls=None, **kw):
    from hiso.flower.app import FlowerFederation, Settings
    grid = (grid_cls or FakeGrid)(cfg, tmp_path / "replicas", nodes)
    fed = FlowerFederation(grid, build_task(cfg), cfg, Settings(out_dir=str(tmp_path), **{
        "round_timeout": 0.3, "suspect_grace_s": 0.05, "poll_s": 0.01, "wait_nodes_s": 5, **kw}))
    fed._message = lambda fields, nid, kind, group=None: _Msg(fields, nid, kind, group)
    return grid, fed


def test_flower_a_lost_query_is_sent_again(tmp_path):
    """Flower hands a message out once: a query lost on its way to the node (a connection reset
    as the node pulled it) used to leave that node out of the whole run."""
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 3, "rounds": 2})
    grid, fed = _fed(tmp_path, cfg, {101: 0, 102: 1, 103: 2})
    push, lost = grid.push_messages, []

    def loses_the_first_query_to_102(msgs):
        ids = push(msgs)
        for mid, m in zip(ids, msgs):
            if not lost and m.kind == "query" and m.metadata.dst_node_id == 102:
                lost.append(grid.replies.pop(mid))  # never delivered: no reply
        return ids
    grid.push_messages = loses_the_first_query_to_102
    fed.wait_for_nodes()
    assert lost and fed.node_of == {0: 101, 1: 102, 2: 103} and fed.queries_resent == 1
    fed.step()
    assert fed.server.history[-1].participants == (0, 1, 2)


def test_flower_a_node_back_under_its_old_id_is_asked_again(tmp_path):
    """A SuperNode that the SuperLink saw go offline (no heartbeat) and come back keeps its node
    id; the server forgot its partition when it left and must learn it again."""
    cfg = RunConfig(**{**CFG, "clients": 2, "sampled": 2, "rounds": 3})
    grid, fed = _fed(tmp_path, cfg, {1: 0, 2: 1})
    fed.wait_for_nodes()
    fed.step()
    gone = grid.nodes.pop(2)  # offline: not among the grid's node ids
    fed.step()
    assert fed.server.history[-1].participants == (0,) and 1 not in fed.node_of
    grid.nodes[2] = gone  # back, same id
    fed.step()
    assert fed.node_of == {0: 1, 1: 2} and fed.server.history[-1].participants == (0, 1)


class _SlowGrid(FakeGrid):
    """A fake grid whose node ids in ``slow`` answer after that many pulls (None: only when
    :meth:`deliver` is called), and whose messages to ``lost`` come back as the SuperLink's error."""

    def __init__(self, *a):
        super().__init__(*a)
        self.slow, self.lost, self.held = {}, set(), {}

    def push_messages(self, msgs):
        ids = super().push_messages(msgs)
        for mid, m in zip(ids, msgs):
            nid = m.metadata.dst_node_id
            if nid in self.lost:
                err = SimpleNamespace(reason="Message Unavailable")
                self.replies[mid] = SimpleNamespace(metadata=SimpleNamespace(src_node_id=1, reply_to_message_id=mid),
                                                    error=err, has_error=lambda: True)
            elif nid in self.slow:
                self.held[mid] = [self.slow[nid], self.replies.pop(mid)]
        return ids

    def pull_messages(self, ids):
        for mid, held in list(self.held.items()):
            if held[0] is not None:
                held[0] -= 1
                if held[0] <= 0:
                    self.replies[mid] = self.held.pop(mid)[1]
        return super().pull_messages(ids)

    def deliver(self):
        self.replies.update({mid: rep for mid, (_, rep) in self.held.items()})
        self.held.clear()


def test_flower_a_suspect_back_is_waited_for_again(tmp_path):
    """A node that missed its answer is a *suspect* (waited for ``suspect_grace_s`` once the
    others answered). A message the SuperLink gave up on (expired) is a miss, not an answer;
    a suspect whose late answer comes in, or that answers a query, is waited for in full again:
    a node back from a cut and a poll behind the others used to miss every grace for good."""
    cfg = RunConfig(**{**CFG, "clients": 2, "sampled": 2, "rounds": 6})
    grid, fed = _fed(tmp_path, cfg, {101: 0, 102: 1}, _SlowGrid, round_timeout=30)
    fed.wait_for_nodes()
    grid.lost.add(102)
    fed.step()
    assert fed.server.history[-1].participants == (0,) and 102 in fed._suspects  # the SuperLink's error: a miss
    grid.lost.clear()
    grid.slow[102] = None
    fed.step()  # answers after the grace: left out, still a suspect
    assert fed.server.history[-1].participants == (0,) and 102 in fed._suspects
    grid.deliver()
    grid.slow[102] = 30  # 30 polls of 0.01 s: longer than the grace
    fed.step()  # its late answer comes in: waited for in full, it takes part
    assert fed.server.history[-1].participants == (0, 1) and not fed._suspects
    fed._suspects.add(102)
    grid.slow.clear()
    grid.nodes.pop(102)
    fed.step()  # gone from the grid: forgotten
    grid.nodes[102] = 1
    fed.refresh_nodes()  # back under its id: asked again, and its answer clears it
    assert fed.node_of == {0: 101, 1: 102} and 102 not in fed._suspects


@needs_flwr
def test_flower_train_messages_expire_with_their_round(tmp_path):
    """A train message lives ``round_timeout`` (Flower's default: 12 h). A node that fell behind
    used to work through every stale message in turn, each taking about a round, and never
    answer in time again: a 5-round run with 10 s rounds failed after 21 empty attempts."""
    from hiso.flower.app import FlowerFederation, Settings
    from hiso.flower.loopback import server_task
    cfg = RunConfig(**{**CFG, "rounds": 2})
    fed = FlowerFederation(None, build_task(cfg), cfg, Settings(out_dir=str(tmp_path), round_timeout=7.5))
    with server_task():
        train, query = fed._message({"down": b"x"}, 5, "train", "0"), fed._message({}, 5, "query")
    assert train.metadata.ttl == 7.5
    assert query.metadata.ttl > 3600  # a first start may be slow: a query must not expire


# ------------------------------------------------------------- real federations through fault proxies


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{**CFG, "seed": 3, **kw})


def _first_loss(out) -> int:
    """The first round (0-based) that closed without every sampled client's answer, or that was
    planned again (a first attempt that timed out under load: fresh seeds, so not the simulator's)."""
    timings = json.loads((out / "flower.json").read_text())["flower"]["timings"]
    recs = read_history(out / "history.bin")[2]
    lost = [i for i, (t, r) in enumerate(zip(timings, recs)) if t["participants"] != t["sampled"] or r.attempt]
    return lost[0] if lost else len(timings)


@pytest.mark.slow
@needs_flwr
def test_flower_node_cut_off_then_back_under_latency_and_resets(tmp_path):
    """Scenarios 1 and 2 at once: every link 100 ms (+0-20 ms) each way with 3 % of chunks
    resetting their connection; node 1's link down (held bytes, hanging connections) for
    longer than a round's timeout once a round is logged, then back. The cut spans round 1
    from its first message to its close (the ServerApp is held at the boundary until the link
    is down; the link is back once round 1 is logged), so round 1 closes without node 1 on any
    machine, however loaded. Round 2 waits until node 1 polls again and the SuperLink counts it
    online (after a long cut its channel backs off, and a heartbeat may be a minute away), round 3
    until node 1 answered round 2's message: as a suspect it may miss round 2's grace, but its
    late answer, or its answer to the query that learns it again, clears it for round 3."""
    cfg = _cfg(rounds=5)
    # a round waits 30 s (a loaded machine's first answers, through a worker's start, can take
    # more than 12); the cut outlasts it
    fig = cut_off_one_node(cfg, tmp_path, round_timeout=30, cut_s=35, worker=True,
                           latency_s=0.1, jitter_s=0.02, reset_p=0.03)
    recs = read_history(tmp_path / "flower" / "history.bin")[2]
    assert fig["rounds_audited"] == 5  # every round recomputed in process: the same bits
    assert 1 not in recs[1].participants  # cut off: the round closed without it
    assert any(1 in r.participants for r in recs[2:])  # back
    assert fig["simulator_prefix"] == _first_loss(tmp_path / "flower")  # (round 0 too may lose one under load)
    assert fig["proxy_resets"] > 0 and fig["node_reconnects"] > 0


@pytest.mark.slow
@needs_flwr
def test_flower_superlink_killed_then_resumed_from_the_cli(tmp_path):
    """Scenario 3: `hiso flower --workdir W` whose SuperLink is SIGKILLed after round 1 exits
    non-zero naming `hiso flower --resume DIR --workdir W`, which finishes the run; no answer
    is lost, so the run equals `hiso run` bit for bit and no replica replayed from x_0."""
    cfg = _cfg(rounds=3, seed=4)
    fig = superlink_killed(cfg, tmp_path, round_timeout=60, after=1, worker=True)
    assert 1 <= fig["killed_after_rounds"] < 3 and fig["first_exit"] != 0
    assert fig["rounds_audited"] == 3
    if _first_loss(tmp_path / "flower") == 3:  # (a round slower than 60 s would lose an answer)
        assert fig["equals_simulator"]
        rows_f, rows_s = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                          for d in ("flower", "sim"))
        strip = lambda r: {k: v for k, v in r.items() if k != "wall_s" and not k.startswith("client_")}  # noqa: E731
        assert [strip(r) for r in rows_f] == [strip(r) for r in rows_s]  # bytes too: replicas were kept


@needs_flwr
def test_the_harness_finds_a_replica_out_of_step(tmp_path, monkeypatch):
    """The scenarios' replica check (flower_fault_harness.check_replicas) passes on a fake-grid
    federation and fails once one node's replica holds one wrong number: a desync is caught."""
    import torch

    from flower_fault_harness import check_replicas
    from hiso.flower.app import FlowerFederation, Settings, serve
    from hiso.flower.client_app import open_replica
    from hiso.flower.federation import LocalFederation
    cfg = RunConfig(**{**CFG, "clients": 3, "sampled": 2, "rounds": 3})
    state_dir, out = tmp_path / "replicas", tmp_path / "flower"
    monkeypatch.setattr(FlowerFederation, "_message", lambda self, f, nid, kind, group=None: _Msg(f, nid, kind, group))
    serve(FakeGrid(cfg, state_dir, {11: 0, 12: 1, 13: 2}), cfg, Settings(out_dir=str(out), round_timeout=5, poll_s=0.01))
    assert len(check_replicas(state_dir, cfg, out)) == 3
    lineage = (out / "flower-lineage").read_text().strip()
    _, rep = open_replica(cfg, lineage, 1, str(state_dir), LocalFederation.config_text(cfg))
    with torch.no_grad():
        rep.state.params[0].view(-1)[0] += 1e-3  # the replica is a memory map: this is its file
    rep.close()
    with pytest.raises(AssertionError, match="partition 1"):
        check_replicas(state_dir, cfg, out)


def test_a_hold_file_keeps_the_serverapp_at_a_round_boundary(tmp_path):
    """``DIR/HOLD`` naming round r: rounds before r go on; round r's first message waits until
    the file is removed (what an operator, and the cut-off scenario, use to act between rounds)."""
    import threading

    from hiso.flower.app import Settings
    from hiso.flower.transport import hold
    settings = Settings(out_dir=str(tmp_path), poll_s=0.01)
    (tmp_path / "HOLD").write_text("2\n")
    hold(settings, 1)  # round 1 < 2: not held (returns at once)
    t = threading.Thread(target=hold, args=(settings, 2), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # held while the file is there
    (tmp_path / "HOLD").unlink()
    t.join(60)
    assert not t.is_alive()
