"""The ServerApp's side for the algorithms with a log (the scalar-only ones, HiSo, DeComFL, and
FedKSeed's seed pool): a runner with the simulator's interface over a Flower Grid
(:class:`FlowerFederation`) and the run it drives (:func:`serve_zo`); see :mod:`hiso.flower.app`
for the protocol over Flower's messages."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import RunConfig
from ..core.history import RoundRecord
from ..core.messages import Hello, encode_hello, encode_welcome, welcome_for
from ..core.round import RoundsExhausted, play_round
from ..core.state import ModelState
from ..methods.privacy import reports_loss
from ..runners.accounting import privacy_ledger
from ..atomic import write_atomic
from ..runners.common import Comm, CommTally, metric_rows
from ..runners.drivers import driver_of
from ..core.server_rounds import ScalarRounds
from ..runners.protocol import protocol_server
from ..runners.runner import Runner
from ..tasks.base import Task

from .records import REC, Settings, _records, _task_for, earlier_attempts, log, run_lineage
from .joins import take_join
from .timeouts import RoundTimeout, join_wait, per_node
from .transport import GridTransport


@dataclass
class FlowerFederation(Runner):
    """A runner with the simulator's interface (``run``, ``comm``, ``state_dict``) over a Grid."""

    grid: object
    task: Task
    cfg: RunConfig
    settings: Settings
    on_record: Callable[[RoundRecord], None] | None = None
    node_of: dict[int, int] = field(default_factory=dict)  # partition -> node id
    part_of: dict[int, int] = field(default_factory=dict)  # node id -> its partition (the last it named)
    parts_of: dict[int, set[int]] = field(default_factory=dict)  # node id -> every partition it serves
    timings: list[dict] = field(default_factory=list)  # per round: where the time went
    lineage: str = ""  # the run directory's trajectory id: nodes key their replicas by it (resume)

    def __post_init__(self) -> None:
        if driver_of(self.cfg.method).pool_rounds:
            return self._init_pool()
        self.zo = self.cfg.zo()
        M = self.task.num_clients
        t0 = time.perf_counter()
        self.state = ModelState(self.task.build_model(), self.zo, run_seed=self.cfg.seed)
        self.load_s = self.settings.load_s + time.perf_counter() - t0  # a node's cost to join, roughly
        self.server = protocol_server(self.task, self.zo, self.cfg.sampled, self.cfg.seed, self.cfg.weighted,
                                      self.state, self.cfg.snapshot_after, self.cfg.bandwidth,
                                      self.cfg.aggregate, self.cfg.trim, noise_seed=self.cfg.dp_noise_seed,
                                      secagg=self.cfg.secagg_config)
        self.welcome = encode_welcome(welcome_for(self.zo, self.cfg.seed, self.state.params))
        self.privacy = privacy_ledger(self.cfg)  # DP: participations, the epsilon reported, the budget
        self._loss_slot = 0.0 if reports_loss(self.zo.dp) else None  # an answer's loss, for its size only
        self.comm = Comm.zeros(M)
        self.rounds = ScalarRounds(self.server, self.state, on_commit=self._logged, loss_slot=self._loss_slot)
        self._init_nodes()

    def _init_pool(self) -> None:
        """FedKSeed: its pool server (:class:`~hiso.methods.fedkseed_rounds.PoolRounds`) plays the
        rounds. No join handshake (a node names its partition and the round of its pool state);
        every client's join is counted before round 1, as the simulator counts it."""
        from ..methods.fedkseed_rounds import PoolRounds, pool_replica
        t0 = time.perf_counter()
        rep = pool_replica(self.cfg, self.task.build_model)
        self.load_s = self.settings.load_s + time.perf_counter() - t0
        self.state, self.zo, self.welcome, self.privacy, self._loss_slot = rep.state, rep.state.cfg, None, None, 0.0
        self.rounds = self.server = PoolRounds(rep, self.task.num_clients, self.cfg.sampled, self.cfg.seed,
                                               self.cfg.scalar_dtype, self.on_record)
        self.comm = Comm.zeros(self.task.num_clients)
        self.rounds.joins(CommTally(self.comm))
        self._init_nodes()

    def _init_nodes(self) -> None:
        """No node known yet (every runner over a grid starts so); the grid as a transport; the
        round's wait (fixed, or from the measured rounds: :mod:`hiso.flower.timeouts`)."""
        self.transport = GridTransport(self)
        st, load = self.settings, getattr(self, "load_s", self.settings.load_s)
        self.per_node = per_node(self.task.num_clients, st.min_nodes or self.task.num_clients)
        self.clock = RoundTimeout(st.round_timeout, load, self.per_node)
        self.join_wait = join_wait(st.wait_nodes_s, load, self.per_node)
        self.times = (0.0, 0.0, 0.0)  # the last exchange: start, nodes refreshed, answers received
        self._seen: set[int] = set()
        self._suspects: set[int] = set()  # node ids that missed their last answer
        self._late: dict[str, int] = {}  # message id -> node id: unanswered when its exchange ended
        self._queries: dict[str, int] = {}  # query message id -> node id, awaiting a reply
        self._asked: dict[int, tuple[int, float]] = {}  # node id -> (times asked again, when next)
        self._joining: set[int] = set()  # under a placement: node ids asked to join, not answered yet
        self._counted: set[int] = set()  # under a placement: partitions whose join was counted when placed
        self.queries_resent = 0
        self.join_s = 0.0  # under a placement: the last round's wait for its new nodes' joins

    @property
    def round_timeout(self) -> float:
        """How long the next round waits for its answers (:class:`~hiso.flower.timeouts.RoundTimeout`)."""
        return self.clock.now()

    def _message(self, fields: dict, node_id: int, kind: str, group: str | None = None):
        """A message to a node. A ``train`` message lives as long as its round waits for the
        answer (Flower's default is 12 h): a node that fell behind (cut off, slow) would
        otherwise work through every stale one in turn, each taking about a round, and never
        answer in time again. A ``query`` keeps the default (a slow first start must not expire it)."""
        return self._message_of(_records(fields), node_id, kind, group)

    def _message_of(self, content, node_id: int, kind: str, group: str | None = None):
        """A message of ``content`` (a RecordDict) to a node (see :meth:`_message`)."""
        from flwr.app import Message
        return Message(content, dst_node_id=node_id, message_type=kind, group_id=group,
                       ttl=self.round_timeout if kind == "train" else None)

    def _lineage_field(self) -> dict:
        return {"lineage": self.lineage} if self.lineage else {}

    # -- nodes
    def refresh_nodes(self) -> None:
        """Ask every node not seen yet for its partition and its replica's round (non-blocking:
        a query is sent once per node; replies are collected whenever this is called). Under a
        placement (simulation engine) only the nodes :meth:`join_sampled` named are asked, and
        the grid's node list (every node of the population) is not read: the engine's virtual
        nodes never leave."""
        if self.settings.placement is None:
            ids = set(self.grid.get_node_ids())
            for nid in list(self.part_of):
                if nid not in ids:  # gone (offline: it may come back under the same id, and is asked again then)
                    self.part_of.pop(nid)
                    self._seen.discard(nid)
                    self._asked.pop(nid, None)
                    for pid in self.parts_of.pop(nid, ()):
                        if self.node_of.get(pid) == nid:
                            del self.node_of[pid]
            self._queries = {m: n for m, n in self._queries.items() if n in ids}
            self._late = {m: n for m, n in self._late.items() if n in ids}
        else:  # nothing per node of the population: only those asked to join and not answered yet
            self._joining -= self._seen
            ids = self._joining
        # Flower hands a message out once: one whose delivery to the node fails (a connection
        # reset as the node pulls it) is gone, so a query unanswered for round_timeout is sent
        # again (then after 2x, 4x ... as long: a slow node is not flooded), or the node would
        # never take part; whichever of its queries is answered first counts
        now, asked = time.monotonic(), set(self._queries.values())
        again = {n for n in asked if now >= self._asked[n][1]}
        if again:
            log.warning("nodes %s did not answer their query: asking again", sorted(again))
            self.queries_resent += len(again)
        new = sorted((ids - self._seen - asked) | again)
        if new:
            join = {"welcome": self.welcome} if getattr(self, "welcome", None) is not None else {}
            msgs = [self._message({**join, **self._lineage_field()}, nid, "query") for nid in new]
            self._queries.update(zip(self.grid.push_messages(msgs), new))
            for nid in new:
                k = self._asked[nid][0] + 1 if nid in self._asked else 0
                self._asked[nid] = (k, now + self.round_timeout * 2 ** k)
        if not self._queries:
            return
        for rep in self.grid.pull_messages(set(self._queries)):
            nid = self._queries.pop(rep.metadata.reply_to_message_id, None)
            if nid is None:
                continue
            self._seen.add(nid)
            self._queries = {m: n for m, n in self._queries.items() if n != nid}  # its other queries
            if rep.has_error():
                log.warning("node %s failed the query: %s", nid, rep.error.reason)
                continue
            self._suspects.discard(nid)  # it answered: the next round waits for it in full
            take_join(self, nid, rep.content[REC])

    def join_sampled(self, pids) -> None:
        """Under a placement: the nodes of the sampled partitions ``pids`` that have not joined
        yet join now (their query answered before their first train message; at most
        ``round_timeout``), so a partition's node is asked, and its replica made, only once it
        is sampled. A node that failed its query is not asked again, as in a deployment. Until
        a first node has joined the wait is ``wait_nodes_s``: the engine starts its workers then."""
        placed, t0 = self.settings.placement, time.perf_counter()
        self.join_s = 0.0
        if placed is None:
            return
        want = {placed[p] for p in pids if p not in self.node_of and p in placed} - self._seen
        if not want:
            return
        self._joining |= want
        t_end = time.monotonic() + (self.round_timeout if self.node_of else self.join_wait)
        while True:
            self.refresh_nodes()
            if not want - self._seen or time.monotonic() > t_end:
                break
            time.sleep(self.settings.poll_s)
        self.join_s = time.perf_counter() - t0

    def _count_joins(self, placed: dict[int, int]) -> None:
        """Count every placed partition's join (welcome down, hello up) now, as the in-process
        runner counts every client's at round 0 and a deployment's nodes join at the start:
        the run's bytes are the protocol's, whenever the simulation sends the query."""
        if getattr(self, "welcome", None) is None:
            return
        for pid in placed:
            if 0 <= pid < self.task.num_clients and pid not in self.node_of:
                self.comm.join(pid, encode_hello(Hello(pid, 0)), self.welcome)
                self._counted.add(pid)

    def wait_for_nodes(self) -> None:
        want = self.settings.min_nodes or self.task.num_clients
        placed = self.settings.placement
        t_end = time.monotonic() + self.join_wait
        grace = time.monotonic() + min(10.0, self.join_wait / 2)
        while True:
            if placed is not None:  # nodes join when first sampled: wait for the engine to place them
                if len(placed) >= min(want, self.task.num_clients):
                    self._count_joins(placed)
                    return
                if not placed and time.monotonic() > grace and self.grid.get_node_ids():  # (another Flower)
                    log.warning("the simulation engine has nodes but gave no placement: every node is queried")
                    self.settings.placement = placed = None
                    continue
                if time.monotonic() > t_end:
                    raise RuntimeError(f"the simulation engine placed {len(placed)} of {want} nodes within "
                                       f"{self.join_wait:g} s")
                time.sleep(self.settings.poll_s)
                continue
            self.refresh_nodes()
            have = len(self.parts_of) if self.settings.min_nodes else len(self.node_of)  # nodes, or partitions
            if have >= want:
                return
            if time.monotonic() > t_end:
                if not self.node_of:
                    raise RuntimeError(f"no node connected within {self.join_wait:g} s (--join-timeout S waits longer)")
                log.warning("only %d of %d nodes connected; going on", have, want)
                return
            time.sleep(self.settings.poll_s)

    # -- one round
    def _logged(self, rec) -> None:
        """A closed round (applied to x_r): logged, counted in the DP ledger."""
        if self.on_record is not None:
            self.on_record(rec)
        if self.privacy is not None:
            self.privacy.record(rec)

    def _timed(self, rec, plan, times: tuple[float, float, float], **extra) -> None:
        """The closed round's timings (``times``: start, nodes sent, answers received)."""
        t0, t1, t2 = times
        self.timings.append({"round": rec.round, "nodes_s": t1 - t0, "send_and_receive_s": t2 - t1,
                             "aggregate_apply_s": time.perf_counter() - t2, "participants": list(rec.participants),
                             "sampled": list(plan.participants), **({"join_s": self.join_s} if self.join_s else {}),
                             **extra})

    def _send(self, rnd: int, pids, downlink, content=None, kept=None) -> dict[int, object]:
        """Downlinks to ``pids`` (those with a node; ``downlink(pid)``: its message, counted);
        the replies by partition. ``content(down)``: a train message's RecordDict (default: the
        downlink in the ``down`` field of the hiso ConfigRecord); ``kept(pid, reply)``: what is
        kept of a reply (default: its hiso ConfigRecord; a failed one is dropped)."""
        msgs, to = [], []
        for pid in pids:
            nid = self.node_of.get(pid)
            if nid is None:
                continue
            down = downlink(pid)
            if content is not None:
                msgs.append(self._message_of(content(down), nid, "train", str(rnd)))
            else:  # a node of several partitions is told which one the message is for
                named = {"partition": pid} if len(self.parts_of.get(nid, ())) > 1 else {}
                msgs.append(self._message({"down": down, **named, **self._lineage_field()}, nid, "train", str(rnd)))
            to.append(pid)
        out, sent = {}, {}
        for rep in self._exchange(msgs, sent):
            pid = to[sent[rep.metadata.reply_to_message_id]]
            if kept is not None:
                out[pid] = kept(pid, rep)
                continue
            if rep.has_error():
                log.warning("round %d: partition %d failed: %s", rnd, pid, rep.error.reason)
                continue
            out[pid] = rep.content[REC]
        return out

    def _exchange(self, msgs: list, sent: dict | None = None) -> list:
        """Push ``msgs`` and pull their replies until all came back or time is up (``sent``:
        filled with each pushed message's id -> its index in ``msgs``).

        Like ``Grid.send_and_receive`` but polls every ``poll_s`` (Flower's polls every 3 s) and
        does not wait ``round_timeout`` for *suspects* (nodes that missed their last answer)
        once every healthy node has answered: they get ``suspect_grace_s`` more (if all are
        suspects, all get the full ``round_timeout``). A node that answers is healthy again,
        and so is one whose answer to an earlier exchange comes in late: a node back from a
        cut, a poll behind the others, would otherwise miss every grace and never take part.
        An error the SuperLink makes (the message expired or was never delivered) is no answer.
        """
        if not msgs:
            return []
        st = self.settings
        dst = {}
        ids = list(self.grid.push_messages(msgs))
        for i, (mid, m) in enumerate(zip(ids, msgs)):
            dst[mid] = m.metadata.dst_node_id
            if sent is not None:
                sent[mid] = i
        pending, out = set(ids), []
        t_end = time.monotonic() + self.round_timeout
        grace_end = None
        any_healthy = any(d not in self._suspects for d in dst.values())  # else: all get the full time
        while pending:
            reps = list(self.grid.pull_messages(pending | set(self._late)))
            for rep in reps:
                mid = rep.metadata.reply_to_message_id
                if mid in pending:
                    pending.discard(mid)
                    out.append(rep)
                elif (nid := self._late.pop(mid, None)) is not None and rep.metadata.src_node_id == nid:
                    self._suspects.discard(nid)  # its late answer: it is back
            now = time.monotonic()
            if not pending or now > t_end:
                break
            if any_healthy and all(dst[m] in self._suspects for m in pending):
                grace_end = grace_end or now + st.suspect_grace_s
                if now > grace_end:
                    break
            time.sleep(st.poll_s)
        answered = {rep.metadata.src_node_id for rep in out}  # (the SuperLink's errors come from its own id)
        self._suspects |= {d for d in dst.values() if d not in answered}
        self._suspects -= answered
        self._late.update((m, dst[m]) for m in pending)
        return out

    def check_budget(self, plan) -> None:
        """Under a DP budget: stop before the planned round if it would take a participant past it."""
        if self.privacy is not None and (why := self.privacy.refusal(plan.participants)) is not None:
            from ..runners.simulate import PrivacyBudgetSpent
            raise PrivacyBudgetSpent(why)

    def step(self) -> float | None:
        """One round over the grid (:func:`hiso.core.round.play_round`); the answers' mean
        training loss (None under DP: no answer carries one)."""
        def rejected(plan, pid, code, why) -> None:
            log.warning("round %d: dropped an answer%s: %s", plan.round, "" if pid is None else f" of partition {pid}", why)

        def replanned(plan) -> None:
            log.warning("round %d: no valid answer from %s; planning it again", plan.round, list(plan.participants))

        try:
            played = play_round(self.rounds, self.transport, CommTally(self.comm, self.privacy), partial=True,
                                max_plans=self.settings.max_replans + 1, before=self.check_budget,
                                on_reject=rejected, on_replan=replanned)
        except RoundsExhausted as e:  # say how long it waited, and how to wait longer
            raise RoundsExhausted(f"{e}, each waiting {self.clock.describe()} for answers") from None
        self._timed(played.record, played.plan, self.times)
        t = self.timings[-1]
        self.clock.observe(t["send_and_receive_s"], set(t["sampled"]) <= set(t["participants"]))
        return self._mean_loss(played)

    def _mean_loss(self, played) -> float | None:
        """A played round's mean training loss (None under DP: no answer carries one)."""
        if self._loss_slot is None:
            return None
        order = {c: i for i, c in enumerate(played.record.participants)}  # as the simulator sums them
        answers = sorted(played.answers, key=lambda u: order.get(u.client, len(order)))
        return float(np.mean([u.loss for u in answers if u.loss is not None] or [np.nan]))

    # -- the simulator's interface
    def run(self, rounds: int, start: int = 0, wall: float = 0.0):
        self.wait_for_nodes()
        every = self.cfg.eval_every

        def extra() -> dict:  # the DP figures of an evaluated row, as the simulator's
            r, p = self.server.round, self.privacy
            row = p.row() if p is not None and (r % every == 0 or r == rounds) else {}
            if p is not None and p.unlogged:  # local DP: answers released that the log does not list
                row["dp_unlogged"] = {str(c): n for c, n in p.unlogged.items()}
            return row

        return metric_rows(self.task, self.state.model, self.comm, self.step, rounds, every, start=start, wall=wall,
                           extra=extra)

    def resume(self, records: list[RoundRecord], start: dict | None = None) -> None:
        """Bring a new ServerApp to the end of an interrupted run's log (``run_to_dir(resume=
        True)``): the server draws each logged round's sample and seeds again (checked against
        the log; rounds the run planned again are skipped as it did), closes it with the logged
        record, and the model and H replay it. Bytes are counted as if every sampled
        partition had a node (what the log can tell). Nodes report the round their replica
        holds when they are queried, so each one's next downlink starts there. ``start``: the
        server state at a round c of the log, as :meth:`hiso.runners.simulate.Simulation.resume`
        takes it (model and H replay only the records from c on)."""
        from ..core.round import replay_log
        from ..runners.checkpoint import start_from
        if self.server.round:
            raise RuntimeError("resume() needs a federation that has not run yet")
        first = start_from(self.state, self.server, start, len(records))  # (FedKSeed's runs keep no checkpoint)
        record = None if self.privacy is None else (lambda i, rec, plan: self.privacy.record(rec))
        replay_log(self.rounds, records, CommTally(self.comm), first=first, each=record)

    @property
    def model(self):
        return self.state.model

    def state_dict(self) -> dict:
        return self.rounds.replica.state_dict()  # (FedKSeed's: its pool's sums too)

