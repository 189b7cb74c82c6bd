"""Secure aggregation of the scalar uplink over Flower (``--secagg``): the ServerApp learns the
sum of a round's answers and nothing else, by Flower's own SecAgg+ (``secaggplus_mod`` on the
ClientApp, ``SecAggPlusWorkflow`` on the ServerApp).

How a round runs (:class:`SecAggFederation`, a :class:`~hiso.flower.server_app.FlowerFederation`
whose round, :func:`hiso.core.round.play_round` as every runner's, goes over a
:class:`SecureTransport` and closes through :class:`SecureRounds`):

1. The server plans the round as always and encodes each sampled partition's downlink.
2. A thin strategy (:class:`_Strategy`) hands the workflow one ``FitIns`` per node, whose
   config carries the downlink (``down``) and the lineage; the workflow runs its four stages
   (setup: public keys; share keys; collect masked vectors: the ``FitIns`` goes to the
   ClientApp, which trains; unmask) over a grid adapter (:class:`_Grid`) that sends and
   pulls as hiso's ServerApp does (0.1 s polls, the round timeout per stage, suspects),
   instead of ``Grid.send_and_receive``'s 3 s polls.
3. The ClientApp (:mod:`hiso.flower.secagg_client`: ``handle_train_secagg``, behind ``secagg_mod``) answers the
   ``FitIns`` as a legacy ``FitRes`` whose parameters are its tau x P scalars and its loss
   (not under DP: no loss leaves a client there) on secure aggregation's grid
   (:mod:`hiso.methods.secagg`: float64 multiples of the step, so Flower's quantiser lands on
   integers exactly); the mod masks them and clears the arrays.
4. The workflow unmasks the sum of the survivors' answers (dropped clients' masks rebuilt from
   ``threshold`` shares) and passes its dequantised mean to the strategy's ``aggregate_fit``;
   the server recovers the exact integer sum from it (:func:`hiso.methods.secagg.sum_from_mean`)
   and closes the round with ``Server.close_secure``: the mean (plus the DP noise, central
   mode) is logged and replayed as always.

Each node shares its secrets with every node of the round, or, with ``secagg_shares`` k, with the k
nodes around it on a ring the workflow shuffles each round (itself included: SecAgg+'s sparse
graph, Bell et al. 2020), so a node's work and bytes grow with k instead of the round's size; the
round then closes while every node keeps ``threshold`` of its k answering.

What the server receives from a node: its public keys, encrypted shares for other nodes, its
masked vector (uniform modulo 2^modulus_bits), shares of secrets, and the answer's metadata
(``client``, ``round``, ``attempt``): never its scalars or its loss.

Flower's workflow (1.41, 1.42) loses a round when a node drops before it has shared its keys (stage
setup or share keys): at unmask it asks the others for shares of that node's key, which do not
exist, and would remove pairwise masks that were never added. :class:`_Workflow` forgets such
a node (it never took part), so any dropout within the threshold still closes the round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from ..core.messages import MessageError, Uplink, encode_uplink
from ..core.round import PlainTransport, RoundsExhausted, play_round
from ..methods.secagg import SecAggConfig, mean_loss, sum_from_mean
from ..runners.common import CommTally
from ..core.server_rounds import ScalarRounds
from .records import log
from .secagg_client import BEHIND
from .transport import reach_sampled
from .server_app import FlowerFederation


# ---------------------------------------------------------------- the ServerApp's side


def payload_bytes(content: RecordDict) -> int:
    """Bytes of a message's records as Flower serialises them (its objects, without metadata)."""
    return sum(len(o.deflate()) for o in get_all_nested_objects(content).values())


class _Workflow(SecAggPlusWorkflow):
    """Flower's workflow, forgetting a node that drops before it has shared its keys (see the
    module docstring): it never took part, so there is nothing of it to unmask."""

    def setup_stage(self, grid, context, state) -> bool:
        ok = super().setup_stage(grid, context, state)
        _forget_absent(state)
        return ok

    def share_keys_stage(self, grid, context, state) -> bool:
        ok = super().share_keys_stage(grid, context, state)
        _forget_absent(state)
        return ok


