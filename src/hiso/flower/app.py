"""The Flower ServerApp and ClientApp over hiso's core (scalar-only algorithms: HiSo, DeComFL).

Server side, each round: plan (the core's seeded sample over all ``clients`` partitions),
send every sampled partition that has a connected node its encoded downlink in a ``train``
message, wait at most ``round-timeout`` seconds, and aggregate the valid uplinks that came
back (``Server.aggregate(partial=True)``): a dead, slow or garbled node does not stop the
round. A sampled partition with no connected node simply does not answer. A round nobody
answered is planned again (fresh seeds). The run directory is the simulator's
(``metrics.jsonl``, ``history.bin``, ``summary.json``, ``model.pt``), written by
:func:`hiso.runners.rundir.run_to_dir`, so ``hiso rebuild`` works on it.

Nodes and partitions: a node names its partition in its node config (``partition-id=3``;
the simulation engine sets it by itself). The server asks every node it has not seen yet
(``query`` message) for its partition and the round its replica holds, so a restarted node
is picked up with a new node id and its history restarts where its replica stands.

Client side, each ``train`` message: open the node's memory-mapped replica
(:mod:`hiso.flower.replica`), let the core's :class:`~hiso.core.client.Client` decode, catch
up (skipping records it holds), run its local steps on its partition and encode the answer.
If the history starts after the replica's round (its disk copy was lost or reset), it answers
``behind=<round>`` instead and the server resends from there in the same round.

Message content (a ``ConfigRecord`` named ``hiso``): ``down`` (bytes) to a client;
``up`` (bytes) or ``behind`` (int) back; a query carries the server's ``welcome`` (bytes) and
its reply the node's ``hello`` (bytes), plus ``partition`` and ``round`` (ints): the protocol's
join, counted in the bytes; a node whose configuration or x_0 differs refuses it.
``lineage`` (str, in every query and train) names the run directory's trajectory, which keys
the node's replica, so a ServerApp resumed on the same directory finds the replicas in place.
The full-model baselines are in :mod:`hiso.flower.fullmodel` (ArrayRecords).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import RunConfig
from ..core.client import Client
from ..core.history import RoundRecord
from ..core.messages import (Hello, MessageError, Wire, check_welcome, decode_hello, decode_uplink, decode_welcome,
                             encode_downlink, encode_hello, encode_welcome, tensors_fingerprint, welcome_for)
from ..core.state import ModelState
from ..runners.common import Comm, metric_rows
from ..runners.simulate import protocol_server
from ..tasks.base import Task

log = logging.getLogger("hiso.flower")

REC = "hiso"  # name of the ConfigRecord that carries our fields
DEFAULT_STATE_DIR = os.path.join(tempfile.gettempdir(), "hiso-flower-replicas")


@dataclass
class Settings:
    """What the ServerApp needs besides the RunConfig (from the Flower run config)."""

    out_dir: str
    round_timeout: float = 30.0
    min_nodes: int = 0  # wait for this many nodes before round 1 (0: as many as partitions)
    wait_nodes_s: float = 60.0
    max_replans: int = 20  # consecutive rounds with no answer before the run fails
    suspect_grace_s: float = 2.0  # how long a node that missed its last answer is waited for
    poll_s: float = 0.1  # how often replies are pulled from the SuperLink
    resume: bool = False  # out_dir holds an interrupted run of this config: continue it


def _records(content):
    from flwr.app import ConfigRecord, RecordDict
    return RecordDict({REC: ConfigRecord(content)})


@lru_cache(maxsize=4)
def _task_for(cfg_json: str) -> Task:
    from ..tasks.registry import build_task
    return build_task(RunConfig(**json.loads(cfg_json)))


# --------------------------------------------------------------------------------- server


@dataclass
class FlowerFederation:
    """A runner with the simulator's interface (``run``, ``comm``, ``state_dict``) over a Grid."""

    grid: object
    task: Task
    cfg: RunConfig
    settings: Settings
    on_record: Callable[[RoundRecord], None] | None = None
    node_of: dict[int, int] = field(default_factory=dict)  # partition -> node id
    part_of: dict[int, int] = field(default_factory=dict)  # node id -> partition
    timings: list[dict] = field(default_factory=list)  # per round: where the time went
    lineage: str = ""  # the run directory's trajectory id: nodes key their replicas by it (resume)

    def __post_init__(self) -> None:
        self.zo = self.cfg.zo()
        M = self.task.num_clients
        self.state = ModelState(self.task.build_model(), self.zo)
        self.server = protocol_server(self.task, self.zo, self.cfg.sampled, self.cfg.seed, self.cfg.weighted,
                                      self.state, self.cfg.snapshot_after, self.cfg.bandwidth,
                                      self.cfg.aggregate, self.cfg.trim, noise_seed=self.cfg.dp_noise_seed)
        self.welcome = encode_welcome(welcome_for(self.zo, self.cfg.seed, self.state.params))
        self.comm = Comm.zeros(M)
        self._seen: set[int] = set()
        self._suspects: set[int] = set()  # node ids that missed their last answer
        self._queries: dict[str, int] = {}  # query message id -> node id, awaiting a reply

    def _message(self, fields: dict, node_id: int, kind: str, group: str | None = None):
        from flwr.app import Message
        return Message(_records(fields), dst_node_id=node_id, message_type=kind, group_id=group)

    def _lineage_field(self) -> dict:
        return {"lineage": self.lineage} if self.lineage else {}

    # -- nodes
    def refresh_nodes(self) -> None:
        """Ask every node not seen yet for its partition and its replica's round (non-blocking:
        a query is sent once per node; replies are collected whenever this is called)."""
        ids = set(self.grid.get_node_ids())
        for nid in list(self.part_of):
            if nid not in ids:  # gone
                pid = self.part_of.pop(nid)
                if self.node_of.get(pid) == nid:
                    del self.node_of[pid]
        self._queries = {m: n for m, n in self._queries.items() if n in ids}
        new = sorted(ids - self._seen - set(self._queries.values()))
        if new:
            join = {"welcome": self.welcome} if getattr(self, "welcome", None) is not None else {}
            msgs = [self._message({**join, **self._lineage_field()}, nid, "query") for nid in new]
            self._queries.update(zip(self.grid.push_messages(msgs), new))
        if not self._queries:
            return
        for rep in self.grid.pull_messages(set(self._queries)):
            nid = self._queries.pop(rep.metadata.reply_to_message_id, None)
            if nid is None:
                continue
            self._seen.add(nid)
            if rep.has_error():
                log.warning("node %s failed the query: %s", nid, rep.error.reason)
                continue
            rec = rep.content[REC]
            try:  # the node's join: its hello (it checked our welcome before answering)
                if getattr(self, "welcome", None) is not None:
                    hello = decode_hello(rec["hello"])
                    pid, held = hello.client, hello.round
                else:  # full-model baselines: no join, the node names its partition
                    pid, held = int(rec["partition"]), int(rec["round"])
            except (KeyError, ValueError, MessageError) as e:
                log.warning("node %s: no valid hello (%s): ignored", nid, e)
                continue
            if not 0 <= pid < self.task.num_clients:
                log.warning("node %s names partition %s, outside 0..%s: ignored", nid, pid, self.task.num_clients - 1)
                continue
            old = self.node_of.get(pid)
            if old is not None and old != nid:
                log.warning("partition %s moves from node %s to node %s", pid, old, nid)
                self.part_of.pop(old, None)
            self.node_of[pid], self.part_of[nid] = nid, pid
            if getattr(self, "welcome", None) is not None:
                self.comm.join(pid, rec["hello"], self.welcome)
            self.server.client_holds(pid, min(held, self.server.round))

    def wait_for_nodes(self) -> None:
        want = self.settings.min_nodes or self.task.num_clients
        t_end = time.monotonic() + self.settings.wait_nodes_s
        while True:
            self.refresh_nodes()
            if len(self.node_of) >= want:
                return
            if time.monotonic() > t_end:
                if not self.node_of:
                    raise RuntimeError(f"no node connected within {self.settings.wait_nodes_s} s")
                log.warning("only %d of %d nodes connected; going on", len(self.node_of), want)
                return
            time.sleep(self.settings.poll_s)

    # -- one round
    def _send(self, rnd: int, pids) -> dict[int, object]:
        """Downlinks to ``pids`` (those with a node); the replies by partition."""
        msgs = []
        for pid in pids:
            nid = self.node_of.get(pid)
            if nid is None:
                continue
            down = encode_downlink(self.server.downlink(pid), self.server.wire)
            self.comm.down[pid] += len(down)
            msgs.append(self._message({"down": down, **self._lineage_field()}, nid, "train", str(rnd)))
        out = {}
        for rep in self._exchange(msgs):
            pid = self.part_of.get(rep.metadata.src_node_id)
            if pid is None:
                continue
            if rep.has_error():
                log.warning("round %d: partition %d failed: %s", rnd, pid, rep.error.reason)
                continue
            out[pid] = rep.content[REC]
        return out

    def _exchange(self, msgs: list) -> list:
        """Push ``msgs`` and pull their replies until all came back or time is up.

        Like ``Grid.send_and_receive`` but polls every ``poll_s`` (Flower's polls every 3 s) and
        does not wait ``round_timeout`` for *suspects* (nodes that missed their last answer)
        once every healthy node has answered: they get ``suspect_grace_s`` more (if all are
        suspects, all get the full ``round_timeout``). A node that answers is healthy again.
        """
        if not msgs:
            return []
        st = self.settings
        dst = {}
        ids = list(self.grid.push_messages(msgs))
        for mid, m in zip(ids, msgs):
            dst[mid] = m.metadata.dst_node_id
        pending, out = set(ids), []
        t_end = time.monotonic() + st.round_timeout
        grace_end = None
        any_healthy = any(d not in self._suspects for d in dst.values())  # else: all get the full time
        while pending:
            reps = list(self.grid.pull_messages(pending))
            for rep in reps:
                mid = rep.metadata.reply_to_message_id
                if mid in pending:
                    pending.discard(mid)
                    out.append(rep)
            now = time.monotonic()
            if not pending or now > t_end:
                break
            if any_healthy and all(dst[m] in self._suspects for m in pending):
                grace_end = grace_end or now + st.suspect_grace_s
                if now > grace_end:
                    break
            time.sleep(st.poll_s)
        for m in pending:
            self._suspects.add(dst[m])
        for rep in out:
            self._suspects.discard(rep.metadata.src_node_id)
        return out

    def step(self) -> float:
        for _ in range(self.settings.max_replans + 1):
            t0 = time.perf_counter()
            self.refresh_nodes()
            t1 = time.perf_counter()
            plan = self.server.plan()
            replies = self._send(plan.round, plan.participants)
            behind = [pid for pid, r in replies.items() if "behind" in r]
            for pid in behind:  # its replica is older than we thought: resend from its round
                self.server.client_holds(pid, int(replies[pid]["behind"]))
            if behind:
                replies.update(self._send(plan.round, behind))
            t2 = time.perf_counter()
            ups = []
            for pid, r in replies.items():
                if "up" not in r:
                    continue
                data = r["up"]
                self.comm.up[pid] += len(data)
                try:
                    up = decode_uplink(data, self.server.wire, expect_round=plan.round)
                except MessageError as e:
                    log.warning("round %d: dropped the answer of partition %d: %s", plan.round, pid, e)
                    continue
                if up.client != pid:
                    log.warning("round %d: node of partition %d answered for client %d: dropped", plan.round, pid, up.client)
                    continue
                ups.append(up)
            rec = self.server.aggregate(ups, partial=True)
            for why in self.server.rejected:
                log.warning("round %d: %s", plan.round, why)
            if rec is None:
                log.warning("round %d: no valid answer from %s; planning it again", plan.round, list(plan.participants))
                continue
            self.state.apply(rec)
            if self.on_record is not None:
                self.on_record(rec)
            t3 = time.perf_counter()
            self.timings.append({"round": rec.round, "nodes_s": t1 - t0, "send_and_receive_s": t2 - t1,
                                 "aggregate_apply_s": t3 - t2, "participants": list(rec.participants),
                                 "sampled": list(plan.participants)})
            return float(np.mean([u.loss for u in ups if u.loss is not None] or [np.nan]))
        raise RuntimeError(f"round {self.server.round}: no client answered in {self.settings.max_replans + 1} attempts")

    # -- the simulator's interface
    def run(self, rounds: int, start: int = 0, wall: float = 0.0):
        self.wait_for_nodes()
        return metric_rows(self.task, self.state.model, self.comm, self.step, rounds, self.cfg.eval_every,
                           start=start, wall=wall)

    def resume(self, records: list[RoundRecord]) -> None:
        """Bring a new ServerApp to the end of an interrupted run's log (``run_to_dir(resume=
        True)``): the server draws each logged round's sample and seeds again (checked against
        the log; rounds the run planned again are skipped as it did), closes it with the logged
        record, and the model and H replay it. Bytes are counted as if every sampled
        partition had a node (what the log can tell). Nodes report the round their replica
        holds when they are queried, so each one's next downlink starts there."""
        from ..core.messages import Uplink, encode_uplink
        wire = self.server.wire
        if self.server.round:
            raise RuntimeError("resume() needs a federation that has not run yet")
        for rec in records:
            plan = self.server.plan_logged(rec)
            for cid in plan.participants:
                self.comm.down[cid] += len(encode_downlink(self.server.downlink(cid), wire))
                if cid in rec.participants:
                    self.comm.up[cid] += len(encode_uplink(Uplink(cid, rec.round, rec.scalars, 0.0, rec.attempt), wire))
            self.server.close_logged(rec)
            self.state.apply(rec)

    @property
    def model(self):
        return self.state.model

    def state_dict(self) -> dict:
        return self.state.state_dict()


