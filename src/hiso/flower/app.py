"""The Flower ServerApp and ClientApp over hiso's core (scalar-only algorithms: HiSo, DeComFL).

Server side, each round: plan (the core's seeded sample over all ``clients`` partitions),
send every sampled partition that has a connected node its encoded downlink in a ``train``
message, wait at most ``round-timeout`` seconds, and aggregate the valid uplinks that came
back (``Server.aggregate(partial=True)``): a dead, slow or garbled node does not stop the
round. A sampled partition with no connected node simply does not answer. A round nobody
answered is planned again (fresh seeds). The run directory is the simulator's
(``metrics.jsonl``, ``history.bin``, ``summary.json``, ``model.pt``), written by
:func:`hiso.runners.rundir.run_to_dir`, so ``hiso rebuild`` works on it.

Nodes and partitions: a node names its partition in its node config (``partition-id=3``;
the simulation engine sets it by itself). The server asks every node it has not seen yet
(``query`` message) for its partition and the round its replica holds, so a restarted node
is picked up with a new node id and its history restarts where its replica stands.

Client side, each ``train`` message: open the node's memory-mapped replica
(:mod:`hiso.flower.replica`), let the core's :class:`~hiso.core.client.Client` decode, catch
up (skipping records it holds), run its local steps on its partition and encode the answer.
If the history starts after the replica's round (its disk copy was lost or reset), it answers
``behind=<round>`` instead and the server resends from there in the same round.

Message content (a ``ConfigRecord`` named ``hiso``): ``down`` (bytes) to a client;
``up`` (bytes) or ``behind`` (int) back; a query carries the server's ``welcome`` (bytes) and
its reply the node's ``hello`` (bytes), plus ``partition`` and ``round`` (ints): the protocol's
join, counted in the bytes; a node whose configuration or x_0 differs refuses it.
``lineage`` (str, in every query and train) names the run directory's trajectory, which keys
the node's replica, so a ServerApp resumed on the same directory finds the replicas in place.
The full-model baselines are in :mod:`hiso.flower.fullmodel` (ArrayRecords).
"""

from __future__ import annotations

import json

from ..config import RunConfig
from ..runners.drivers import driver_of
from .client_app import (_trajectory, accept_welcome, attacked, handle_query, handle_train,  # noqa: F401
                         open_replica, query_fields, train_fields)
from .records import DEFAULT_STATE_DIR, REC, Settings  # noqa: F401
from .records import noise_seed_refusal
from .server_app import FlowerFederation, serve_zo  # noqa: F401


def serve(grid, cfg: RunConfig, settings: Settings) -> dict:
    """The ServerApp's body: run ``cfg`` over the grid into ``settings.out_dir`` (the full-model
    baselines with models and updates in ArrayRecords, :mod:`hiso.flower.fullmodel`)."""
    if not driver_of(cfg.method).keeps_log:  # the model on the wire, no log
        from .fullmodel import serve_full
        return serve_full(grid, cfg, settings)
    if cfg.secagg:  # rounds close with a secure sum (Flower's SecAgg+; not FedKSeed's pool, which lacks it)
        from .secagg import SecAggFederation
        return serve_zo(grid, cfg, settings, SecAggFederation)
    return serve_zo(grid, cfg, settings)


def make_apps(cfg: RunConfig | None = None, settings: Settings | None = None):
    """A (ServerApp, ClientApp) pair. With ``cfg``/``settings`` they are fixed (simulation
    engine); without, they are read from the Flower run config (deployment, ``flwr run``)."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    def cfg_of(context) -> RunConfig:
        if cfg is not None:
            return cfg
        return RunConfig(**json.loads(context.run_config["hiso-config"]))

    def settings_of(context) -> Settings:
        if settings is not None:
            return settings
        rc = context.run_config
        return Settings(out_dir=str(rc["out-dir"]), round_timeout=float(rc.get("round-timeout", 0.0)) or None,
                        min_nodes=int(rc.get("min-nodes", 0)), wait_nodes_s=float(rc.get("wait-nodes-s", 0.0)) or None,
                        resume=bool(rc.get("resume", False)))

    from .secagg_client import handle_train_secagg, is_secagg, secagg_mod
    server_app, client_app = ServerApp(), ClientApp(mods=[secagg_mod])  # the mod acts on SecAgg+ messages only

    @server_app.main()
    def _main(grid, context) -> None:
        c = cfg_of(context)
        if why := noise_seed_refusal(c):  # the ClientApps read the same configuration
            raise ValueError(why)
        if c.threads is not None:
            import torch
            torch.set_num_threads(c.threads)
        serve(grid, c, settings_of(context))

    @client_app.query()
    def _query(msg, context):
        return handle_query(msg, context, cfg_of(context))

    @client_app.train()
    def _train(msg, context):
        c = cfg_of(context)
        if c.threads is not None:
            import torch
            torch.set_num_threads(c.threads)
        if not driver_of(c.method).keeps_log:
            from .fullmodel import handle_train_full
            return handle_train_full(msg, context, c)
        if is_secagg(msg):  # --secagg: the answer goes into the secure sum (hiso.flower.secagg)
            return handle_train_secagg(msg, context, c)
        return handle_train(msg, context, c)

    return server_app, client_app

try:
    _APPS = make_apps()
except ImportError:  # no flower extra: the handlers above still import (and are tested) without it
    _APPS = (None, None)

server_app = _APPS[0]  # (one name per line: `flwr run` finds them by reading this file)

client_app = _APPS[1]
