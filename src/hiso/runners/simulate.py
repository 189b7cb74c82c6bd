"""In-process federation: the core's Server and Clients exchanging encoded messages.

Two modes run the identical arithmetic:

* ``faithful``: every sampled client is a real :class:`~hiso.core.client.Client` with its own
  model and H, rebuilt by replaying the history it missed from its downlink bytes. This is
  the proof of exactness (and costs a model per client that has ever been sampled).
* ``fast``: one shared replica stands for every client. Since a client that catches up holds
  exactly the server's model, the local update runs on the shared copy and replay is skipped;
  messages are still encoded so communication is counted the same way.

Clients that are not sampled cost nothing in either mode. Every client joins once, before
round 1 (its hello up, the server's welcome down: counted in its bytes).

With ``faults`` (lost, late, repeated, damaged answers) or ``attackers`` (Byzantine clients;
see :mod:`hiso.runners.faults`) a round closes with the valid answers it got
(``Server.aggregate(partial=True)``; a round with none is planned again); every rejected
message is counted by reason and logged (logger ``hiso.faults``), and each metrics row
carries the round's participants and rejections. In faithful mode every client that computed
is then checked against the server's model and H, bit for bit (``out_of_sync`` counts
failures: it must stay 0).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Literal

import numpy as np
import torch

from ..core.client import Client, answer_work
from ..core.config import ZOConfig
from ..core.history import RoundRecord
from ..core.messages import (Downlink, Hello, MessageError, Uplink, decode_downlink, decode_uplink, encode_downlink,
                             encode_hello, encode_uplink, encode_welcome, welcome_for)
from ..core.perturb import Mode, Perturber
from ..core.round import play_round, replay_log
from ..methods.secagg import SecAggConfig, loss_level, mean_loss
from ..core.state import ModelState
from ..methods.privacy import noise_key, reports_loss
from ..tasks.base import Task
from .checkpoint import start_from
from .client_cost import ClientCost, Timer, replica_bytes
from .common import Comm, CommTally, metric_rows, start_round
from .faults import Attackers, ChecksumError, Faults, seal, unseal
from .inprocess import InProcess
from ..core.server_rounds import ScalarRounds
from .protocol import protocol_server, protocol_traffic  # noqa: F401  (still imported from here)
from .runner import Runner

if TYPE_CHECKING:
    from .accounting import PrivacyLedger



class PrivacyBudgetSpent(RuntimeError):
    """The next round would spend more than the run's DP budget (dp_epsilon)."""


log = logging.getLogger("hiso.faults")

SimMode = Literal["fast", "faithful"]


