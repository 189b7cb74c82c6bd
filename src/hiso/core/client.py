"""The client's side: catch up by replaying what it missed, run the local update, answer.

A client's whole state is its replica (x and H as of the round it last took part in). It
never keeps the local iterates: after answering it still holds x_r exactly, and the next
downlink brings the records that move it on.
"""

from __future__ import annotations

from typing import Any, Callable

from .estimator import LossFn, local_update
from .messages import Downlink, MessageError, Uplink, decode_downlink, encode_uplink
from .perturb import Mode, Perturber
from .state import ModelState

BatchFn = Callable[[int, int], Any]  # (round, local step) -> minibatch


class Client:
    def __init__(self, cid: int, state: ModelState, loss_fn: LossFn, batch_fn: BatchFn,
                 perturb_mode: Mode = "hooks", report_loss: bool = True):
        self.cid, self.state, self.loss_fn, self.batch_fn = cid, state, loss_fn, batch_fn
        self.perturber = Perturber(state.model, state.params, perturb_mode)
        self.report_loss = report_loss

    def catch_up(self, msg: Downlink) -> None:
        """Replay the records the client missed (checked against its state first).

        The history may start before the client's round (the server did not get its last
        answer, so it does not know the client caught up): the records it already holds are
        skipped. A history that starts after the client's round, or a round behind the
        client's, cannot be followed and is refused before anything changes.
        """
        have = self.state.round
        if msg.since > have:
            raise MessageError(f"client {self.cid} holds round {have}, history starts at {msg.since}")
        if have > msg.round:
            raise MessageError(f"client {self.cid} holds round {have}, ahead of the server's round {msg.round}")
        self.state.replay(msg.missed[have - msg.since:])

    def train(self, msg: Downlink) -> Uplink:
        self.catch_up(msg)
        tau = self.state.cfg.local_steps
        batches = [self.batch_fn(msg.round, k) for k in range(tau)]
        scalars, loss = local_update(self.state, self.perturber, self.loss_fn, batches, msg.seeds)
        return Uplink(self.cid, msg.round, scalars, loss if self.report_loss else None)

    def handle(self, data: bytes) -> bytes:
        """Bytes in, bytes out: what a transport (Flower, a socket) calls."""
        msg = decode_downlink(data, expect_shape=self.state.cfg.shape)
        return encode_uplink(self.train(msg))
