"""A long-lived per-node worker: the node's replicas stay open in memory between messages.

Flower (1.41, 1.42) starts a new ClientApp process for every message, which then imports torch and
hiso, builds the task and the model skeleton and maps the replica before it can answer. With
a worker, the node runs ``python -m hiso.flower.worker --socket PATH`` beside its SuperNode
(node config ``worker-socket=PATH``) and the ClientApp is :mod:`hiso.flower.relay`, which
imports neither torch nor hiso's core: it forwards the message's fields over a Unix socket
and returns the answer. The worker keeps, per (trajectory, partition), the task and the open
:class:`~hiso.flower.replica.Replica` (the same memory-mapped file, so a worker that dies,
or a node that goes back to the plain ClientApp, finds the replica where it was; a worker
killed mid-update leaves it marked dirty and it is reset, exactly as for a ClientApp).

Wire format on the socket (both ways): u32 length + JSON header, u64 length + payload bytes.
A request's header holds ``kind`` (query/train), ``cfg`` (the configuration text), ``trajectory``,
``partition`` and ``state_dir``; the payload is the downlink. The answer's header holds the
reply fields (``partition``/``round``, ``behind``, or ``error``); its payload is the uplink.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time

_H, _P = struct.Struct("<I"), struct.Struct("<Q")


def send_frame(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    h = json.dumps(header).encode()
    sock.sendall(_H.pack(len(h)) + h + _P.pack(len(payload)) + payload)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection mid-frame")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    (n,) = _H.unpack(_recv(sock, _H.size))
    header = json.loads(_recv(sock, n))
    (m,) = _P.unpack(_recv(sock, _P.size))
    return header, _recv(sock, m)


class Worker:
    """The node's open replicas and tasks, answering query and train requests."""

    def __init__(self):
        self.open: dict[tuple[str, int], tuple] = {}  # (replica key, partition) -> (task, replica, cfg)

    def _entry(self, cfg_json: str, trajectory, pid: int, state_dir: str):
        from ..config import RunConfig
        from .replica import run_key
        key = (run_key(cfg_json, trajectory), pid)
        if key not in self.open:
            from .client_app import open_replica
            cfg = RunConfig(**json.loads(cfg_json))
            if cfg.threads is not None:
                import torch
                torch.set_num_threads(cfg.threads)
            task, rep = open_replica(cfg, trajectory, pid, state_dir, cfg_json)
            self.open[key] = (task, rep, cfg)
        return self.open[key]

    def handle(self, req: dict, payload: bytes) -> tuple[dict, bytes]:
        from .client_app import _note_timing, answer_open
        t0 = time.perf_counter()
        task, rep, cfg = self._entry(req["cfg"], req["trajectory"], int(req["partition"]), req["state_dir"])
        pid = int(req["partition"])
        if req["kind"] == "query":  # the join: check the welcome, keep it, answer a hello
            from .client_app import accept_welcome
            hello = accept_welcome(cfg, task, rep, payload, pid) if payload else b""
            return {"partition": pid, "round": rep.state.round}, hello
        t1 = time.perf_counter()
        up = answer_open(cfg, task, rep, pid, payload)
        if up is None:
            return {"behind": rep.state.round}, b""
        t2 = time.perf_counter()
        _note_timing(rep.path, {"round": rep.state.round, "worker": True, "open_s": t1 - t0, "handle_s": t2 - t1,
                                "up_bytes": len(up), "down_bytes": len(payload),
                                "relay_cpu_before_send_s": req.get("relay_cpu_s")})
        return {}, up

    def serve(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}~"  # the path appears only once the socket listens: a relay
        srv.bind(tmp)                    # that finds it never meets a refused connection
        srv.listen(8)
        os.replace(tmp, path)
        while True:
            conn, _ = srv.accept()
            with conn:
                try:
                    req, payload = recv_frame(conn)
                    try:
                        header, out = self.handle(req, payload)
                    except Exception as e:  # noqa: BLE001 - the relay turns it into a Flower error reply
                        header, out = {"error": f"{type(e).__name__}: {e}"}, b""
                    send_frame(conn, header, out)
                except (ConnectionError, OSError, ValueError):
                    continue


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hiso.flower.worker", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, help="Unix socket path (the node config's worker-socket)")
    args = p.parse_args(argv)
    Worker().serve(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
