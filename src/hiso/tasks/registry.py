"""Task names -> tasks built from a run configuration."""

from __future__ import annotations

from ..config import LANGUAGE_TASKS, RunConfig
from .base import Task


def build_task(cfg: RunConfig) -> Task:
    if cfg.task == "quadratic":
        from .quadratic import QuadraticTask
        return QuadraticTask(cfg.clients, seed=cfg.seed, dim=cfg.dim, sigma=cfg.sigma,
                             heterogeneity=cfg.heterogeneity, noise=cfg.noise)
    if cfg.task in ("mnist", "fashion-mnist"):
        from .vision import VisionTask
        return VisionTask(cfg.task, cfg.clients, seed=cfg.seed, data_dir=cfg.data_dir,
                          partition=cfg.partition or "dirichlet", alpha=cfg.alpha, min_size=cfg.min_size,
                          eval_max=cfg.eval_max)
    if cfg.task in LANGUAGE_TASKS:
        from .language import LanguageTask
        split = lambda s: [w for w in s.split(",") if w.strip()]  # noqa: E731
        return LanguageTask(cfg.task, cfg.clients, seed=cfg.seed, model=cfg.model, data_dir=cfg.data_dir,
                            partition=cfg.partition, alpha=cfg.alpha, min_size=cfg.min_size,
                            train_max=cfg.train_max, eval_max=cfg.eval_max, max_length=cfg.max_length,
                            template=cfg.template,
                            label_words=split(cfg.label_words) if cfg.label_words else None,
                            lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                            lora_targets=[t.strip() for t in split(cfg.lora_targets)],
                            autocast=cfg.autocast, eval_batch_size=cfg.eval_batch_size,
                            max_new_tokens=cfg.max_new_tokens)
    raise ValueError(f"unknown task {cfg.task!r}")