def serve(grid, cfg: RunConfig, settings: Settings) -> dict:
    """The ServerApp's body: run ``cfg`` over the grid into ``settings.out_dir``."""
    if not cfg.scalar_only:  # the full-model baselines: models and updates in ArrayRecords
        from .fullmodel import serve_full
        return serve_full(grid, cfg, settings)
    task = _task_for(cfg.model_dump_json())
    holder = {}

    before = _earlier_attempts(settings) if settings.resume else []
    lineage = _lineage(settings)

    def factory(cfg_, task_, on_record=None):
        holder["fed"] = FlowerFederation(grid, task_, cfg_, settings, on_record, lineage=lineage)
        return holder["fed"]

    from ..runners.rundir import run_to_dir

    summary = run_to_dir(cfg, settings.out_dir, task=task, runner=factory, resume=settings.resume)
    fed = holder["fed"]
    extra = {"flower": {"rounds_replanned": fed.server.replanned, "timings": fed.timings,
                        "partitions_seen": sorted(fed.node_of), "earlier_attempts": before}}
    Path(settings.out_dir, "flower.json").write_text(json.dumps(extra, indent=1))
    if summary.get("diverged"):
        raise RuntimeError(f"run diverged: {summary['diverged']}")
    return summary


def _lineage(settings: Settings) -> str:
    """The run directory's trajectory id (``DIR/flower-lineage``): new for a new run, the same
    for a resumed one. Nodes key their replicas by it instead of the Flower run id, so a
    ServerApp that is restarted on the run directory finds every replica where it was (each
    holds a round the log kept: a round's records reach a node only after its metrics row is
    written, and resume keeps every round that has one) instead of replaying from x_0."""
    import secrets
    path = Path(settings.out_dir, "flower-lineage")
    if settings.resume and path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    path.write_text(token + "\n")
    return token


