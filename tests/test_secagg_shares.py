"""SecAgg+'s sparse graph over Flower (``secagg_shares``, the workflow's ``num_shares``): each node
shares its secrets with its ``secagg_shares`` neighbours on a ring, not with every node; dropouts
during the protocol still close the round with the survivors' sum, bit for bit the in-process
arithmetic, and a round closes only while every node keeps ``threshold`` of its neighbours.

Flower's messages in process (:class:`hiso.flower.loopback.LoopbackGrid`), as tests/test_secagg.py."""

from __future__ import annotations

import uuid

import pytest

from hiso.config import RunConfig
from hiso.runners.rundir import run_to_dir

pytest.importorskip("flwr", reason="the flower extra is not installed")
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402

from hiso.flower.loopback import LoopbackGrid  # noqa: E402
from test_secagg import CFG, STAGES, _records, _settings, task_identity  # noqa: E402,F401

NODES = {100 + p: p for p in range(6)}
SPARSE = {**CFG, "clients": 6, "sampled": 6, "rounds": 3, "secagg_shares": 3}


def _serve(cfg, grid, out, monkeypatch, plain=False):
    """Run ``cfg`` over ``grid`` into ``out``: the SecAgg+ ServerApp, or (``plain``) the plain one,
    which sees every answer and applies the same quantisation and the same server arithmetic."""
    import hiso.flower.secagg as sa
    from hiso.flower.app import FlowerFederation, serve
    with monkeypatch.context() as m:
        if plain:
            m.setattr(sa, "SecAggFederation", FlowerFederation)
        serve(grid, cfg, _settings(out))


def _neighbours_seen(grid) -> list[int]:
    """For each share-keys answer the ServerApp pulled: how many nodes the node sent shares to."""
    return [len(r.content.config_records[RECORD_KEY_CONFIGS][Key.DESTINATION_LIST]) for r in grid.pulled
            if not r.has_error() and Key.DESTINATION_LIST in r.content.config_records.get(RECORD_KEY_CONFIGS, {})]


def test_secagg_shares_config_defaults_and_refusals():
    """The threshold defaults to a majority of the shares (at least 2), must stay below them (as
    Flower's workflow requires) and the shares must be odd (the ring holds a node and shares // 2
    neighbours either side; an even count makes Flower's workflow split a secret in fewer shares
    than neighbours)."""
    assert RunConfig(**SPARSE).secagg_threshold == 2
    assert RunConfig(**{**SPARSE, "clients": 64, "sampled": 64, "secagg_shares": 15}).secagg_threshold == 8
    assert RunConfig(**{**SPARSE, "secagg_shares": 9}).secagg_threshold == 4  # more shares than nodes: all of them
    for bad, needle in (({"secagg_shares": 4}, "must be odd"), ({"secagg_threshold": 3}, "below secagg_shares"),
                        ({"secagg_shares": 2}, "greater than or equal to 3"),
                        ({"secagg": False, "secagg_threshold": None}, "only with secagg")):
        with pytest.raises(ValueError, match=needle):
            RunConfig(**{**SPARSE, **bad})


@pytest.mark.parametrize("args,needle", [(["--secagg-shares", "4"], "must be odd"),
                                         (["--secagg-shares", "2"], "greater than or equal to 3"),
                                         (["--secagg-shares", "5", "--secagg-threshold", "5"], "below secagg_shares")])
def test_flower_cli_refuses_a_bad_secagg_shares_in_one_line(tmp_path, capsys, args, needle):
    from cli_helpers import run_cli
    code, _, err = run_cli(["flower", "--secagg", "--task", "quadratic", "--clients", "8", "--sampled", "8", "--out",
                            str(tmp_path / "r"), *args], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("stage", [None, *STAGES])
def test_sparse_secagg_round_closes_when_a_node_drops(tmp_path, task_identity, monkeypatch, stage):
    """6 nodes, 3 shares each (the node and its two ring neighbours), threshold 2: node 102 stops
    answering at ``stage`` of round 1 and the round closes without being planned again. Every
    node sent its shares to its 2 neighbours, not to 5 nodes. Before it trained, the round is the five survivors'
    sum: the log equals a plain ServerApp's with that node dead in round 1; after it sent its
    masked vector (unmask) its answer is in the sum, and the log equals the in-process
    simulator's, bit for bit (as it does with no dropout)."""
    cfg = RunConfig(**SPARSE)
    grid = LoopbackGrid(cfg, tmp_path / "replicas", NODES)
    if stage:
        grid.drop_at[102] = (1, stage)
    _serve(cfg, grid, tmp_path / "flower", monkeypatch)
    recs = _records(tmp_path / "flower")
    seen = _neighbours_seen(grid)  # (a node dropped at setup leaves its two neighbours one each)
    assert len(seen) == 6 * 3 - (stage in ("setup", "share_keys")) and seen.count(1) == 2 * (stage == "setup")
    assert set(seen) <= {1, 2}
    dropped = stage not in (None, "unmask")
    everyone = tuple(range(6))
    assert [r[2] for r in recs] == [everyone, (0, 1, 3, 4, 5) if dropped else everyone, everyone]
    assert all(r[1] == 0 for r in recs)  # no round was planned again
    if not dropped:
        run_to_dir(cfg, tmp_path / "sim")
        assert recs == _records(tmp_path / "sim")
        return

    class Dead(LoopbackGrid):  # the reference: node 102 never answers round 1's training
        def push_messages(self, msgs):  # (ids in the order of msgs, as a grid returns them)
            msgs = list(msgs)
            lost = [m.metadata.dst_node_id == 102 and m.metadata.message_type == "train"
                    and m.metadata.group_id == "1" for m in msgs]
            sent = iter(super().push_messages([m for m, x in zip(msgs, lost) if not x]))
            return [uuid.uuid4().hex if x else next(sent) for x in lost]

    _serve(cfg, Dead(cfg, tmp_path / "ref-replicas", NODES), tmp_path / "ref", monkeypatch, plain=True)
    assert recs == _records(tmp_path / "ref")


def test_sparse_secagg_needs_the_threshold_in_every_neighbourhood(tmp_path, task_identity, monkeypatch):
    """Two neighbours on the ring (here unshuffled: nodes 100..105 in order) drop while training:
    each has one live neighbour left, below the threshold of 2, so no sum can be unmasked and the
    round is planned again (attempt 1), though 4 of 6 answered. With every node sharing with every
    other (no secagg_shares, threshold 2) the same dropouts close the round with the four."""
    import flwr.server.workflow.secure_aggregation.secaggplus_workflow as wf
    monkeypatch.setattr(wf.random, "shuffle", lambda x: x.sort())  # the ring in node order
    drops = {101: (1, "collect_masked_vectors"), 102: (1, "collect_masked_vectors")}
    for name, extra, want in (("sparse", {}, [(0, tuple(range(6))), (1, tuple(range(6)))]),
                              ("full", {"secagg_shares": None, "secagg_threshold": 2},
                               [(0, tuple(range(6))), (0, (0, 3, 4, 5))])):
        cfg = RunConfig(**{**SPARSE, "rounds": 2, **extra})
        grid = LoopbackGrid(cfg, tmp_path / name / "replicas", NODES)
        grid.drop_at.update(drops)
        _serve(cfg, grid, tmp_path / name / "flower", monkeypatch)
        assert [(r[1], r[2]) for r in _records(tmp_path / name / "flower")] == want, name
