"""A Flower grid as the round's transport (:class:`hiso.core.round.Transport`)."""

from __future__ import annotations

import time
from pathlib import Path

from ..core.messages import MessageError
from ..core.round import PlainTransport
from .records import log, reply_bytes, reply_int


HOLD = "HOLD"  # in the run directory: a round number the ServerApp holds before, while the file exists


def hold(settings, round: int) -> None:
    """Wait, before the first message of round ``round``, while the run directory's ``HOLD``
    file names a round at or below it: an operator (or a test) holds the federation at a round
    boundary, e.g. to restart or cut off a node, and lets it go on by removing the file. A
    file that does not hold a round number holds every round."""
    path = Path(settings.out_dir, HOLD)
    said = False
    while True:
        try:
            text = path.read_text().strip()
        except OSError:
            return
        if text.isdigit() and int(text) > round:
            return
        if not said:
            log.warning("round %d: held by %s (remove it to go on)", round, path)
            said = True
        time.sleep(max(settings.poll_s, 0.05))


def reach_sampled(fed, plan) -> tuple[float, float]:
    """What every Flower transport does before it sends a round's messages: wait while the run
    is held, learn the nodes, have the sampled partitions' nodes join; returns (start, nodes
    refreshed) for the round's timings."""
    hold(fed.settings, plan.round)
    t0 = time.perf_counter()
    fed.refresh_nodes()
    t1 = time.perf_counter()
    fed.join_sampled(plan.participants)
    return t0, t1


class GridTransport(PlainTransport):
    """A Flower grid as the round's transport: the nodes refreshed, the sampled partitions'
    nodes asked (a node whose replica is older than the server thought says ``behind`` and is
    asked again from its round), the ``up`` of each reply returned.

    What a train message carries is the method's: by default the downlink's bytes in the
    ``down`` field of the hiso ConfigRecord. A subclass may set ``content(down)`` (the
    message's RecordDict) and ``kept(pid, reply)`` (what of a reply :meth:`answers` gets) and
    override :meth:`answers` (the replies as the method's decoder takes them, counted).
    ``fed``: the ServerApp's :class:`~hiso.flower.server_app.FlowerFederation` (which imports
    this module: the type is named here, not imported)."""

    content = None
    kept = None

    def __init__(self, fed):
        self.fed = fed

    def exchange(self, plan, downlink, tally) -> list:
        fed = self.fed
        t0, t1 = reach_sampled(fed, plan)
        replies = fed._send(plan.round, plan.participants, downlink, self.content, self.kept)
        self.ask_behind(plan, replies, downlink)
        fed.times = (t0, t1, time.perf_counter())
        return self.answers(plan, replies, tally)

    def ask_behind(self, plan, replies: dict, downlink) -> None:
        """The nodes whose replica is older than the server thought, asked again from their round."""
        fed = self.fed
        behind = {}
        for pid, r in replies.items():
            if "behind" in r:
                try:
                    behind[pid] = reply_int(r, "behind")
                except MessageError as e:
                    log.warning("round %d: dropped the answer of partition %d: %s", plan.round, pid, e)
        for pid, held in behind.items():  # its replica is older than we thought: resend from its round
            fed.server.client_holds(pid, held)
        if behind:
            replies.update(fed._send(plan.round, list(behind), downlink))

    def answers(self, plan, replies: dict, tally) -> list:
        """Each reply's ``up`` bytes, counted (and, under local DP, released)."""
        out = []
        for pid, r in replies.items():
            if "up" not in r:
                continue
            try:
                data = reply_bytes(r, "up")
            except MessageError as e:
                log.warning("round %d: dropped the answer of partition %d: %s", plan.round, pid, e)
                continue
            tally.up(pid, len(data))
            tally.released(plan, pid)  # local DP: every answer that reaches the server is a release
            out.append((pid, data))
        return out
