"""hiso on Flower under network faults (issue 43): the ServerApp's answers to lost messages
over a fake grid."""

from __future__ import annotations

import pytest

from hiso.config import RunConfig
from hiso.tasks.registry import build_task

from test_flower import CFG, FakeGrid, _Msg, needs_flwr

pytestmark = pytest.mark.flower


def _fed(tmp_path, cfg, nodes, **kw):
    from hiso.flower.app import FlowerFederation, Settings
    grid = FakeGrid(cfg, tmp_path / "replicas", nodes)
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
