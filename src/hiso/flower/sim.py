"""The same ServerApp and ClientApp under Flower's simulation engine (Ray): many virtual
SuperNodes in one machine (or one Ray cluster), one per partition.

The engine gives each virtual node ``partition-id`` and ``num-partitions`` by itself. Each
virtual ClientApp opens its partition's memory-mapped replica exactly as a real node does
(``state_dir``, by default a fresh temporary directory; use a tmpfs such as ``/dev/shm`` to
keep it off the disk), so the arithmetic, and the run directory, are the deployment's.

On a multi-machine Ray cluster (docs/flower.md): start Ray on the head (``ray start --head``)
and on each worker (``ray start --address HEAD:6379``), then call this with
``ray_address="auto"`` on the head; ``state_dir`` must then be a path every worker can write
(node-local is enough: a virtual node whose replica is on another machine catches up from
x_0, exactly as a restarted node does).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

from ..config import RunConfig
from .app import Settings, make_apps


# how often the ServerApp pulls replies and the patched dispatcher hands messages out (Flower's
# own loop, and a deployment's ServerApp: 0.1 s): both are cheap in one process, and each round
# waits for two of each (joins, then train messages)
POLL_S = 0.02


def run_simulation(cfg: RunConfig, out: str | Path, *, num_nodes: int | None = None, round_timeout: float = 60.0,
                   state_dir: str | Path | None = None, cpus_per_client: float = 1.0, num_cpus: int | None = None,
                   ray_address: str | None = None, wait_nodes_s: float = 300.0, verbose: bool = False,
                   max_replans: int = Settings.max_replans) -> dict:
    """Run ``cfg`` on ``num_nodes`` (default ``cfg.clients``) virtual nodes into ``out``
    (``max_replans``: rounds in a row that no client answers before the run fails)."""
    from flwr.simulation import run_simulation as flwr_run_simulation

    from .records import noise_seed_refusal
    if why := noise_seed_refusal(cfg):  # every virtual ClientApp gets cfg
        raise ValueError(why)

    for k, v in {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                 "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}.items():
        os.environ.setdefault(k, v)
    n = num_nodes or cfg.clients
    state_dir = str(state_dir or tempfile.mkdtemp(prefix="hiso-flower-sim-"))
    os.environ["HISO_FLOWER_STATE_DIR"] = state_dir  # inherited by the Ray workers started below
    settings = Settings(out_dir=str(Path(out).resolve()), round_timeout=round_timeout, min_nodes=n,
                        wait_nodes_s=wait_nodes_s, placement={}, poll_s=POLL_S, max_replans=max_replans)
    server_app, client_app = make_apps(cfg, settings)
    init_args: dict = {"include_dashboard": False}  # (Ray workers inherit HISO_FLOWER_STATE_DIR)
    if num_cpus is not None:
        init_args["num_cpus"] = num_cpus
    if ray_address is not None:
        init_args["address"] = ray_address
    backend = {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0}, "init_args": init_args}
    try:
        with engine_patches(settings):
            flwr_run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n,
                                backend_config=backend, verbose_logging=verbose)
    finally:  # a crashed engine must not leave Ray's processes behind
        import ray
        if ray.is_initialized():
            ray.shutdown()
    import json
    summary_p = Path(out) / "summary.json"
    if not summary_p.exists():
        raise RuntimeError(f"the simulation wrote no {summary_p}: the ServerApp failed (see the log above)")
    return json.loads(summary_p.read_text())


@contextlib.contextmanager
def engine_patches(settings):
    """Flower's simulation engine (1.41, 1.42) made to scale with the population, for the
    ``with`` block: it hands the ServerApp its placement (``settings.placement``, partition ->
    node id, as it registers the virtual nodes), so a node joins when its partition is first
    sampled instead of 10,000 queries at the start; and its dispatcher polls only the nodes
    that have a message waiting. Flower's polls every registered node every 0.1 s, scanning
    every stored message for each (10,000 nodes x 100 messages of a round: a million checks a
    sweep, holding the state's lock and the GIL). Where Flower's internals differ from what
    this expects, that part is left as it is (``settings.placement = None``: every node is
    queried at the start, as in a deployment)."""
    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError:
        vce_api = None
    register = getattr(vce_api, "_register_nodes", None)
    dispatch = getattr(vce_api, "add_messages_to_queue", None)
    if register is None or dispatch is None:
        settings.placement = None
        yield
        return
    placed = settings.placement

    def register_nodes(num_nodes, state_factory):
        mapping = register(num_nodes=num_nodes, state_factory=state_factory)
        placed.update({pid: nid for nid, pid in mapping.items()})
        return mapping

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop: threading.Event) -> None:
        store, lock = getattr(state, "message_ins_store", None), getattr(state, "lock", None)
        if store is None or lock is None:  # not the in-memory state this expects: Flower's own loop
            return dispatch(state, queue, nodes_mapping, f_stop)
        while not f_stop.is_set():
            with lock:  # the nodes with an undelivered message, in the order they were stored
                waiting = dict.fromkeys(m.metadata.dst_node_id for m in store.values()
                                        if m.metadata.delivered_at == "")
            for node_id in waiting:
                if node_id in nodes_mapping:  # Flower's own call: expiry, one message a node a sweep
                    for msg in state.get_message_ins(node_id=node_id, limit=1):
                        queue.put(msg)
            f_stop.wait(POLL_S)

    vce_api._register_nodes, vce_api.add_messages_to_queue = register_nodes, add_messages_to_queue
    try:
        yield
    finally:
        vce_api._register_nodes, vce_api.add_messages_to_queue = register, dispatch
