"""The core :class:`~hiso.core.server.Server` as one round's driver: what
:func:`hiso.core.round.play_round` (and, on resume, :func:`hiso.core.round.replay_log`) calls for
the seed-and-scalar methods, whatever the transport (the simulator's in-process one, a Flower grid)."""

from __future__ import annotations

from typing import Callable

from .history import RoundRecord
from .messages import MessageError, Uplink, decode_uplink, encode_downlink, encode_uplink
from .server import Server


class ScalarRounds:
    """The core :class:`~hiso.core.server.Server` as :func:`hiso.core.round.play_round` drives
    it: downlinks and uplinks encoded with the run's wire; a closed round logged and folded into
    ``replica`` (the server's x_r), then ``on_commit(record)`` (the log file, the DP ledger)."""

    def __init__(self, server: Server, replica=None, on_commit: Callable[[RoundRecord], None] | None = None,
                 loss_slot: float | None = 0.0):
        self.server, self.replica, self.on_commit = server, replica, on_commit
        self.loss_slot = loss_slot  # a logged answer's loss, for its size only (None: answers carry none)

    @property
    def wire(self):
        return self.server.wire

    def plan(self):
        return self.server.plan()

    def downlink(self, client: int) -> bytes:
        return encode_downlink(self.server.downlink(client), self.server.wire)

    def decode(self, client: int | None, reply: bytes, plan) -> Uplink:
        up = decode_uplink(reply, self.server.wire)
        if client is not None and up.client != client:
            raise MessageError(f"the node of partition {client} answered for client {up.client}")
        return up

    def close(self, answers: list, partial: bool) -> RoundRecord | None:
        return self.server.aggregate(answers, partial=partial)

    def rejections(self) -> list[tuple[str, str]]:
        return list(zip(self.server.rejected_reasons, self.server.rejected))

    def commit(self, record: RoundRecord) -> None:
        if self.replica is not None:
            self.replica.apply(record)
        if self.on_commit is not None:
            self.on_commit(record)

    # resume (hiso.core.round.replay_log): the log's rounds planned, sized and folded again
    def plan_logged(self, record: RoundRecord, on_plan=None):
        return self.server.plan_logged(record, on_plan=on_plan)

    def logged_answer(self, client: int, record: RoundRecord) -> bytes:
        # its size only (FeedSign: the logged vote may be 0, which no client sends)
        return encode_uplink(Uplink(client, record.round, record.scalars, self.loss_slot, record.attempt),
                             self.server.wire, check=False)

    def close_logged(self, record: RoundRecord, fold: bool) -> None:
        self.server.close_logged(record)
        if fold and self.replica is not None:
            self.replica.apply(record)

    def replayed(self) -> None:
        pass
