"""``hiso eval``: a run's model (any round) evaluated on its task, or on other data of the same task.

The model is x_R (:func:`hiso.runners.runmodel.load_run_model`); the task is the run's, built
from ``config.json`` with ``--data-dir`` / ``--eval-max`` in place of the run's, so with neither
given it scores exactly the examples the run scored, in the same batches, and reproduces the
run's own metrics at that round to the last digit. Language tasks evaluate in batches of
``eval_batch_size`` with a progress bar on stderr.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .runfiles import saved_config, write_atomic
from .runmodel import load_run_model, run_task

SPLITS = ("dev", "test")


def relative_to(path: str | None, run_dir: Path) -> str | None:
    """``path`` relative to the run directory (eval.json lies there): no path of this machine."""
    from .portable import relative
    return None if path is None else relative(path, run_dir)
_PREFIX = {"dev": "val_", "test": ("eval_", "gap")}


def evaluate_run(run_dir: str | Path, round: int | None = None, data_dir: str | None = None,
                 eval_max: int | None = None, split: str | None = None, device: str = "cpu",
                 task=None) -> dict[str, Any]:
    """Evaluate round ``round`` (None: the last) of the run in ``run_dir``.

    ``split``: ``test`` keeps the metrics of the held-out examples a run reports (``eval_*``),
    ``dev`` those of its validation share (``val_*``, runs with ``val_fraction`` > 0); None both.
    ``task``: the run's task object (default: built from ``config.json``); it holds its own data,
    so it takes no ``data_dir`` or ``eval_max``.
    """
    run_dir = Path(run_dir)
    cfg, _ = saved_config(run_dir)
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be dev or test, got {split!r}")
    if split == "dev" and cfg.task_options.val_fraction == 0:
        raise ValueError(f"{run_dir} has no validation split (val_fraction 0): its held-out examples are "
                         f"reported as eval_* (--split test)")
    built = task is None
    if built:  # checked against the run there (only its base, with other data or size)
        task, cfg, info = run_task(run_dir, device, data_dir=data_dir, eval_max=eval_max)
    elif data_dir is not None or eval_max is not None:
        raise ValueError("a task object holds its own data: build it with the other data instead of giving "
                         "data_dir or eval_max")
    # how many examples are scored: n_eval (eval_*) and n_val (val_*); described before the model is
    # built, so a language task's description reuses the model it makes for it
    described = task.describe()
    scored = {k: described[k] for k in ("n_eval", "n_val") if k in described}
    rm = load_run_model(run_dir, round, task=task, device=device, checked=built)
    task = rm.task
    t0 = time.perf_counter()
    metrics = task.evaluate(rm.model)
    seconds = time.perf_counter() - t0
    if split is not None:
        metrics = {k: v for k, v in metrics.items() if k.startswith(_PREFIX[split])}
    return {"metrics": metrics, "round": rm.round, "split": split or "all", **scored,
            "data_dir": relative_to(data_dir or cfg.task_options.data_dir, run_dir),
            "eval_max": eval_max or cfg.task_options.eval_max,
            "seconds": seconds, **{k: v for k, v in rm.identity().items() if k != "round"}}


def write_eval(result: dict, path: str | Path) -> Path:
    """``result`` as JSON at ``path``, whole or not at all."""
    path = Path(path)
    write_atomic(path, json.dumps(result, indent=2) + "\n")
    return path