def serve_zo(grid, cfg: RunConfig, settings: Settings, federation: type | None = None) -> dict:
    """The ServerApp's body for a scalar-only ``cfg``: run it over the grid into ``settings.out_dir``
    (``federation``: a :class:`FlowerFederation` subclass, e.g. the secure aggregation's)."""
    t0 = time.perf_counter()
    task = _task_for(cfg.model_dump_json())
    settings.load_s = time.perf_counter() - t0  # with the model's build: the waits' scale (timeouts)
    holder = {}

    before = earlier_attempts(settings) if settings.resume else []
    lineage = run_lineage(settings)

    def factory(cfg_, task_, on_record=None):
        holder["fed"] = (federation or FlowerFederation)(grid, task_, cfg_, settings, on_record, lineage=lineage)
        return holder["fed"]

    from ..runners.rundir import run_to_dir

    summary = run_to_dir(cfg, settings.out_dir, task=task, runner=factory, resume=settings.resume)
    fed = holder["fed"]
    extra = {"flower": {"rounds_replanned": fed.server.replanned, "queries_resent": fed.queries_resent,
                        "timings": fed.timings,
                        "partitions_seen": sorted(fed.node_of), "earlier_attempts": before}}
    write_atomic(Path(settings.out_dir, "flower.json"), json.dumps(extra, indent=1))
    if summary.get("diverged"):
        raise RuntimeError(f"run diverged: {summary['diverged']}")
    return summary