def _earlier_attempts(settings: Settings) -> list:
    """A resumed run's record of the attempts before it (``flower.json``, if the dead
    ServerApp got to write one), kept beside the new attempt's timings."""
    try:
        old = json.loads(Path(settings.out_dir, "flower.json").read_text())["flower"]
    except (OSError, ValueError, KeyError):
        return []
    return [*old.pop("earlier_attempts", []), old]


# --------------------------------------------------------------------------------- client


def _process_start() -> float:
    """When this process started, on the perf_counter clock (Linux; else: module import)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.perf_counter() - (up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


_PROCESS_T0 = _process_start()


def _note_timing(path: Path, row: dict) -> None:
    """Where a ClientApp's time went, appended beside its replica (never sent on the wire)."""
    try:
        with open(path / "timings.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


def _partition(context) -> int:
    nc = context.node_config
    if "partition-id" not in nc:
        raise ValueError("this SuperNode has no partition: start it with --node-config 'partition-id=N'")
    return int(nc["partition-id"])


def _state_dir(context) -> str:
    return str(context.node_config.get("state-dir", os.environ.get("HISO_FLOWER_STATE_DIR", DEFAULT_STATE_DIR)))


def open_replica(cfg: RunConfig, run_id, partition: int, state_dir: str, cfg_json: str | None = None):
    """The node's replica for this run; ``cfg_json`` is the configuration text as the server
    sent it (default: ``cfg``'s own JSON)."""
    from .replica import Replica, run_key
    task = _task_for(cfg.model_dump_json())
    state = ModelState(task.build_model(), cfg.zo())
    rep = Replica.open(state_dir, run_key(cfg_json or cfg.model_dump_json(), run_id), partition, state)
    if rep.reset_reason:
        log.warning("partition %d: replica reset to x_0 (%s)", partition, rep.reset_reason)
    return task, rep


def _cfg_json(context) -> str | None:
    return context.run_config.get("hiso-config") if context.run_config else None


def query_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, cfg_json: str | None = None,
                 welcome: bytes | None = None) -> dict:
    """A node's answer to ``query`` (its join): its hello (partition and the round its replica
    holds), once it has checked the server's ``welcome`` against its own configuration and x_0
    (a mismatch raises :class:`~hiso.core.messages.JoinError`: the node refuses to mix). The
    welcome is kept beside the replica: it gives the run's seed to every later message.
    Full-model clients keep no replica: they answer their partition and round 0."""
    if not cfg.scalar_only:
        return {"partition": pid, "round": 0}
    task, rep = open_replica(cfg, run_id, pid, state_dir, cfg_json)
    held = rep.state.round
    try:
        if welcome is not None:
            accept_welcome(cfg, task, rep, welcome, pid)
    finally:
        rep.close()
    return {"partition": pid, "round": held, "hello": encode_hello(Hello(pid, held))}


