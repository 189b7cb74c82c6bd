"""hiso: federated zeroth-order fine-tuning with scalar-only communication (HiSo, DeComFL).

The Python API (see :mod:`hiso.api` and docs/api.md): subclass :class:`Task`
(model factory, per-client batches, loss, evaluation), then :func:`run` it into a directory,
read its :class:`Run` (metrics, summary, model) and :func:`rebuild` the model from the log;
:func:`federation` gives the in-process runner without files. Names are imported on first
use, so ``import hiso`` alone costs little.
"""

from ._version import __version__

_EXPORTS = {
    "Task": "hiso.tasks.base", "RunConfig": "hiso.config", "ConfigError": "hiso.config",
    "load_config": "hiso.config", "register_task": "hiso.tasks.registry",
    "run": "hiso.api", "rebuild": "hiso.api", "federation": "hiso.api", "run_config": "hiso.api", "Run": "hiso.api",
    "evaluate": "hiso.api", "export": "hiso.api", "compare": "hiso.api", "Comparison": "hiso.api",
    "TaskMismatchWarning": "hiso.runners.runfiles",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hiso' has no attribute {name!r}")
