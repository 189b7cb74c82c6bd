"""Several partitions on one SuperNode, round timeouts from the measured rounds, the join wait
as an option, and what ``hiso flower`` prints while it runs: in process (Flower's real
messages through :class:`hiso.flower.loopback.LoopbackGrid`, the relay to a worker on a Unix
socket), no Flower process."""

from __future__ import annotations

import json

import pytest
import torch

from hiso.config import RunConfig
from hiso.runners.rundir import rebuild, run_to_dir

pytest.importorskip("flwr", reason="the flower extra is not installed")

from hiso.flower import timeouts  # noqa: E402
from hiso.flower.loopback import LoopbackGrid, server_task  # noqa: E402
from hiso.flower.parts import joint_answer, message_partition, node_partitions, split_answer, spread  # noqa: E402

pytestmark = pytest.mark.flower

CFG = dict(task="quadratic", algorithm="hiso", clients=4, sampled=2, local_steps=2, perturbations=3, dim=40,
           lr=0.05, eval_every=2, threads=1, rounds=5, seed=6)


def _settings(out, **kw):
    from hiso.flower.app import Settings
    return Settings(out_dir=str(out), **{"round_timeout": 5, "poll_s": 0.0, "suspect_grace_s": 0.0, **kw})


def test_node_partitions_from_the_node_config():
    assert node_partitions({"partition-id": 3}) == [3]
    assert node_partitions({"partition-id": "1,3"}) == [1, 3]
    assert spread(4, 2) == [[0, 2], [1, 3]] and spread(3, 3) == [[0], [1], [2]]
    for bad in ({}, {"partition-id": "1,x"}, {"partition-id": "1,1"}, {"partition-id": -1}):
        with pytest.raises(ValueError):
            node_partitions(bad)
    assert message_partition({"partition-id": "1,3"}, {"partition": 3}) == 3
    assert message_partition({"partition-id": 2}, {}) == 2
    with pytest.raises(ValueError, match="must name its partition"):
        message_partition({"partition-id": "1,3"}, {})
    with pytest.raises(ValueError, match="serves"):
        message_partition({"partition-id": "1,3"}, {"partition": 2})
    one = [{"partition": 1, "round": 0, "hello": b"a"}, {"partition": 3, "round": 2, "hello": b"b"}]
    assert split_answer(joint_answer(one)) == one and joint_answer(one[:1]) == one[0]