def accept_welcome(cfg: RunConfig, task, rep, welcome: bytes, pid: int) -> bytes:
    """Check the server's welcome against this node's configuration and x_0 (JoinError on a
    mismatch), keep it beside the replica, and return the node's hello."""
    x0 = ModelState(task.build_model(), cfg.zo())
    check_welcome(decode_welcome(welcome), cfg.zo(), tensors_fingerprint(x0.params))
    tmp = rep.path / "welcome.bin.tmp"
    tmp.write_bytes(bytes(welcome))
    os.replace(tmp, rep.path / "welcome.bin")
    return encode_hello(Hello(pid, rep.state.round))


def _wire(cfg: RunConfig, rep) -> Wire:
    """The run's wire: from the welcome the node accepted (else its own configuration's)."""
    path = rep.path / "welcome.bin"
    seed = decode_welcome(path.read_bytes()).seed if path.exists() else cfg.seed
    return Wire.of(cfg.zo(), seed)


def attacked(cfg: RunConfig, num_clients: int, pid: int, up: bytes, wire: Wire) -> bytes:
    """What node ``pid`` sends: its honest uplink, or, if it is one of the run's Byzantine
    clients (``--byzantine K``: the K clients the simulator draws from the run seed), the same
    uplink with its scalars replaced by its attack's lie (:class:`hiso.runners.faults.Attackers`),
    as the simulator's attackers send. The lie is of the scalars as the wire carries them (the
    simulator's, for the float32 wire). Fixed attackers with the scale, sign-flip or nan attack
    only: the per-round draw and the random attack are keyed by the simulator's plan count."""
    if not cfg.byzantine:
        return up
    from ..core.messages import Uplink, encode_uplink
    from ..runners.faults import Attackers
    att = Attackers(num_clients, cfg.byzantine, cfg.attack, cfg.attack_scale, seed=cfg.seed)
    if pid not in att.attack:
        return up
    if cfg.byzantine_per_round or att.attack[pid] == "random":
        raise ValueError("Flower nodes attack as fixed Byzantine clients with scale, sign-flip or nan")
    u = decode_uplink(up, wire)
    return encode_uplink(Uplink(u.client, u.round, att.lie(pid, u.scalars, 0), u.loss, u.attempt), wire, check=False)


