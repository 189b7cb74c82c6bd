"""A round closes with whoever answered, and no client is ever locked out or out of step.

Over a network an answer can be lost (the node died, timed out, or its reply was dropped
after it had caught up). The server then aggregates the answers it got; the client that
missed its reply gets, next time, a history starting before its own round and skips what it
already holds. Every replica stays bit-identical to the server's.
"""

import numpy as np
import pytest
import torch

from hiso.core import (Client, Downlink, MessageError, ModelState, PreconditionerConfig, RoundRecord, Server,
                       Uplink, Wire, decode_uplink, encode_downlink)
from hiso.methods.hiso_method import decomfl, hiso

from conftest import TinyTask


def _same(a: ModelState, b: ModelState) -> bool:
    ok = all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    if a.h is not None:
        ok = ok and all(torch.equal(x, y) for x, y in zip(a.h, b.h))
    return ok


class Fed:
    """Server + faithful clients, with a hook that decides whose answers arrive."""

    def __init__(self, zo, M=6, m=3, seed=0):
        self.task = TinyTask(num_clients=M)
        self.zo = zo
        self.server = Server(M, m, zo.local_steps, zo.perturbations, seed=seed)
        self.ref = ModelState(self.task.build_model(), zo)  # the server's x_r
        self.clients = {c: Client(c, ModelState(self.task.build_model(), zo), self.task.loss,
                                  self._batches(c), wire=self.server.wire) for c in range(M)}

    def _batches(self, c):
        return lambda r, k: self.task.batch(c, r, k, 8)

    def round(self, lost=(), unreached=()):
        """One round: ``unreached`` clients never get their downlink; ``lost`` answers are dropped."""
        plan = self.server.plan()
        ups = []
        for c in plan.participants:
            if c in unreached:
                continue
            up = self.clients[c].handle(encode_downlink(self.server.downlink(c), self.server.wire))
            if c not in lost:
                ups.append(decode_uplink(up, self.server.wire, expect_round=plan.round))
        rec = self.server.aggregate(ups, partial=True)
        if rec is not None:
            self.ref.apply(rec)
        return plan, rec


ZOS = [hiso(lr=0.02, perturbations=3, local_steps=2, precond=PreconditionerConfig(source="every")),
       decomfl(lr=0.02, perturbations=3, local_steps=2)]


@pytest.mark.parametrize("zo", ZOS, ids=["hiso", "decomfl"])
def test_round_closes_with_whoever_answered(zo):
    fed = Fed(zo)
    fed.round()
    plan = fed.server.plan()
    dead = plan.participants[0]
    ups = []
    for c in plan.participants[1:]:
        ups.append(decode_uplink(fed.clients[c].handle(encode_downlink(fed.server.downlink(c))), fed.server.wire))
    rec = fed.server.aggregate(ups, partial=True)
    assert rec.participants == plan.participants[1:]
    # the mean is over the answers received, nothing else
    want = np.mean(np.stack([u.scalars.astype(np.float64) for u in ups]), axis=0).astype(np.float32)
    assert np.array_equal(rec.scalars, want)
    assert fed.server.synced[dead] < plan.round and all(fed.server.synced[c] == plan.round for c in rec.participants)
    # the history file's participants are who really took part
    assert fed.server.history[-1].participants == rec.participants


def test_strict_mode_still_refuses_a_missing_answer():
    srv = Server(6, 3, 1, 2, seed=0)
    plan = srv.plan()
    ups = [Uplink(c, plan.round, np.zeros((1, 2), np.float32)) for c in plan.participants]
    with pytest.raises(MessageError, match="no answer"):
        srv.aggregate(ups[:-1])
    assert srv.round == 0 and srv.planned is plan  # strict refusal changes nothing


def test_garbage_answers_are_dropped_not_fatal():
    srv = Server(6, 3, 1, 2, seed=0)
    plan = srv.plan()
    outsider = next(c for c in range(6) if c not in plan.participants)
    good = [Uplink(c, plan.round, np.full((1, 2), c, np.float32)) for c in plan.participants[:2]]
    bad = [Uplink(outsider, plan.round, np.zeros((1, 2), np.float32)),       # not sampled
           Uplink(plan.participants[0], plan.round, np.ones((1, 2), np.float32)),  # second answer
           Uplink(plan.participants[2], plan.round + 1, np.zeros((1, 2), np.float32)),  # wrong round
           Uplink(plan.participants[2], plan.round, np.zeros((2, 2), np.float32)),  # wrong shape
           Uplink(plan.participants[2], plan.round, np.full((1, 2), np.nan, np.float32))]  # NaN
    rec = srv.aggregate(good + bad, partial=True)
    assert rec.participants == plan.participants[:2]
    assert np.array_equal(rec.scalars, np.full((1, 2), np.mean(plan.participants[:2]), np.float32))
    assert len(srv.rejected) == len(bad)


def test_a_round_nobody_answered_is_replanned_and_logs_nothing():
    zo = ZOS[0]
    fed = Fed(zo, seed=3)
    for _ in range(3):
        fed.round()
    plan = fed.server.plan()
    for c in plan.participants:  # they all catch up and answer...
        fed.clients[c].handle(encode_downlink(fed.server.downlink(c)))
    assert fed.server.aggregate([], partial=True) is None  # every answer lost
    assert fed.server.round == 3 and len(fed.server.history) == 3 and fed.server.replanned == 1
    # the clients that caught up for the abandoned plan are not stuck: the next rounds go on
    again, rec = fed.round()
    assert again.round == 3 and rec.round == 3
    assert not set(again.seeds.ravel().tolist()) & set(plan.seeds.ravel().tolist())  # fresh seeds
    for _ in range(6):
        fed.round()
    for c in fed.clients.values():
        c.state.replay(fed.server.history[c.state.round:])
        assert _same(c.state, fed.ref)


