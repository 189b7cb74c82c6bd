"""The client's side: join, catch up (replay what it missed, or load a snapshot), run the
local update, answer.

A client's whole state is its replica (x and H as of the round it last took part in). It
never keeps the local iterates: after answering it still holds x_r exactly, and the next
downlink brings the records (or the snapshot) that move it on.

Joining: the client answers the server's welcome only if the server's configuration (every
field of its ZOConfig, scalar dtype and direction family included) and initial trainable
tensors are its own (:func:`~hiso.core.messages.check_welcome`); from the welcome it learns
the run's seed, from which every round's seeds derive.
"""

from __future__ import annotations

from typing import Any, Callable

from .estimator import LossFn, local_update
from .messages import (Downlink, Hello, MessageError, Uplink, Wire, check_welcome, decode_downlink,
                       decode_welcome, encode_hello, encode_uplink, load_state, tensors_fingerprint)
from .perturb import Mode, Perturber
from .seeds import secret_key
from .state import ModelState
from .work import Work

BatchFn = Callable[[int, int], Any]  # (round, local step) -> minibatch


def answer(cid: int, state: ModelState, perturber: Perturber, loss_fn: LossFn, batch_fn: BatchFn,
           msg: Downlink, report_loss: bool = True, dp_seed: int = 0) -> Uplink:
    """Client ``cid``'s local update for the round of ``msg`` from ``state`` (which must
    already hold that round's x_r and H_r): the one computation behind :meth:`Client.train`
    and the simulator's fast mode, where one shared replica stands for every client.

    The method's hooks (:mod:`hiso.core.method`) decide the batches and the computation. Under
    local differential privacy the scalars are clipped and noised here, before they leave
    (``dp_seed``: the client's secret for its noise; see :mod:`hiso.methods.privacy`)."""
    return answer_work(cid, state, perturber, loss_fn, batch_fn, msg, report_loss, dp_seed)[0]


def answer_work(cid: int, state: ModelState, perturber: Perturber, loss_fn: LossFn, batch_fn: BatchFn,
                msg: Downlink, report_loss: bool = True, dp_seed: int = 0) -> tuple[Uplink, Work]:
    """:func:`answer`, and the forwards and backpropagations it took (:class:`~hiso.core.work.Work`)."""
    method = state.cfg.method
    batches = [batch_fn(msg.round, k) for k in range(state.cfg.local_steps if method is None else method.batches(state.cfg))]
    res = None if method is None else method.local_update(state, perturber, loss_fn, batches, msg.seeds)
    if res is None:
        res = local_update(state, perturber, loss_fn, batches, msg.seeds)
    scalars, dp = res.scalars, state.cfg.dp
    if dp is not None and dp.mode == "local":
        scalars = dp.private_answer(scalars, dp_seed, msg.round, msg.attempt, cid)
    return Uplink(cid, msg.round, scalars, res.loss if report_loss else None, msg.attempt), res.work


class Client:
    def __init__(self, cid: int, state: ModelState, loss_fn: LossFn, batch_fn: BatchFn,
                 perturb_mode: Mode = "hooks", report_loss: bool = True, wire: Wire | None = None,
                 batch_memory: int | None = None, dp_seed: int | None = None):
        self.cid, self.state, self.loss_fn, self.batch_fn = cid, state, loss_fn, batch_fn
        self.perturber = Perturber(state.model, state.params, perturb_mode, batch_memory)
        self.report_loss = report_loss
        self.dp_seed = secret_key(dp_seed)  # local DP: this client's secret
        self.wire = wire  # set by join()
        self.work = Work()  # what its last answer computed

    def hello(self) -> bytes:
        """The join request: who this client is and the round its replica holds."""
        return encode_hello(Hello(self.cid, self.state.round))

    def join(self, welcome: bytes, init_fingerprint: bytes | None = None) -> Wire:
        """Check the server's welcome against this client (nothing else changes); raises
        :class:`~hiso.core.messages.JoinError` on any mismatch."""
        msg = decode_welcome(welcome)
        init = init_fingerprint
        if init is None:
            if self.state.round != 0:
                raise MessageError(f"client {self.cid} holds round {self.state.round}: give the fingerprint of its "
                                   f"initial tensors to join")
            init = tensors_fingerprint(self.state.params)  # the replica still is x_0
        self.wire = check_welcome(msg, self.state.cfg, init)
        self.state.gen.bind(run_seed=self.wire.seed)  # a family whose directions depend on it
        return self.wire

    def catch_up(self, msg: Downlink) -> None:
        """Replay the records the client missed (checked against its state first), or load
        the snapshot the downlink carries.

        The history may start before the client's round (the server did not get its last
        answer, so it does not know the client caught up): the records it already holds are
        skipped. A history that starts after the client's round, or a round behind the
        client's, cannot be followed and is refused before anything changes.
        """
        have = self.state.round
        if have > msg.round:
            raise MessageError(f"client {self.cid} holds round {have}, ahead of the server's round {msg.round}")
        if msg.snapshot is not None:
            load_state(self.state, msg.snapshot, msg.round)
            return
        if msg.since > have:
            raise MessageError(f"client {self.cid} holds round {have}, history starts at {msg.since}")
        self.state.replay(msg.missed[have - msg.since:])

    def train(self, msg: Downlink) -> Uplink:
        self.catch_up(msg)
        up, self.work = answer_work(self.cid, self.state, self.perturber, self.loss_fn, self.batch_fn, msg,
                                    self.report_loss, self.dp_seed)
        return up

    def handle(self, data: bytes) -> bytes:
        """Bytes in, bytes out: what a transport (Flower, a socket) calls."""
        if self.wire is None:
            raise MessageError(f"client {self.cid} has not joined the run (no welcome yet)")
        msg = decode_downlink(data, self.wire)
        return encode_uplink(self.train(msg), self.wire)
