"""The per-node worker (hiso.flower.worker) behind the thin relay ClientApp (hiso.flower.relay)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import run_within, wait_until
from hiso.config import RunConfig
from hiso.core import ModelState, Server, decode_uplink, encode_downlink
from hiso.flower.replica import Replica, run_key
from hiso.tasks.registry import build_task

pytest.importorskip("flwr", reason="the flower extra is not installed")

from hiso.flower.relay import forward  # noqa: E402
from hiso.flower.worker import Worker  # noqa: E402

pytestmark = pytest.mark.flower  # pytest -m flower

CFG = dict(task="quadratic", algorithm="hiso", clients=3, sampled=2, local_steps=2, perturbations=3, dim=40,
           lr=0.05, threads=1, rounds=10, seed=4)


def serving_worker(tmp_path) -> tuple[Worker, str]:
    """A worker serving on a Unix socket in ``tmp_path`` (a daemon thread), once it listens."""
    sock = str(tmp_path / "w.sock")
    worker = Worker()
    threading.Thread(target=worker.serve, args=(sock,), daemon=True).start()
    wait_until((tmp_path / "w.sock").exists, "the worker's socket", 10, poll=0.01)
    return worker, sock


def test_flower_worker_keeps_replicas_open_and_in_step(tmp_path):
    """Rounds through the relay's forward() to a worker on a Unix socket, with lost replies:
    every answer is what the plain ClientApp handler would give, the worker builds each
    partition's state once, and the replicas on disk stay bit-identical to the server."""
    from hiso.flower.app import train_fields
    cfg = RunConfig(**CFG)
    cfg_json = cfg.model_dump_json()
    worker, sock = serving_worker(tmp_path)
    task = build_task(cfg)
    server = Server(3, 2, cfg.local_steps, cfg.perturbations, seed=cfg.seed)
    ref = ModelState(task.build_model(), cfg.zo())
    nc = lambda pid: {"partition-id": pid, "state-dir": str(tmp_path / "w"), "worker-socket": sock}  # noqa: E731
    assert forward(nc(1), {"hiso-config": cfg_json}, 1, {"lineage": "L"}, "query") == {"partition": 1, "round": 0}
    for r in range(8):
        plan = server.plan()
        ups = []
        for pid in plan.participants:
            down = encode_downlink(server.downlink(pid), server.wire)
            got = forward(nc(pid), {"hiso-config": cfg_json}, 1, {"down": down, "lineage": "L"}, "train")
            plain = train_fields(cfg, "L", pid, str(tmp_path / "plain"), down, cfg_json)  # a fresh process's answer
            assert got == plain
            if not (pid == 2 and r % 3 == 1):  # partition 2's answer is lost now and then
                ups.append(decode_uplink(got["up"], server.wire))
        rec = server.aggregate(ups, partial=True)
        ref.apply(rec)
    assert len(worker.open) == 3  # one open state per partition, built once
    for pid in range(3):
        st = ModelState(task.build_model(), cfg.zo())
        rep = Replica.open(tmp_path / "w", run_key(cfg_json, "L"), pid, st)
        assert rep.reset_reason is None
        rep.state.replay(server.history[rep.state.round:])
        assert all(torch.equal(a, b) for a, b in zip(rep.state.params, ref.params))
        assert all(torch.equal(a, b) for a, b in zip(rep.state.h, ref.h))
    with pytest.raises(RuntimeError, match="worker: "):  # a worker error becomes the ClientApp's error
        forward(nc(0), {"hiso-config": cfg_json}, 1, {"down": b"garbage", "lineage": "L"}, "train")


def test_flower_relay_imports_neither_torch_nor_the_core():
    import sys
    code = ("import sys, hiso.flower.relay; bad = [m for m in ('torch', 'hiso.core') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = run_within([sys.executable, "-c", code], 120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_worker_socket_appears_only_once_it_listens(tmp_path, monkeypatch):
    """A relay that finds the socket's path connects (no refusal between bind and listen)."""
    import socket as so
    real = so.socket.listen

    def slow_listen(self, *a):
        time.sleep(0.3)
        return real(self, *a)

    monkeypatch.setattr(so.socket, "listen", slow_listen)
    sock = tmp_path / "w.sock"
    threading.Thread(target=Worker().serve, args=(str(sock),), daemon=True).start()
    wait_until(sock.exists, "the worker's socket", 10, poll=0.005)
    c = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    c.connect(str(sock))
    c.close()
    assert [p.name for p in tmp_path.iterdir()] == ["w.sock"]  # no temporary path left behind