def _forget_absent(state) -> None:
    active = set(state.active_node_ids)
    state.sampled_node_ids = active
    state.nid_to_neighbours = {nid: nb & active for nid, nb in state.nid_to_neighbours.items() if nid in active}


@dataclass
class _Proxy:
    node_id: int


class _Strategy:
    """What the workflow asks of a legacy strategy: the round's ``FitIns`` per node (our
    downlinks), and ``aggregate_fit``, which receives the secure mean (kept, not applied)."""

    def __init__(self, fitins: dict[int, dict]):
        self.fitins, self.results, self.failures = fitins, None, []

    def configure_fit(self, server_round, parameters, client_manager):
        empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
        return [(_Proxy(nid), FitIns(empty, dict(fields))) for nid, fields in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = list(results), list(failures)
        return None, {}


class _Grid:
    """The workflow's grid: hiso's exchange (:meth:`FlowerFederation._exchange`) instead of
    ``send_and_receive``'s 3 s polls; counts each stage's bytes and time, and hears a node's
    ``behind`` (its replica is older than the server thought)."""

    def __init__(self, fed: "SecAggFederation"):
        self.fed, self.stages = fed, []

    def send_and_receive(self, messages, *, timeout=None):
        msgs = list(messages)
        t0 = time.perf_counter()
        sent = sum(payload_bytes(m.content) for m in msgs)
        replies = self.fed._exchange(msgs)
        got = 0
        for rep in replies:
            if rep.has_error():
                m = BEHIND.search(rep.error.reason or "")
                if m:
                    self.fed.server.client_holds(int(m.group(1)), int(m.group(2)))
                else:
                    log.warning("secagg: node %s failed: %s", rep.metadata.src_node_id, rep.error.reason)
                continue
            got += payload_bytes(rep.content)
        self.stages.append({"s": time.perf_counter() - t0, "sent": len(msgs), "answered": len(replies),
                            "bytes_down": sent, "bytes_up": got})
        return replies

    def __getattr__(self, name):  # anything else the workflow may ask of a grid
        return getattr(self.fed.grid, name)


@dataclass
class SecureSum:
    """What a SecAgg+ round tells the server: who answered, the integer sum of their answers'
    levels (tau, P) and of their loss levels."""

    answered: tuple[int, ...]
    total: np.ndarray
    loss_total: int | None  # None under DP: no answer carries a loss


class SecureRounds(ScalarRounds):
    """The core Server's round closed by a secure sum: the one answer a round gets is the
    :class:`SecureSum` (no client names it), closed with ``Server.close_secure``; no answer
    (the sum did not close) re-plans the round with fresh seeds, nothing logged."""

    def decode(self, client: int | None, reply, plan) -> SecureSum:
        if client is not None or not isinstance(reply, SecureSum):
            raise MessageError(f"round {plan.round}: a secure round takes only its secure sum, "
                               f"not {type(reply).__name__}")
        return reply

    def close(self, answers: list, partial: bool):
        if not answers:
            return self.server.aggregate([], partial=True)  # nothing logged: planned again, fresh seeds
        (got,) = answers
        return self.server.close_secure(got.answered, got.total)

    def rejections(self) -> list[tuple[str, str]]:
        return []  # a secure sum is used whole or not at all (close_secure raises)


class SecureTransport(PlainTransport):
    """SecAgg+ as the round's transport: the nodes refreshed, the sampled partitions' nodes
    that have one given their downlink in the workflow's ``FitIns``, the workflow run
    (:meth:`SecAggFederation.secure_sum`); its reply is the :class:`SecureSum` (from no one
    client), or none when the sum did not close. Each answered partition's uplink is counted
    as the protocol's encoded answer would be (hiso run's bytes)."""

    def __init__(self, fed: "SecAggFederation"):
        self.fed = fed

    def exchange(self, plan, downlink, tally) -> list:
        fed = self.fed
        t0, t1 = reach_sampled(fed, plan)
        fitins = {}
        for pid in plan.participants:
            nid = fed.node_of.get(pid)
            if nid is None:
                continue
            fitins[nid] = {"down": downlink(pid), **fed._lineage_field()}
        fed._stages = []
        got = fed.secure_sum(plan, fitins)
        fed.times = (t0, t1, time.perf_counter())
        if got is None:
            return []
        wire = fed.server.wire
        for pid in got.answered:  # the bytes of the answer as the protocol counts it (hiso run's)
            tally.up(pid, len(encode_uplink(Uplink(pid, plan.round, np.zeros(wire.shape, np.float32),
                                                   fed._loss_slot, plan.attempt), wire)))
        return [(None, got)]


class SecAggFederation(FlowerFederation):
    """A :class:`FlowerFederation` whose rounds close with a secure sum (see the module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.grid_cfg: SecAggConfig = self.cfg.secagg_config
        self.rounds = SecureRounds(self.server, self.state, on_commit=self._logged, loss_slot=self._loss_slot)

    def _init_nodes(self) -> None:
        super()._init_nodes()
        self.transport = SecureTransport(self)
        self._stages: list[dict] = []

    def secure_sum(self, plan, fitins: dict[int, dict]) -> SecureSum | None:
        """Run SecAgg+ for the planned round over the nodes of ``fitins`` (node id -> FitIns
        config); None when the round cannot close (too few answers, shares or nodes)."""
        g = self.grid_cfg
        if len(fitins) < g.threshold:
            log.warning("round %d: %d nodes for a threshold of %d", plan.round, len(fitins), g.threshold)
            return None
        strategy, grid = _Strategy(fitins), _Grid(self)
        ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            strategy=strategy)
        ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: plan.round})
        ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        shares = self.cfg.secagg_shares or 1.0  # a count of nodes, or Flower's fraction: 1.0 is all of them
        workflow = _Workflow(num_shares=shares, reconstruction_threshold=g.threshold, max_weight=1.0,
                             clipping_range=g.clip, quantization_range=g.levels, modulus_range=g.modulus)
        workflow(grid, ctx)
        self._stages = grid.stages
        if not strategy.results:
            return None
        answered = []
        for proxy, res in strategy.results:
            pid, m = self.part_of.get(proxy.node_id), res.metrics
            if (pid is None or m.get("client") != pid or m.get("round") != plan.round
                    or m.get("attempt") != plan.attempt):
                log.warning("round %d: node %s answered %s in a secure sum: the round is dropped", plan.round,
                            proxy.node_id, m)
                return None  # its answer is inside the sum: nothing of the sum can be used
            answered.append(pid)
        arrays = parameters_to_ndarrays(strategy.results[0][1].parameters)
        n = len(answered)
        total = sum_from_mean(arrays[0], n, g).reshape(self.server.shape)
        loss = int(sum_from_mean(arrays[1], n, g)[0]) if len(arrays) > 1 else None
        return SecureSum(tuple(answered), total, loss)

    def step(self) -> float | None:
        """One round through SecAgg+ (:func:`hiso.core.round.play_round` over a
        :class:`SecureTransport`); the secure mean of the answers' losses (None under DP: no
        answer carries one)."""
        def replanned(plan) -> None:
            log.warning("round %d: the secure sum did not close; planning it again", plan.round)

        attempts = self.settings.max_replans + 1
        try:  # (no release is counted: the transport never calls tally.released, as before)
            played = play_round(self.rounds, self.transport, CommTally(self.comm), partial=True, max_plans=attempts,
                                before=self.check_budget, on_replan=replanned)
        except RoundsExhausted:
            raise RuntimeError(f"round {self.server.round}: no secure sum closed in {attempts} attempts") from None
        self._timed(played.record, played.plan, self.times, secagg_stages=self._stages)
        got = played.answers[0]
        if got.loss_total is None:  # DP: no client sent its loss
            return None
        return mean_loss(got.loss_total, len(got.answered), self.grid_cfg)
