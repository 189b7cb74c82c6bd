"""The round, written once: plan -> query -> collect -> decode -> combine -> log and fold.

Every driver of every method runs its rounds through :func:`play_round`: the in-process
simulator (fast and faithful, reliable or with faults), the schedule counter, the Flower
ServerApp, its SecAgg+ variant, FedKSeed and the full-model baselines. What differs is
supplied by two objects:

* a :class:`Rounds`, the method's server side: it plans a round (who, which seeds), gives
  each sampled client its downlink, decodes an answer, combines the answers into the round's
  record (or None: no valid answer, plan again) and commits it (logged, every replica folds
  it). The core :class:`~hiso.core.server.Server` is one (through
  ``hiso.runners.protocol.ScalarRounds``), FedKSeed's pool server and the full-model server
  are others;
* a :class:`Transport`, which only moves messages: given the plan and the downlink of each
  client it returns the replies that came back, as ``(client, payload)`` pairs (a client it
  cannot name: None). In process, over a Flower grid, through a fault injector.

A :class:`Tally` counts what crossed the network (bytes each way per client) and, under local
DP, each answer the server received; the transport counts the uplinks (only it knows what was
sent and lost), the round counts the downlinks.

Resume replays a log through :func:`replay_log` and a :class:`LoggedRounds` (the same two
server sides), so every driver of a method resumes the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .errors import MessageError


class Plan(Protocol):
    round: int
    participants: tuple[int, ...]
    attempt: int


class Rounds(Protocol):
    """A method's server side of a round (see the module docstring)."""

    def plan(self) -> Plan: ...

    def downlink(self, client: int) -> Any: ...

    def decode(self, client: int | None, reply: Any, plan: Plan) -> Any:
        """The answer in ``reply`` (an object with ``client`` and ``loss``); raises
        :class:`~hiso.core.errors.MessageError` for a reply that cannot be used."""

    def close(self, answers: list, partial: bool) -> Any | None:
        """The round's record from the decoded ``answers``, or None (planned again); the
        answers it dropped are left in :meth:`rejections`."""

    def rejections(self) -> list[tuple[str, str]]:
        """(code, why) of each answer the last :meth:`close` dropped."""

    def commit(self, record: Any) -> None:
        """The closed round logged and folded into the server's replica."""


class LoggedRounds(Protocol):
    """A method's server side replaying its own log on resume (see :func:`replay_log`)."""

    def plan_logged(self, record: Any, on_plan: Callable[[Plan], None] | None = None) -> Plan:
        """Round ``record.round`` planned again as the run planned it (its draws checked against
        the log); ``on_plan(plan)`` hears every plan of it, abandoned attempts included."""

    def downlink(self, client: int) -> Any: ...

    def logged_answer(self, client: int, record: Any) -> Any:
        """The answer ``client`` gave to ``record`` as the wire carried it (its size is counted)."""

    def close_logged(self, record: Any, fold: bool) -> None:
        """The planned round closed with its logged record; folded into the replica if ``fold``."""

    def replayed(self) -> None:
        """After the last record: whatever the replica defers to the end (FedKSeed's model)."""


class Transport(Protocol):
    def exchange(self, plan: Plan, downlink: Callable[[int], Any], tally: "Tally") -> list[tuple[int | None, Any]]:
        """Send each participant its ``downlink(client)`` and return the replies that came back."""

    def unwrap(self, reply: Any) -> Any:
        """A reply as the method's decoder takes it (a frame checked and removed); raises
        MessageError for a damaged one."""


class Tally:
    """What a round counts; no-ops here (the schedule of bytes is a driver's choice)."""

    def down(self, client: int, n: int) -> None:
        pass

    def up(self, client: int, n: int) -> None:
        pass

    def released(self, plan: Plan, client: int) -> None:
        """Local DP: the server received an answer of ``client`` to ``plan`` (a release)."""


class PlainTransport:
    """Base of the transports whose replies need no unwrapping."""

    def unwrap(self, reply: Any) -> Any:
        return reply


def reject_code(e: MessageError) -> str:
    """The counted reason of a reply the decoder refused."""
    if e.code == "malformed" and "non-finite" in str(e):  # the decoders' refusal of a nan or inf
        return "non_finite"
    return e.code


