"""Experiment tracking: a run's rows, as they are written to ``metrics.jsonl``, also to TensorBoard
and / or MLflow (``hiso run --tensorboard DIR --mlflow URI``; ``pip install -e '.[track]' in hiso's clone``).

One small interface: :class:`Tracking` says where (picklable, so ``hiso compare``'s worker
processes get it), :meth:`Tracking.open` gives a :class:`Tracker` whose ``log(row, h)`` the run
directory writer calls after each row and ``close(summary)`` at the end. The simulator knows
nothing of it.

What is logged per round, under the names of ``metrics.jsonl``: ``train_loss``, every ``eval_*``,
``val_*`` and ``gap`` metric on the rounds that evaluate, ``bytes_up`` and ``bytes_down``
(cumulative, all clients), ``wall_s`` and ``round_s`` (training seconds of the round), and for
HiSo the quantiles of H (``h_min``, ``h_p05``, ``h_p50``, ``h_p95``, ``h_max``; min and max exact,
the others from at most 2^20 values taken at an even stride). TensorBoard: one event directory
per run, ``DIR/NAME``, plus a text entry with the run's tags and configuration. MLflow: one run
per hiso run in experiment ``hiso``, the configuration as parameters and the tags (algorithm,
lr, seed, ...) as tags; a URI without a scheme is a local directory (MLflow's file store: no
server; ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri DIR`` shows it), any other
URI (``sqlite:///mlflow.db``, ``http://host:5000``) is MLflow's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

H_SAMPLE = 1 << 20
_METRIC_PREFIXES = ("eval_", "val_", "gap")


def h_quantiles(h: list[torch.Tensor], max_values: int = H_SAMPLE) -> dict[str, float]:
    """min, 5 %, 50 %, 95 % and max of H's values (min and max exact; the quantiles from every
    k-th value of each tensor, k chosen so that at most about ``max_values`` are sorted)."""
    n = sum(t.numel() for t in h)
    k = max(1, -(-n // max_values))
    sample = torch.cat([t.detach().reshape(-1)[::k].float().cpu() for t in h])
    q = torch.quantile(sample, torch.tensor([0.05, 0.5, 0.95]))
    return {"h_min": float(min(t.min() for t in h)), "h_p05": float(q[0]), "h_p50": float(q[1]),
            "h_p95": float(q[2]), "h_max": float(max(t.max() for t in h))}


def scalars(row: dict, prev_wall: float | None, h: list[torch.Tensor] | None = None) -> dict[str, float]:
    """The numbers logged for one metrics row (see the module docstring)."""
    out: dict[str, float] = {}
    if row.get("train_loss") is not None:
        out["train_loss"] = float(row["train_loss"])
    for k, v in row.items():
        if k.startswith(_METRIC_PREFIXES) and isinstance(v, (int, float)):
            out[k] = float(v)
    for k in ("bytes_up", "bytes_down", "wall_s", "participants"):
        if isinstance(row.get(k), (int, float)):
            out[k] = float(row[k])
    if prev_wall is not None and row.get("wall_s") is not None:
        out["round_s"] = float(row["wall_s"]) - prev_wall
    if h:
        out.update(h_quantiles(h))
    return out


class Sink(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...
    def close(self, ok: bool) -> None: ...


class _TensorBoard:
    def __init__(self, logdir: Path, tags: dict, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(logdir))
        self.w.add_text("run", "\n\n".join([", ".join(f"{k} = {v}" for k, v in tags.items()),
                                            "```\n" + json.dumps(config, indent=1) + "\n```"]), 0)

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()  # as the run goes: a reader sees each round when it is done

    def close(self, ok: bool) -> None:
        self.w.close()


def mlflow_uri(uri: str) -> str:
    """A tracking URI for MLflow: one with a scheme as given, a plain path as a local file store.

    MLflow 3 keeps its file store "in maintenance mode" behind MLFLOW_ALLOW_FILE_STORE; a path
    given here asks for that store, so it is allowed (``mlflow ui`` needs the same variable)."""
    if "://" in uri or uri.startswith("file:"):
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return Path(uri).expanduser().resolve().as_uri()


class _MLflow:
    def __init__(self, uri: str, name: str, tags: dict, config: dict, experiment: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.c = MlflowClient(tracking_uri=mlflow_uri(uri))
        exp = self.c.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.c.create_experiment(experiment)
        self.run_id = self.c.create_run(exp_id, run_name=name, tags={k: str(v) for k, v in tags.items()}).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in config.items() if v is not None]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.c.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.c.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, ok: bool) -> None:
        self.c.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class Tracker:
    """The open sinks of one run: ``log(row, h)`` per metrics row, ``close(summary)`` at the end."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.prev_wall: float | None = None

    def log(self, row: dict, h: list[torch.Tensor] | None = None) -> None:
        values = scalars(row, self.prev_wall, h if row.get("round", 0) > 0 else None)
        self.prev_wall = row.get("wall_s")
        for s in self.sinks:
            s.write(int(row["round"]), values)

    def close(self, ok: bool = True) -> None:
        for s in self.sinks:
            s.close(ok)
        self.sinks = []


@dataclass(frozen=True)
class Tracking:
    """Where a run is tracked besides its run directory (None: not there)."""

    tensorboard: str | None = None
    mlflow: str | None = None
    name: str = "run"
    tags: dict[str, Any] = field(default_factory=dict)
    experiment: str = "hiso"

    @property
    def active(self) -> bool:
        return bool(self.tensorboard or self.mlflow)

    def check(self) -> None:
        """Refuse (ValueError, one line) a tracker whose package is missing, before a run starts."""
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install -e '.[track]' in hiso's clone")
        if self.mlflow and importlib.util.find_spec("mlflow") is None:
            raise ValueError("--mlflow needs the mlflow package: pip install -e '.[track]' in hiso's clone")

    def for_run(self, name: str, **tags: Any) -> "Tracking":
        """The same destinations for one run of several (``hiso compare``), named and tagged."""
        return replace(self, name=name, tags={**self.tags, **tags})

    def open(self, cfg) -> Tracker:
        """Start tracking a run of ``cfg`` (a :class:`hiso.config.RunConfig`)."""
        self.check()
        config = cfg.model_dump()
        tags = {"algorithm": cfg.algorithm, "task": cfg.task, "lr": cfg.lr, "seed": cfg.seed, **self.tags}
        sinks: list[Sink] = []
        if self.tensorboard:
            sinks.append(_TensorBoard(Path(self.tensorboard) / self.name, tags, config))
        if self.mlflow:
            sinks.append(_MLflow(self.mlflow, self.name, tags, config, self.experiment))
        return Tracker(sinks)
