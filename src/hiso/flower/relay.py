"""A thin ClientApp that forwards each message to the node's long-lived worker
(:mod:`hiso.flower.worker`). It imports Flower and the standard library only (no torch, no
hiso core), so the per-message ClientApp process costs Flower's runtime and nothing more.

The node names its worker in its node config: ``worker-socket='/path/worker.sock'`` (and
``partition-id``, ``state-dir`` as for the plain ClientApp). Scalar-only algorithms.
"""

from __future__ import annotations

import os
import socket
import time

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from .parts import joint_answer, message_partition, node_partitions
from .worker import recv_frame, send_frame

REC = "hiso"  # as hiso.flower.app.REC (not imported: that module imports torch)
DEFAULT_STATE_DIR = os.path.join(__import__("tempfile").gettempdir(), "hiso-flower-replicas")

client_app = ClientApp()


def _ask(node_config: dict, req: dict, payload: bytes) -> tuple[dict, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(node_config["worker-socket"]))
        send_frame(s, req, payload)
        header, out = recv_frame(s)
    if "error" in header:
        raise RuntimeError(f"worker: {header['error']}")
    return header, out


def forward(node_config: dict, run_config: dict, run_id, msg_fields: dict, kind: str) -> dict:
    """Send one message's fields to the worker named in ``node_config``; its answer's fields.
    A query (the join) of a node of several partitions asks the worker once per partition."""
    if "worker-socket" not in node_config:
        raise ValueError("this SuperNode has no worker: start it with --node-config \"worker-socket='PATH'\"")
    req = {"kind": kind, "cfg": run_config["hiso-config"],
           "trajectory": str(msg_fields["lineage"]) if "lineage" in msg_fields else run_id,
           "state_dir": str(node_config.get("state-dir", os.environ.get("HISO_FLOWER_STATE_DIR", DEFAULT_STATE_DIR))),
           "relay_cpu_s": time.process_time()}
    if kind == "query":  # the join: the server's welcome to every partition of the node
        answers = []
        for pid in node_partitions(node_config):
            header, payload = _ask(node_config, {**req, "partition": pid}, bytes(msg_fields.get("welcome", b"")))
            answers.append({**header, "hello": payload} if payload else header)
        return joint_answer(answers)
    req["partition"] = message_partition(node_config, msg_fields)
    header, payload = _ask(node_config, req, bytes(msg_fields["down"]))  # a train carries the downlink
    return {**header, "up": payload} if "behind" not in header else header


def _reply(msg, context, kind: str):
    fields = forward(context.node_config, context.run_config, context.run_id, dict(msg.content[REC]), kind)
    return Message(RecordDict({REC: ConfigRecord(fields)}), reply_to=msg)


@client_app.query()
def _query(msg, context):
    return _reply(msg, context, "query")


@client_app.train()
def _train(msg, context):
    return _reply(msg, context, "train")