@pytest.mark.parametrize("zo", ZOS, ids=["hiso", "decomfl"])
def test_lost_replies_never_lock_a_client_out(zo):
    fed = Fed(zo, M=4, m=2, seed=5)
    victim = 1
    lost = 0
    took_part_after_loss = 0
    last_lost_round = None
    for r in range(40):
        # the victim's answer is lost every other time it is sampled
        plan, rec = fed.round(lost={victim} if r % 2 == 0 else ())
        if victim in plan.participants:
            assert fed.clients[victim].state.round == plan.round  # it did catch up and answer
            if r % 2 == 0:
                lost += 1
                last_lost_round = plan.round
                assert fed.server.synced[victim] < plan.round  # the server does not know it
            else:
                if last_lost_round is not None:
                    took_part_after_loss += 1
                assert victim in rec.participants
    assert lost >= 3 and took_part_after_loss >= 3, "the scenario did not exercise lost replies"
    # every replica lands exactly on the server's model
    for c in fed.clients.values():
        c.state.replay(fed.server.history[c.state.round:])
        assert _same(c.state, fed.ref), f"client {c.cid} drifted"


def test_a_reached_client_that_did_not_answer_catches_up_from_an_older_history():
    """The downlink for round r starts at the server's idea of the client (s < have)."""
    zo = ZOS[0]
    fed = Fed(zo, M=3, m=3, seed=1)
    fed.round()
    fed.round(lost={0})           # client 0 reached round 1 but the server thinks it holds 0
    fed.round(lost={0})           # again: it holds 2, server thinks 0
    assert fed.server.synced[0] == 0 and fed.clients[0].state.round == 2
    plan, rec = fed.round()       # the downlink starts at 0, the client skips records 0 and 1
    assert 0 in rec.participants and fed.clients[0].state.round == 3
    fed.clients[0].state.replay(fed.server.history[3:])
    assert _same(fed.clients[0].state, fed.ref)


def test_a_client_refuses_a_history_it_cannot_follow_without_changing():
    zo = ZOS[1]
    task = TinyTask()
    wire = Wire(*zo.shape, seed=0)
    c = Client(0, ModelState(task.build_model(), zo), task.loss, lambda r, k: task.batch(0, r, k, 8), wire=wire)
    recs = tuple(RoundRecord(j, wire.seeds(j), np.ones(zo.shape, np.float32)) for j in range(4))
    before = [p.clone() for p in c.state.params]
    with pytest.raises(MessageError, match="history starts at 2"):  # a gap: records 0, 1 missing
        c.handle(encode_downlink(Downlink(4, wire.seeds(4), 2, recs[2:]), wire))
    c.state.replay(recs[:3])
    with pytest.raises(MessageError, match="ahead of the server"):  # client ahead: another run
        c.handle(encode_downlink(Downlink(2, wire.seeds(2), 0, recs[:2]), wire))
    assert c.state.round == 3


def test_server_learns_an_older_client_round():
    srv = Server(4, 4, 1, 2, seed=0)
    for _ in range(3):
        plan = srv.plan()
        srv.aggregate([Uplink(c, plan.round, np.zeros((1, 2), np.float32)) for c in plan.participants])
    assert srv.synced[2] == 2
    srv.client_holds(2, 0)  # e.g. the node restarted from x_0
    srv.plan()
    assert srv.downlink(2).since == 0 and len(srv.downlink(2).missed) == 3
    srv.client_holds(2, 1)  # never moves forward
    assert srv.synced[2] == 0
    with pytest.raises(MessageError):
        srv.client_holds(2, 7)


def test_resume_replays_replanned_rounds_from_their_logged_attempt():
    """A round planned four times is logged with attempt 3: a fresh server re-draws the three
    abandoned samples, derives the logged seeds and continues exactly where the run was."""
    srv = Server(6, 2, 1, 3, seed=2)
    for r in range(6):
        for _ in range(3 if r == 2 else 1 if r == 4 else 0):  # rounds 2 and 4: nobody answered
            srv.plan()
            srv.aggregate([], partial=True)
        p = srv.plan()
        srv.aggregate([Uplink(c, p.round, np.ones((1, 3)), attempt=p.attempt) for c in p.participants])
    assert [r.attempt for r in srv.history] == [0, 0, 3, 0, 1, 0] and srv.replanned == 4
    again = Server(6, 2, 1, 3, seed=2)
    for rec in srv.history:
        plan = again.plan_logged(rec)
        assert np.array_equal(plan.seeds, rec.seeds)
        again.close_logged(rec)
    assert again.replanned == 4
    a, b = srv.plan(), again.plan()
    assert a.participants == b.participants and np.array_equal(a.seeds, b.seeds)
    other = Server(6, 2, 1, 3, seed=3)  # another run's log is refused
    with pytest.raises(ValueError, match="not the ones this run derives"):
        other.plan_logged(srv.history[0])


def test_planned_is_the_open_plan_and_read_only():
    srv = Server(6, 3, 1, 2, seed=0)
    assert srv.planned is None
    plan = srv.plan()
    assert srv.planned is plan
    with pytest.raises(AttributeError):
        srv.planned = None
    srv.aggregate([Uplink(c, plan.round, np.zeros((1, 2), np.float32)) for c in plan.participants])
    assert srv.planned is None and srv.round == 1