def train_fields(cfg: RunConfig, run_id, pid: int, state_dir: str, down: bytes, cfg_json: str | None = None) -> dict:
    """A node's answer to ``train``: ``up`` (the encoded uplink) or ``behind`` (its round)."""
    t0, c0 = time.perf_counter(), time.process_time()
    task, rep = open_replica(cfg, run_id, pid, state_dir, cfg_json)
    t1 = time.perf_counter()
    client = Client(pid, rep.state, task.loss, lambda r, k: task.batch(pid, r, k, cfg.batch_size), cfg.perturb_mode,
                    wire=_wire(cfg, rep), batch_memory=cfg.batch_memory_bytes)
    rep.begin()
    try:
        up = client.handle(down)
    except MessageError as e:
        rep.commit()  # nothing changed: a refused downlink is checked before any update
        rep.close()
        if "history starts at" in str(e):
            return {"behind": rep.state.round}
        raise
    rep.commit()
    up = attacked(cfg, task.num_clients, pid, up, client.wire)
    t2 = time.perf_counter()
    _note_timing(rep.path, {"round": client.state.round, "since_process_start_s": t0 - _PROCESS_T0,
                            "open_s": t1 - t0, "handle_s": t2 - t1, "up_bytes": len(up), "down_bytes": len(down),
                            # CPU seconds (independent of how busy the machine is): before our code ran
                            # (interpreter, flwr, torch, hiso imports, Flower's setup) and in it
                            "cpu_before_handler_s": c0, "cpu_handler_s": time.process_time() - c0})
    rep.close()
    return {"up": up}


