"""What both sides of hiso's Flower apps share: the record name, the ServerApp's settings,
a node's partition and configuration from its context, and the task a configuration builds."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..config import RunConfig
from ..tasks.base import Task

log = logging.getLogger("hiso.flower")

REC = "hiso"  # name of the ConfigRecord that carries our fields

DEFAULT_STATE_DIR = os.path.join(tempfile.gettempdir(), "hiso-flower-replicas")


@dataclass
class Settings:
    """What the ServerApp needs besides the RunConfig (from the Flower run config)."""

    out_dir: str
    round_timeout: float | None = 30.0  # None or 0: from the measured rounds (hiso.flower.timeouts)
    min_nodes: int = 0  # wait for this many nodes before round 1 (0: as many as partitions)
    wait_nodes_s: float | None = 60.0  # None or 0: scaled with a model load (hiso.flower.timeouts)
    load_s: float = 0.0  # what building the task took the ServerApp (the model's build is added)
    max_replans: int = 20  # consecutive rounds with no answer before the run fails
    suspect_grace_s: float = 2.0  # how long a node that missed its last answer is waited for
    poll_s: float = 0.1  # how often replies are pulled from the SuperLink
    resume: bool = False  # out_dir holds an interrupted run of this config: continue it
    # simulation engine: partition -> node id as the engine placed them (filled once it has);
    # a node then joins when its partition is first sampled instead of all at the start
    placement: dict[int, int] | None = None

def noise_seed_refusal(cfg: RunConfig) -> str | None:
    """Why ``cfg`` cannot run on Flower (None: it can): an explicit DP noise key travels in the run
    config, which every ClientApp reads, so a client could subtract the central noise (in local
    mode it would key nothing: each node draws its own secret). Without it the ServerApp draws
    the key and keeps it in its run directory (DIR/dp_secret.json), never sent."""
    if cfg.dp_clip is None or cfg.dp_noise_seed is None:
        return None
    why = ("the run config carries it to every ClientApp, which could then subtract the central noise"
           if cfg.dp_mode == "central" else "in local mode each node keys its own noise with a secret it draws, "
           "so it would key nothing")
    return (f"--dp-noise-seed is not for Flower: {why}; leave it out (the ServerApp draws the key and keeps it in "
            "DIR/dp_secret.json; hiso run --dp-noise-seed KEY replays a run's noise)")


def reply_bytes(rec, name: str) -> bytes:
    """Field ``name`` of a node's reply record as bytes, or MessageError (absent or of another type)."""
    from ..core.wire import MessageError
    v = rec.get(name) if hasattr(rec, "get") else None
    if not isinstance(v, (bytes, bytearray)):
        raise MessageError(f"reply field {name!r}: expected bytes, got {type(v).__name__}")
    return bytes(v)


def reply_int(rec, name: str) -> int:
    """Field ``name`` of a node's reply record as a round or partition (0 <= v < 2^36, see
    :data:`hiso.core.seeds.MAX_ROUND`), or MessageError (absent, of another type, out of range)."""
    from ..core.seeds import MAX_ROUND
    from ..core.wire import MessageError
    v = rec.get(name) if hasattr(rec, "get") else None
    if type(v) is not int or not 0 <= v < MAX_ROUND:
        raise MessageError(f"reply field {name!r}: expected an integer in 0..2^36, got {type(v).__name__}")
    return v


def _records(content):
    from flwr.app import ConfigRecord, RecordDict
    return RecordDict({REC: ConfigRecord(content)})

@lru_cache(maxsize=4)
def _task_for(cfg_json: str) -> Task:
    from ..tasks.registry import build_task
    return build_task(RunConfig(**json.loads(cfg_json)))

def _partition(context) -> int:
    """The node's partition, for the apps whose nodes serve one each (full-model, SecAgg+)."""
    from .parts import node_partitions
    pids = node_partitions(context.node_config)
    if len(pids) > 1:
        raise ValueError(f"this node serves partitions {pids}: this algorithm's nodes serve one partition each")
    return pids[0]

def _state_dir(context) -> str:
    return str(context.node_config.get("state-dir", os.environ.get("HISO_FLOWER_STATE_DIR", DEFAULT_STATE_DIR)))

def _cfg_json(context) -> str | None:
    return context.run_config.get("hiso-config") if context.run_config else None


def run_lineage(settings: Settings) -> str:
    """The run directory's trajectory id (``DIR/flower-lineage``): new for a new run, the same
    for a resumed one. Nodes key their replicas by it instead of the Flower run id, so a
    ServerApp that is restarted on the run directory finds every replica where it was (each
    holds a round the log kept: a round's records reach a node only after its metrics row is
    written, and resume keeps every round that has one) instead of replaying from x_0."""
    import secrets

    from ..atomic import write_atomic
    path = Path(settings.out_dir, "flower-lineage")
    if settings.resume and path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    write_atomic(path, token + "\n")
    return token

def earlier_attempts(settings: Settings) -> list:
    """A resumed run's record of the attempts before it (``flower.json``, if the dead
    ServerApp got to write one), kept beside the new attempt's timings."""
    try:
        old = json.loads(Path(settings.out_dir, "flower.json").read_text())["flower"]
    except (OSError, ValueError, KeyError):
        return []
    return [*old.pop("earlier_attempts", []), old]
