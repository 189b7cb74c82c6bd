"""The ClientApp's side of secure aggregation (``--secagg``; the protocol is described in
:mod:`hiso.flower.secagg`): Flower's ``secaggplus_mod`` for SecAgg+ messages, and the answer to
the stage that trains, in the layout the mod masks. Light to import (the mod itself is
imported with the first SecAgg+ message): every ClientApp process loads this module."""

from __future__ import annotations

import re

from flwr.app import Message
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from ..config import RunConfig
from ..core.messages import Wire, decode_uplink
from ..methods.secagg import answer_levels, loss_level
from .client_app import train_fields
from .records import _cfg_json, _partition, _state_dir, log

FITINS = "fitins.config"  # where the workflow puts a FitIns' config (the downlink) in a message
BEHIND = re.compile(r"hiso-behind partition=(\d+) round=(\d+)")


class Behind(RuntimeError):
    """This node's replica is older than the round's history: the server resends from its round
    (an error reply, since a SecAgg+ answer has no room for it; the node drops out of this round)."""

    def __init__(self, partition: int, round: int):
        super().__init__(f"hiso-behind partition={partition} round={round}")


def is_secagg(msg) -> bool:
    """Whether ``msg`` is a stage of Flower's SecAgg+ protocol."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


def secagg_mod(msg, ctxt, call_next):
    """Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round; every other message
    (queries, plain ``train``) passes through untouched."""
    if msg.metadata.message_type == "train" and is_secagg(msg):
        from flwr.client.mod import secaggplus_mod
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def answer_fitres(cfg: RunConfig, up: bytes) -> FitRes:
    """A node's encoded uplink as the ``FitRes`` SecAgg+ masks: its scalars (clipped to the DP
    norm first, central DP) and its loss on the grid, float64, one array each; under DP the
    uplink carries no loss, and the answer no loss array."""
    grid = cfg.secagg_config
    u = decode_uplink(up, Wire.of(cfg.zo(), cfg.seed))
    if grid.clipped(u.scalars):
        log.warning("partition %d, round %d: %d scalars outside +-%g were clipped (raise secagg_clip)",
                    u.client, u.round, grid.clipped(u.scalars), grid.clip)
    levels = answer_levels(u.scalars, grid, cfg.zo().dp)  # raises on a non-finite scalar: the node drops out
    arrays = [grid.values(levels).ravel()]
    if u.loss is not None:  # (never under DP: hiso.methods.privacy.reports_loss)
        arrays.append(grid.values([loss_level(u.loss, grid)]))
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1,
                  {"client": u.client, "round": u.round, "attempt": u.attempt})


def handle_train_secagg(msg, context, cfg: RunConfig):
    """Stage 'collect masked vectors': catch up, train and answer, as ``handle_train`` does,
    with the answer in the layout ``secaggplus_mod`` masks (a legacy ``FitRes``)."""
    fields = msg.content.config_records[FITINS]
    pid = _partition(context)
    trajectory = str(fields["lineage"]) if "lineage" in fields else context.run_id
    res = train_fields(cfg, trajectory, pid, _state_dir(context), fields["down"], _cfg_json(context))
    if "behind" in res:
        raise Behind(pid, int(res["behind"]))
    return Message(compat.fitres_to_recorddict(answer_fitres(cfg, res["up"]), keep_input=True), reply_to=msg)