class RoundsExhausted(RuntimeError):
    """:func:`play_round` planned the round ``max_plans`` times and none closed."""


@dataclass
class Played:
    """A closed round: its record, the answers decoded (in arrival order), the plans it took
    and the replies refused, by reason."""

    record: Any
    plan: Plan
    answers: list
    replanned: int = 0
    rejected: Counter = field(default_factory=Counter)


def play_round(server: Rounds, transport: Transport, tally: Tally | None = None, *, partial: bool = False,
               max_plans: int = 1000, before: Callable[[Plan], None] | None = None,
               on_reject: Callable[[Plan, int | None, str, str], None] | None = None,
               on_replan: Callable[[Plan], None] | None = None) -> Played:
    """One round of any method over any transport (see the module docstring).

    ``partial``: close with the valid answers (a round with none is planned again, at most
    ``max_plans`` times); strict (default): every participant must answer validly, else the
    method's ``close`` raises. ``before(plan)`` runs once a round is planned (the DP budget's
    check); ``on_reject(plan, client, code, why)`` hears each refused reply; ``on_replan(plan)``
    each plan that closed with nothing; when ``max_plans`` closed with nothing it raises
    :class:`RoundsExhausted`."""
    tally = tally or Tally()
    rejected: Counter = Counter()

    def downlink(client: int) -> Any:
        msg = server.downlink(client)
        tally.down(client, _size(msg))
        return msg

    for attempt in range(max_plans):
        plan = server.plan()
        if before is not None:
            before(plan)
        answers = []
        for client, reply in transport.exchange(plan, downlink, tally):
            try:
                answer = server.decode(client, transport.unwrap(reply), plan)
            except MessageError as e:
                code = reject_code(e)
                rejected[code] += 1
                if on_reject is not None:
                    on_reject(plan, client, code, str(e))
                continue
            answers.append(answer)
        record = server.close(answers, partial)
        for code, why in server.rejections():
            rejected[code] += 1
            if on_reject is not None:
                on_reject(plan, None, code, why)
        if record is not None:
            server.commit(record)
            return Played(record, plan, answers, attempt, rejected)
        if on_replan is not None:
            on_replan(plan)
    raise RoundsExhausted(f"round {plan.round}: no client answered validly in {max_plans} attempts")


def _size(msg: Any) -> int:
    """A downlink's bytes on the wire (a message that is not bytes says so by ``nbytes``)."""
    return len(msg) if isinstance(msg, (bytes, bytearray, memoryview)) else int(msg.nbytes)


def replay_log(server: LoggedRounds, records: list, tally: Tally | None = None, *, first: int = 0,
               each: Callable[[int, Any, Plan], None] | None = None,
               send: Callable[[int, Plan], None] | None = None) -> dict[int, int]:
    """Resume, the other half of :func:`play_round`: bring a new server to the end of an
    interrupted run's log as if it had played it. Each logged round is planned again (the
    server's streams are seeded: its sample and seeds are checked against the log), the bytes
    of its messages are counted in ``tally`` as if every sampled client answered as logged, and
    it is closed with its record, folded into the replica from record ``first`` on (a
    checkpoint's round; the earlier ones are in it). ``each(i, record, plan)`` runs before
    record i is closed (the replica still at its round: a faithful client rebuilt there).
    ``send(i, plan)``: the driver replays every plan of record i itself (its faults' fates and
    abandoned attempts) and counts its bytes; nothing is counted here then. Returns the round
    each client last answered."""
    tally = tally or Tally()
    last: dict[int, int] = {}
    for i, rec in enumerate(records):
        if send is None:
            plan = server.plan_logged(rec)
            for client in plan.participants:
                tally.down(client, _size(server.downlink(client)))
                if client in rec.participants:
                    tally.up(client, _size(server.logged_answer(client, rec)))
        else:
            plan = server.plan_logged(rec, on_plan=lambda p, i=i: send(i, p))
        if each is not None:
            each(i, rec, plan)
        server.close_logged(rec, fold=rec.round >= first)
        last.update(dict.fromkeys(rec.participants, rec.round))
    server.replayed()
    return last
