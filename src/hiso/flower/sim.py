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

import os
import tempfile
from pathlib import Path

from ..config import RunConfig
from .app import Settings, make_apps


def run_simulation(cfg: RunConfig, out: str | Path, *, num_nodes: int | None = None, round_timeout: float = 60.0,
                   state_dir: str | Path | None = None, cpus_per_client: float = 1.0, num_cpus: int | None = None,
                   ray_address: str | None = None, wait_nodes_s: float = 300.0, verbose: bool = False) -> dict:
    """Run ``cfg`` on ``num_nodes`` (default ``cfg.clients``) virtual nodes into ``out``."""
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
                        wait_nodes_s=wait_nodes_s)
    server_app, client_app = make_apps(cfg, settings)
    init_args: dict = {"include_dashboard": False}  # (Ray workers inherit HISO_FLOWER_STATE_DIR)
    if num_cpus is not None:
        init_args["num_cpus"] = num_cpus
    if ray_address is not None:
        init_args["address"] = ray_address
    backend = {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0}, "init_args": init_args}
    try:
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