@pytest.mark.parametrize("algorithm", ["hiso", "fedkseed"])
def test_several_partitions_per_node_match_the_simulator(tmp_path, algorithm):
    """Two nodes serving two partitions each (the real ClientApp, each message naming its
    partition): the run directory is the simulator's bit for bit, and hiso rebuild agrees."""
    from hiso.flower.app import serve
    cfg = RunConfig(**{**CFG, "algorithm": algorithm, **({"perturbations": 1} if algorithm == "fedkseed" else {})})
    grid = LoopbackGrid(cfg, tmp_path / "replicas", {11: [0, 2], 12: [1, 3]})
    with server_task():
        serve(grid, cfg, _settings(tmp_path / "flower"))
    run_to_dir(cfg, tmp_path / "sim")
    a = torch.load(tmp_path / "flower" / "model.pt", weights_only=False)
    b = torch.load(tmp_path / "sim" / "model.pt", weights_only=False)
    assert a["round"] == 5 and all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    rows = [[{k: v for k, v in json.loads(x).items() if k != "wall_s" and not k.startswith("client_")}
             for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("flower", "sim")]
    assert rows[0] == rows[1]  # the same losses and protocol bytes
    flower = json.loads((tmp_path / "flower" / "flower.json").read_text())["flower"]
    assert flower["partitions_seen"] == [0, 1, 2, 3]
    assert {p for t in flower["timings"] for p in t["participants"]} == {0, 1, 2, 3}  # every partition answered
    if algorithm == "hiso":
        state, _ = rebuild(tmp_path / "flower")
        assert all(torch.equal(p, a["model"][n]) for n, p in state.named)


def test_the_join_waits_for_nodes_not_partitions(tmp_path):
    """min_nodes counts nodes: the first node's two partitions do not stand for the second node
    (whose join answer comes later, as a node loading its model answers late)."""
    from hiso.flower.app import FlowerFederation
    from hiso.tasks.registry import build_task

    class Late(LoopbackGrid):
        pulls = 0

        def pull_messages(self, ids):
            self.pulls += 1
            held = {i for i in ids if i in self.replies and self.replies[i].metadata.src_node_id == 12}
            return super().pull_messages(set(ids) - held if self.pulls < 5 else ids)

    cfg = RunConfig(**CFG)
    grid = Late(cfg, tmp_path / "replicas", {11: [0, 2], 12: [1, 3]})
    with server_task():
        fed = FlowerFederation(grid, build_task(cfg), cfg, _settings(tmp_path, min_nodes=2, wait_nodes_s=30))
        fed.wait_for_nodes()
    assert grid.pulls >= 5 and fed.node_of == {0: 11, 2: 11, 1: 12, 3: 12}
    assert fed.parts_of == {11: {0, 2}, 12: {1, 3}}


def test_a_node_of_several_partitions_through_the_relay_and_worker(tmp_path):
    """The relay asks the worker once per partition for the join and forwards each train
    message to the partition it names."""
    from hiso.core import Server, encode_downlink
    from hiso.flower.app import train_fields
    from hiso.flower.relay import forward
    from test_flower_worker import serving_worker
    cfg = RunConfig(**CFG)
    cfg_json = cfg.model_dump_json()
    worker, sock = serving_worker(tmp_path)
    nc = {"partition-id": "1,3", "state-dir": str(tmp_path / "w"), "worker-socket": sock}
    rc = {"hiso-config": cfg_json}
    assert forward(nc, rc, 1, {"lineage": "L"}, "query") == {"partitions": [1, 3], "rounds": [0, 0]}
    server = Server(4, 4, cfg.local_steps, cfg.perturbations, seed=cfg.seed)
    server.plan()
    for pid in (1, 3):
        down = encode_downlink(server.downlink(pid), server.wire)
        got = forward(nc, rc, 1, {"down": down, "lineage": "L", "partition": pid}, "train")
        assert got == train_fields(cfg, "L", pid, str(tmp_path / "plain"), down, cfg_json)
    assert sorted(k[1] for k in worker.open) == [1, 3]
    with pytest.raises(ValueError, match="must name its partition"):
        forward(nc, rc, 1, {"down": down, "lineage": "L"}, "train")


def test_round_timeout_from_the_measured_rounds(tmp_path, monkeypatch):
    """Without --round-timeout, round 1 waits up to a bound scaled with a model load, every later
    round ROUND_FACTOR times the slowest of the last rounds every node answered; an explicit
    value stays fixed."""
    from hiso.flower.app import FlowerFederation
    from hiso.tasks.registry import build_task
    clock = timeouts.RoundTimeout(None, load_s=30.0, partitions_per_node=2)
    assert clock.now() == timeouts.FIRST_ROUND_LOADS * 60.0  # 20 loads of 30 s, 2 partitions a node
    clock.observe(100.0, complete=False)  # a round cut short by its timeout tells nothing
    assert clock.now() == clock.first
    clock.observe(20.0, complete=True)
    assert clock.now() == 100.0
    for _ in range(timeouts.WINDOW):
        clock.observe(1.0, complete=True)
    assert clock.now() == timeouts.ROUND_MIN_S  # the slow round left the window
    assert timeouts.RoundTimeout(7.5).now() == 7.5
    assert timeouts.RoundTimeout(None).now() == timeouts.FIRST_ROUND_MIN_S

    monkeypatch.setattr(timeouts, "ROUND_MIN_S", 0.0)
    cfg = RunConfig(**CFG)
    grid = LoopbackGrid(cfg, tmp_path / "replicas", {11: [0, 2], 12: [1, 3]})
    with server_task():
        fed = FlowerFederation(grid, build_task(cfg), cfg, _settings(tmp_path, round_timeout=None, load_s=20.0,
                                                                     min_nodes=2))
        assert fed.round_timeout == max(timeouts.FIRST_ROUND_MIN_S, timeouts.FIRST_ROUND_LOADS * 2 * fed.load_s)
        fed.wait_for_nodes()
        fed.step()
        measured = fed.timings[-1]["send_and_receive_s"]
        assert fed.round_timeout == pytest.approx(timeouts.ROUND_FACTOR * measured)
        assert fed._message({}, 11, "train").metadata.ttl == pytest.approx(fed.round_timeout)
        grid = LoopbackGrid(cfg, tmp_path / "replicas2", {11: [0, 2], 12: [1, 3]})
        fixed = FlowerFederation(grid, build_task(cfg), cfg, _settings(tmp_path, round_timeout=4.0))
        fixed.wait_for_nodes()
        fixed.step()
        assert fixed.round_timeout == 4.0


def test_join_wait_is_an_option_and_scales_with_a_model_load(tmp_path, monkeypatch, capsys):
    from cli_helpers import run_cli
    from hiso.flower.app import FlowerFederation
    from hiso.tasks.registry import build_task
    assert timeouts.join_wait(None, 0.0) == timeouts.JOIN_MIN_S
    assert timeouts.join_wait(None, 10.0, 2) == timeouts.JOIN_MIN_S + timeouts.JOIN_LOADS * 20.0
    assert timeouts.join_wait(5.0, 10.0, 2) == 5.0
    cfg = RunConfig(**CFG)
    auto = FlowerFederation(None, build_task(cfg), cfg, _settings(tmp_path, wait_nodes_s=None, load_s=12.0,
                                                                  min_nodes=2))
    assert auto.join_wait == timeouts.join_wait(None, auto.load_s, 2) > timeouts.JOIN_MIN_S + 200
    empty = LoopbackGrid(cfg, tmp_path / "replicas", {})
    with server_task():
        fed = FlowerFederation(empty, build_task(cfg), cfg, _settings(tmp_path, wait_nodes_s=0.2))
        with pytest.raises(RuntimeError, match=r"no node connected within 0.2 s \(--join-timeout"):
            fed.wait_for_nodes()

    import hiso.flower.launch as launch
    real, seen = launch.run_local, {}
    monkeypatch.setattr(launch, "run_local", lambda *a, **kw: seen.update(kw) or (_ for _ in ()).throw(
        launch.FlowerRunError("stop here")))
    base = ["flower", "--task", "quadratic", "--clients", "4", "--sampled", "2", "--nodes", "2"]
    code, _, err = run_cli([*base, "--join-timeout", "0", "--out", str(tmp_path / "r0")], capsys)
    assert code == 2 and "--join-timeout must be a positive" in err
    code, out, err = run_cli([*base, "--join-timeout", "900", "--out", str(tmp_path / "r1")], capsys)
    assert code == 2 and "stop here" in err
    assert seen["join_timeout"] == 900.0 and seen["round_timeout"] is None and seen["worker"] is False
    assert "2 SuperNodes serving 4 partitions" in out
    with pytest.raises(ValueError, match="each node serves one partition"):
        real(RunConfig(**{**CFG, "algorithm": "fedavg"}), tmp_path / "r3", 2)


def test_hiso_flower_prints_each_round_as_it_is_logged(tmp_path):
    from hiso.flower.follow import MetricsFollower, round_line
    import io
    out = io.StringIO()
    follow = MetricsFollower(tmp_path, 2, stream=out)
    follow.poll()
    rows = [{"round": 0, "train_loss": None, "bytes_up": 0, "bytes_down": 0, "wall_s": 0.0, "eval_acc": 0.5},
            {"round": 1, "train_loss": 0.71, "bytes_up": 76, "bytes_down": 180, "wall_s": 9.0}]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:10])  # the second row half written
    follow.poll()
    assert out.getvalue().splitlines() == [round_line(rows[0], 2)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    follow.poll()
    lines = out.getvalue().splitlines()
    assert lines[1] == "round 1/2: loss 0.71; 76 B up, 180 B down so far; 9.0 s" and len(lines) == 2
    assert "eval_acc 0.5" in lines[0]