def _trajectory(msg, context):
    """What keys this node's replica: the run directory's lineage the server sent, else the
    Flower run id."""
    rec = msg.content[REC] if REC in msg.content else {}
    return str(rec["lineage"]) if "lineage" in rec else context.run_id


def handle_query(msg, context, cfg: RunConfig):
    from flwr.app import Message
    rec = msg.content[REC]
    fields = query_fields(cfg, _trajectory(msg, context), _partition(context), _state_dir(context), _cfg_json(context),
                          rec["welcome"] if "welcome" in rec else None)
    return Message(_records(fields), reply_to=msg)


def handle_train(msg, context, cfg: RunConfig):
    from flwr.app import Message
    fields = train_fields(cfg, _trajectory(msg, context), _partition(context), _state_dir(context),
                          msg.content[REC]["down"], _cfg_json(context))
    return Message(_records(fields), reply_to=msg)


# --------------------------------------------------------------------------------- apps


def make_apps(cfg: RunConfig | None = None, settings: Settings | None = None):
    """A (ServerApp, ClientApp) pair. With ``cfg``/``settings`` they are fixed (simulation
    engine); without, they are read from the Flower run config (deployment, ``flwr run``)."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    def cfg_of(context) -> RunConfig:
        if cfg is not None:
            return cfg
        return RunConfig(**json.loads(context.run_config["hiso-config"]))

    def settings_of(context) -> Settings:
        if settings is not None:
            return settings
        rc = context.run_config
        return Settings(out_dir=str(rc["out-dir"]), round_timeout=float(rc.get("round-timeout", 30.0)),
                        min_nodes=int(rc.get("min-nodes", 0)), wait_nodes_s=float(rc.get("wait-nodes-s", 60.0)),
                        resume=bool(rc.get("resume", False)))

    server_app, client_app = ServerApp(), ClientApp()

    @server_app.main()
    def _main(grid, context) -> None:
        c = cfg_of(context)
        if c.threads is not None:
            import torch
            torch.set_num_threads(c.threads)
        serve(grid, c, settings_of(context))

    @client_app.query()
    def _query(msg, context):
        return handle_query(msg, context, cfg_of(context))

    @client_app.train()
    def _train(msg, context):
        c = cfg_of(context)
        if c.threads is not None:
            import torch
            torch.set_num_threads(c.threads)
        if not c.scalar_only:
            from .fullmodel import handle_train_full
            return handle_train_full(msg, context, c)
        return handle_train(msg, context, c)

    return server_app, client_app


try:
    _APPS = make_apps()
except ImportError:  # no flower extra: the handlers above still import (and are tested) without it
    _APPS = (None, None)
server_app = _APPS[0]  # (one name per line: `flwr run` finds them by reading this file)
client_app = _APPS[1]
