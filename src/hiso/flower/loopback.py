"""Flower's messages delivered in process (no SuperLink, no processes): a Grid whose nodes are
hiso's real ClientApp, each with its own Context kept between messages as a SuperNode keeps it.

For tests and for measuring what a protocol costs on top of the transport (SecAgg+'s stages:
``bench/flower_rounds.py secagg``), with every message Flower's own ``Message`` and every
record what would cross the network."""

from __future__ import annotations

import copy
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..config import RunConfig


@contextmanager
def server_task(run_id: int = 1):
    """Flower builds a Message only inside a task (ServerApp or ClientApp): play the ServerApp's."""
    from flwr.supercore.task_identity import TaskIdentity
    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = 1, run_id, 1
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


class LoopbackGrid:
    """Flower's Grid, delivering each real Message at once to the node's real ClientApp (hiso's,
    with the SecAgg+ mod; a copy, as if it crossed the network) under the node's own Context,
    kept between messages as a SuperNode keeps it; a ClientApp's exception comes back as
    Flower's error reply. A node can stop answering from a SecAgg+ stage on (``drop_at[node] =
    (round, stage)``: once, to the end of that attempt), and every reply the server pulls is
    kept (``pulled``). Use it inside :func:`server_task`."""

    def __init__(self, cfg: RunConfig, state_dir: Path, nodes: dict[int, int | list[int]]):
        from flwr.app import Context, RecordDict
        from .app import make_apps
        # the nodes never get the DP noise key (hiso.flower.records.noise_seed_refusal): the server keeps it
        _, self.app = make_apps(cfg.model_copy(update={"dp_noise_seed": None}))
        self.nodes = dict(nodes)  # node id -> partition, or list of partitions (hiso.flower.parts)
        self.contexts = {nid: Context(run_id=1, node_id=nid, node_config={
                             "partition-id": pid if isinstance(pid, int) else ",".join(map(str, pid)),
                             "state-dir": str(state_dir)},
                                      state=RecordDict(), run_config={}) for nid, pid in nodes.items()}
        self.drop_at: dict[int, tuple[int, str]] = {}
        self._gone: set[int] = set()
        self.replies, self.pulled = {}, []
        self.bytes: dict[str, list[int]] = {}  # message type -> bytes of its records [to nodes, back]

    def get_node_ids(self):
        return list(self.nodes)

    def _silent(self, nid, msg) -> bool:
        """Whether node ``nid`` ignores ``msg``: from its drop stage to the end of that attempt."""
        from .secagg_client import is_secagg
        if msg.metadata.message_type != "train" or not is_secagg(msg):
            return False
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage
        now = msg.content.config_records[RECORD_KEY_CONFIGS]["stage"]
        if now == Stage.SETUP:
            self._gone.discard(nid)  # back for the next attempt
        if self.drop_at.get(nid) == (int(msg.metadata.group_id), now):
            del self.drop_at[nid]
            self._gone.add(nid)
        return nid in self._gone

    def push_messages(self, msgs):
        from flwr.app import Error, Message
        from .secagg import payload_bytes
        ids = []
        for m in msgs:
            count = self.bytes.setdefault(m.metadata.message_type, [0, 0])
            count[0] += payload_bytes(m.content)
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            nid = m.metadata.dst_node_id
            if self._silent(nid, m):
                continue
            try:  # a copy, as if it crossed the network (the workflow sends one record to every node)
                rep = self.app(copy.deepcopy(m), self.contexts[nid])
            except Exception as e:  # as a SuperNode reports it
                rep = Message(Error(2, f"{type(e)}:<'{e}'>"), reply_to=m)
            if not rep.has_error():
                count[1] += payload_bytes(rep.content)
            self.replies[mid] = rep
        return ids

    def pull_messages(self, ids):
        out = [self.replies.pop(i) for i in list(ids) if i in self.replies]
        self.pulled += out
        return out
