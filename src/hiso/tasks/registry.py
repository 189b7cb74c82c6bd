"""Task names -> tasks built from a run configuration."""

from __future__ import annotations

from ..config import RunConfig
from .base import Task


def build_task(cfg: RunConfig) -> Task:
    if cfg.task == "quadratic":
        from .quadratic import QuadraticTask
        return QuadraticTask(cfg.clients, seed=cfg.seed, dim=cfg.dim, sigma=cfg.sigma,
                             heterogeneity=cfg.heterogeneity, noise=cfg.noise)
    if cfg.task in ("mnist", "fashion-mnist"):
        from .vision import VisionTask
        return VisionTask(cfg.task, cfg.clients, seed=cfg.seed, data_dir=cfg.data_dir,
                          partition=cfg.partition, alpha=cfg.alpha, min_size=cfg.min_size,
                          eval_max=cfg.eval_max)
    raise ValueError(f"unknown task {cfg.task!r}")