@dataclass
class Simulation(Runner):
    task: Task
    zo: ZOConfig
    clients_per_round: int
    seed: int = 0
    batch_size: int = 16
    mode: SimMode = "fast"
    perturb_mode: Mode = "hooks"
    batch_memory: int | None = None  # batched perturb mode: bytes of stacked tensors per forward
    dp_seed: int | None = None  # DP: the secret key of the noise (None: a fresh secret)
    # DP: the run's ledger (hiso.runners.accounting.PrivacyLedger): participations, epsilon, budget
    privacy: PrivacyLedger | None = None
    weighted: bool = False
    eval_every: int = 10
    on_record: Callable[[RoundRecord], None] | None = None
    rule: str = "mean"  # how the server combines answers (hiso.core.aggregate)
    trim: float = 0.25
    faults: Faults | None = None
    attackers: Attackers | None = None
    snapshot_after: int | None = None
    bandwidth: float | None = None
    secagg: SecAggConfig | None = None  # secure aggregation's grid: answers quantised, the mean from their sum
    clients: dict[int, Client] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.mode not in ("fast", "faithful"):
            raise ValueError(f"mode must be 'fast' or 'faithful', got {self.mode!r}")
        M = self.task.num_clients
        self.dp_seed = noise_key(self.dp_seed)
        self.report_loss = reports_loss(self.zo.dp)  # under DP no answer carries its loss
        self._loss_slot = 0.0 if self.report_loss else None  # the loss of an answer counted for its size only
        self.state = ModelState(self.task.build_model(), self.zo, run_seed=self.seed)  # the server's x_r, for evaluation
        self.server = protocol_server(self.task, self.zo, self.clients_per_round, self.seed, self.weighted,
                                      self.state, self.snapshot_after, self.bandwidth, self.rule, self.trim,
                                      noise_seed=self.dp_seed, secagg=self.secagg)
        self.welcome = encode_welcome(welcome_for(self.zo, self.seed, self.state.params))
        self.perturber = Perturber(self.state.model, self.state.params, self.perturb_mode, self.batch_memory)
        self.comm = Comm.zeros(M)
        # unreliable mode: partial rounds, counted rejections (off: the exact old path)
        self.unreliable = bool((self.faults and self.faults.active) or (self.attackers and self.attackers.active))
        self.sealed = bool(self.faults and self.faults.active)  # CRC-32 frame on uplinks
        self.plans = 0  # rounds planned so far (re-planned ones included): keys the fault streams
        self.pending: list[tuple[int, bytes]] = []  # late answers (round, bytes), delivered in a later round
        self.totals: Counter = Counter()  # injected faults and rejections (by reason), whole run
        self.round_stats: dict = {}
        self.out_of_sync = 0  # faithful mode: (round, client) replica checks that failed
        self.round_out_of_sync = 0
        self.sync_checks = 0
        # forwards, backwards and seconds per client-round; a client's memory (under DP no seconds)
        self.cost = ClientCost(timed=self.zo.dp is None)
        self.rounds = ScalarRounds(self.server, self.state, on_commit=self._logged, loss_slot=self._loss_slot)
        self.transport = InProcess(self)
        self.tally = CommTally(self.comm, self.privacy)
        for c in range(M):  # every client joins once, at x_0
            self.comm.join(c, encode_hello(Hello(c, 0)), self.welcome)

    @property
    def model(self):
        """The server's model (x_r)."""
        return self.state.model

    def _batch_fn(self, cid: int):
        return lambda rnd, k: self.task.batch(cid, rnd, k, self.batch_size)

    def client(self, cid: int) -> Client:
        """The faithful-mode client ``cid``, created at x_0 the first time it is sampled."""
        if cid not in self.clients:
            st = ModelState(self.task.build_model(), self.zo, run_seed=self.seed)
            self.clients[cid] = Client(cid, st, self.task.loss, self._batch_fn(cid), self.perturb_mode,
                                      report_loss=self.report_loss, batch_memory=self.batch_memory,
                                      dp_seed=self.dp_seed)
            self.clients[cid].join(self.welcome)
        return self.clients[cid]

    def _fast_answer(self, cid: int, msg) -> Uplink:
        """Fast mode: client ``cid``'s answer computed on the shared replica (which holds x_r,
        as the client would after catching up), by the same function as :meth:`Client.train`."""
        with Timer() as t:
            up, work = answer_work(cid, self.state, self.perturber, self.task.loss, self._batch_fn(cid), msg,
                                   self.report_loss, dp_seed=self.dp_seed)
        self.cost.add(work, t.s)
        return up

    def _faithful_answer(self, cid: int, down: bytes) -> Uplink:
        """Faithful mode: client ``cid`` decodes its downlink, catches up and answers (timed)."""
        client = self.client(cid)
        with Timer() as t:
            up = client.train(decode_downlink(down, client.wire))
        self.cost.add(client.work, t.s)
        return up

    def reply(self, cid: int, down: bytes) -> bytes:
        """Client ``cid``'s encoded answer to its downlink bytes (a reliable network; faithful:
        the client's bytes-in, bytes-out contract; fast: on the shared replica)."""
        if self.mode == "faithful":
            client = self.client(cid)
            with Timer() as t:
                up = client.handle(down)
            self.cost.add(client.work, t.s)
            return up
        return encode_uplink(self._fast_answer(cid, decode_downlink(down, self.server.wire)), self.server.wire)

    def measure_client(self) -> None:
        """A client's resident bytes and the transient peak of one answer (see
        :mod:`hiso.runners.client_cost`): client 0 on the shared replica, any seeds; the
        replica holds the same bits afterwards."""
        r, shape = self.state.round, self.zo.shape
        msg = Downlink(r, np.arange(1, shape[0] * shape[1] + 1, dtype=np.uint64).reshape(shape), r)
        self.cost.measure(lambda: answer_work(0, self.state, self.perturber, self.task.loss, self._batch_fn(0), msg,
                                              self.report_loss, dp_seed=self.dp_seed),
                          replica_bytes(self.state), self.state.params[0].device if self.state.params else "cpu")

    def _check_budget(self, plan) -> None:
        """Under a DP budget: stop before the planned round if it would take a participant past it."""
        if self.privacy is not None and (why := self.privacy.refusal(plan.participants)) is not None:
            raise PrivacyBudgetSpent(why)

    def _logged(self, rec: RoundRecord) -> None:
        """A closed round (applied to the server's model): logged, counted in the DP ledger."""
        if self.on_record is not None:
            self.on_record(rec)
        if self.privacy is not None:
            self.privacy.record(rec)

    def step(self) -> tuple[RoundRecord, float | None]:
        """One round (:func:`hiso.core.round.play_round`); returns its record and the
        participants' mean training loss (None under DP: no answer carries one). Over an
        unreliable network it closes with the valid answers (see the module docstring)."""
        decodable, self.round_out_of_sync = self.totals["corrupt_decodable"], 0
        played = play_round(self.rounds, self.transport, self.tally, partial=self.unreliable,
                            before=self._check_budget, on_reject=self._rejected, on_replan=self._replanned)
        rec = played.record
        if not self.unreliable:
            return rec, self._mean_loss([u.loss for u in played.answers])
        for code, n in played.rejected.items():
            self.totals["rejected_" + code] += n
        self.round_stats = {"participants": len(rec.participants), "rejected": dict(sorted(played.rejected.items())),
                            "replanned": played.replanned}
        # what the log cannot tell a resumed run (so its row says it; absent when 0)
        if self.totals["corrupt_decodable"] > decodable:
            self.round_stats["corrupt_decodable"] = int(self.totals["corrupt_decodable"] - decodable)
        if self.round_out_of_sync:
            self.round_stats["out_of_sync"] = self.round_out_of_sync
        if self.privacy is not None and self.privacy.unlogged:  # local DP: released, not in the log
            self.round_stats["dp_unlogged"] = {str(c): n for c, n in self.privacy.unlogged.items()}
        kept = {u.client: u.loss for u in reversed(played.answers) if u.client in rec.participants and u.round == rec.round}
        return rec, self._mean_loss(list(kept.values()))

    def _rejected(self, plan, client, code: str, why: str) -> None:
        log.info("row %d (round %d): rejected (%s): %s", plan.round + 1, plan.round, code, why)

    def _replanned(self, plan) -> None:
        log.info("row %d (round %d): no valid answer (or fewer than secure aggregation's threshold), planned again",
                 plan.round + 1, plan.round)

    def _mean_loss(self, losses: list) -> float | None:
        """The participants' mean training loss; under secure aggregation the mean of their grid
        levels, as a secure sum gives it (:mod:`hiso.methods.secagg`); None under DP."""
        if not self.report_loss:
            return None
        if self.secagg is not None:
            return mean_loss(sum(loss_level(x, self.secagg) for x in losses), len(losses), self.secagg)
        return float(np.mean(losses))

    def _answer(self, cid: int, down: bytes, attack: str | None = None) -> Uplink:
        """Client ``cid``'s answer to its downlink bytes (an attacker's lie included)."""
        if self.mode == "faithful":
            up = self._faithful_answer(cid, down)
        else:
            up = self._fast_answer(cid, decode_downlink(down, self.server.wire))
        if attack is not None:
            up = Uplink(cid, up.round, self.attackers.lie(cid, up.scalars, self.plans, attack), up.loss, up.attempt)
        return up

    def _unseal(self, data: bytes) -> bytes:
        """An arriving message's CRC-32 frame checked and removed (a damaged one raises
        ChecksumError); counts the damage the decoder alone would have let through."""
        try:
            return unseal(data)
        except ChecksumError:
            try:
                decode_uplink(bytes(data[:-4]), self.server.wire)
                self.totals["corrupt_decodable"] += 1
            except MessageError:
                pass
            raise

    def _in_sync(self, cid: int) -> bool:
        st = self.clients[cid].state
        same = st.round == self.server.round and all(torch.equal(a, b) for a, b in zip(st.params, self.state.params))
        if st.h is not None:
            same = same and all(torch.equal(a, b) for a, b in zip(st.h, self.state.h))
        return same

    def _send(self, plan, answer: Callable[[int, bytes, str | None, str], bytes], downlink=None) -> list[bytes]:
        """The answers to one planned round as the server gets them: each client's fate drawn,
        its downlink and uplink bytes counted, late answers kept for a later round. ``answer(cid,
        downlink, attack, fate)`` gives a client's encoded uplink. Shared by a live round and the
        replay of logged ones (:meth:`resume`), so both draw and count alike. ``downlink(cid)``:
        the client's encoded downlink, counted (default: the server's, counted here)."""
        arrivals = [d for r, d in self.pending if r < plan.round]  # late answers of closed rounds
        self.pending = [(r, d) for r, d in self.pending if r >= plan.round]
        wire = self.server.wire
        liars = self.attackers.of_round(self.plans, plan.participants) if self.attackers is not None else {}
        for cid in plan.participants:
            fate = self.faults.fate(self.plans, cid) if self.faults is not None else "ok"
            down = downlink(cid) if downlink is not None else self._count_down(cid)
            if fate != "ok":
                self.totals[fate] += 1
            if fate == "drop" and self.mode == "fast":  # lost anyway; a faithful client computes it
                lost = Uplink(cid, plan.round, np.zeros(wire.shape, np.float32), self._loss_slot, plan.attempt)
                # its size only (FeedSign's wire refuses zeros as signs when checked)
                self.comm.up[cid] += len(encode_uplink(lost, wire, check=False)) + (4 if self.sealed else 0)
                continue
            if cid in liars:
                self.totals["attacked"] += 1
            data = answer(cid, down, liars.get(cid), fate)
            if self.sealed:
                data = seal(data)
            self.comm.up[cid] += len(data) * (2 if fate == "duplicate" else 1)
            if fate == "drop":
                continue
            self.tally.released(plan, cid)  # local DP: every answer that reaches the server is a release
            if fate == "late":
                self.pending.append((plan.round, data))
                continue
            if fate == "corrupt":
                data = self.faults.damage(data, self.plans, cid)
            arrivals += [data, data] if fate == "duplicate" else [data]
        self.plans += 1
        return arrivals

    def _count_down(self, cid: int) -> bytes:
        down = encode_downlink(self.server.downlink(cid), self.server.wire)
        self.comm.down[cid] += len(down)
        return down

    def _live_answer(self, cid: int, down: bytes, attack: str | None, fate: str = "ok") -> bytes:
        """A client's real answer (computed; an attacker's lie), checked in sync in faithful mode."""
        data = encode_uplink(self._answer(cid, down, attack), self.server.wire, check=attack is None)
        if self.mode == "faithful":
            self.sync_checks += 1
            if not self._in_sync(cid):
                self.out_of_sync += 1
                self.round_out_of_sync += 1
                log.error("row %d (round %d): client %d's replica differs from the server's",
                          self.server.round + 1, self.server.round, cid)
        return data

    def reliability(self) -> dict:
        """Totals of an unreliable run (for ``summary.json``): faults injected, messages
        rejected by reason, re-planned rounds and, in faithful mode, replicas out of sync
        (checked every round for every client that computed, and for all at the end)."""
        t = self.totals
        out = {"injected": {k: int(t[k]) for k in ("drop", "late", "duplicate", "corrupt", "attacked")},
               "rejected": {k.removeprefix("rejected_"): int(v) for k, v in sorted(t.items())
                            if k.startswith("rejected_")},
               "rounds_completed": self.server.round, "rounds_replanned": self.server.replanned,
               "late_in_flight_at_end": len(self.pending),
               # damaged answers the decoder alone would have accepted (the CRC-32 frame caught them)
               "corrupt_decodable_without_crc": int(t["corrupt_decodable"])}
        out["rejected_total"] = sum(out["rejected"].values())
        if self.attackers is not None:
            out["byzantine"] = ({"per_round": self.attackers.k, "attacks": list(self.attackers.names)}
                                if self.attackers.per_round else {str(c): a for c, a in self.attackers.attack.items()})
        if self.mode == "faithful":
            self.sync_all()
            end = sum(not self._in_sync(c) for c in self.clients)
            out["replica_checks"] = self.sync_checks + len(self.clients)
            out["replicas_out_of_sync"] = self.out_of_sync + end
        return out

    def run(self, rounds: int, start: int | None = None, wall: float = 0.0) -> Iterator[dict]:
        """Yield one metrics row per round up to round ``rounds`` (plus row 0, the initial
        evaluation, from round 0). It continues from the round the server is at (after
        :meth:`resume`, or an earlier ``run``); ``wall`` is added to its rows' ``wall_s``."""
        start = start_round(self.server.round, rounds, start)
        def extra() -> dict:
            r = self.server.round
            row = dict(self.round_stats) if self.unreliable else {}
            if self.privacy is not None and (r % self.eval_every == 0 or r == rounds):
                row.update(self.privacy.row())
            return row

        return metric_rows(self.task, self.state.model, self.comm, lambda: self.step()[1], rounds, self.eval_every,
                           start=start, wall=wall, extra=extra, cost=self.cost)

    def resume(self, records: list[RoundRecord], rows: list[dict] | None = None, start: dict | None = None) -> None:
        """Bring a new simulation to the end of an interrupted run's logged rounds, exactly as
        if it had run them: the server re-draws each round's clients and seeds (its streams
        are seeded; the draws are checked against the log) and takes the logged record, the
        model and H replay it, and the bytes each message would have had are counted. In
        faithful mode each client that took part is rebuilt at the round it last took part in
        (the server's replica then, which it equals bit for bit).

        With faults or attackers, every plan of a logged round (abandoned attempts included)
        draws its fates and attackers again, as they are functions of the run seed and the plan
        (:mod:`hiso.runners.faults`), and counts their bytes; only the late answers of the last
        logged round, still in flight, are computed (a later round receives them). What the
        log does not hold, the rejections per round by reason (and, when not 0, damaged answers
        that would have decoded, replicas out of sync), comes from the kept metrics ``rows``.

        ``start``: the server state at a round c of the log (``DIR/checkpoint.pt``,
        :mod:`hiso.runners.checkpoint`): the model and H are loaded from it and replay only the
        records from c on; the server's bookkeeping replays them all. Raises
        :class:`~hiso.runners.checkpoint.CheckpointUnusable`, having changed nothing, where the
        replay needs the state of rounds before c (see that module)."""
        if self.server.round or self.clients:
            raise RuntimeError("resume() needs a simulation that has not run yet")
        first = start_from(self.state, self.server, start, len(records), faithful=self.mode == "faithful",
                           unreliable=self.unreliable)
        last = {c: rec.round for rec in records for c in rec.participants}
        wire = self.server.wire
        send = None
        if self.unreliable:
            if rows is None or len(rows) < len(records) + 1:
                raise ValueError("resuming a run with faults or attackers needs its metrics rows")
            for row in rows[1:len(records) + 1]:
                for code, n in row.get("rejected", {}).items():
                    self.totals["rejected_" + code] += n
                self.totals["corrupt_decodable"] += row.get("corrupt_decodable", 0)
                self.out_of_sync += row.get("out_of_sync", 0)

            def each_plan(i, plan):  # every plan of a logged round, its fates and attackers drawn again
                final = i == len(records) - 1

                def replayed(cid, down, attack, fate):
                    if final and fate == "late":  # in flight at the cut: its bytes are needed
                        return self._live_answer(cid, down, attack, fate)
                    if self.mode == "faithful":  # it computed (and was checked) in the run
                        self.sync_checks += 1
                    return encode_uplink(Uplink(cid, self.server.round, np.zeros(wire.shape, np.float32),
                                                self._loss_slot, self.server.planned.attempt), wire, check=False)
                self._send(plan, replayed)
            send = each_plan

        def each(i, rec, plan):
            if self.mode == "faithful":
                for cid in plan.participants:
                    if last.get(cid) == rec.round:  # the replica at rec.round
                        self.client(cid).state.load_state_dict(self.state.state_dict())
            if self.privacy is not None:
                self.privacy.record(rec)

        replay_log(self.rounds, records, CommTally(self.comm), first=first, each=each, send=send)

    def state_dict(self) -> dict:
        """The server's final state (model, H, round), as saved in ``model.pt``."""
        return self.state.state_dict()

    def sync_all(self) -> None:
        """Bring every faithful client up to the server's round (test and audit helper): by
        replay, or from a snapshot for a client further behind than the server keeps records."""
        from ..core.messages import encode_state, load_state
        for c in self.clients.values():
            if c.state.round < self.server.first:
                load_state(c.state, encode_state(self.state), self.state.round)
            else:
                c.state.replay(self.server.records_since(c.state.round))
