"""What a task gives the runner: a model, each client's minibatches, a loss and an evaluation.

The runner and the algorithms know nothing else about a task. Every random choice a task makes
(initial model, data split, which examples a client uses at a given step) is a function of the
run's seed and of (client, round, step), so the faithful and the fast simulator, a Flower
deployment and `hiso rebuild` all see the same numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class Task(ABC):
    """A federated objective: ``F(x) = sum_i w_i f_i(x)`` over ``num_clients`` clients.

    A subclass is usable by ``hiso run --task module:Class`` (or ``path/to/file.py:Class``) and
    ``hiso compare`` as it is; these class attributes tell them about it:

    * ``metrics``: the keys :meth:`evaluate` returns, each ``"max"`` (higher is better) or
      ``"min"``; the first is the metric ``hiso compare`` selects and reports on by default;
    * ``default_lr``: the client lr of a run without ``--lr``, keyed by algorithm (``"hiso"``)
      or family (``"zo"``: hiso, decomfl, fedzo; ``"first-order"``: the FedAvg family);
    * ``options``: the task options its :meth:`from_config` reads (``{"data_dir", "model"}``;
      see ``hiso.tasks.registry.TASK_OPTIONS``): a run given another one is refused;
    * :meth:`from_config` builds the task from a run's configuration.
    """

    name: str = "task"
    differentiable: bool = True  # loss() can be backpropagated (False: a black box, ZO methods only)
    metrics: dict[str, str] = {"eval_loss": "min"}
    default_lr: dict[str, float] = {}
    # the task options (hiso.tasks.registry.TASK_OPTIONS: data_dir, model, lora_r, ...) that
    # from_config reads; a run given any other is refused, as it would not change what it trains
    options: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, cfg) -> "Task":
        """The task for a run configuration (:class:`hiso.config.RunConfig`); by default
        ``cls(cfg.clients, seed=cfg.seed)``. Override to read more of ``cfg``."""
        return cls(cfg.clients, seed=cfg.seed)

    def __init__(self, num_clients: int, seed: int = 0):
        self.num_clients = num_clients
        self.seed = seed

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The initial model x_0; the same for every call (it is a function of the seed)."""

    @abstractmethod
    def batch(self, client: int, round: int, step: int, batch_size: int) -> Any:
        """Client ``client``'s minibatch for local step ``step`` of round ``round``."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss of ``model`` on ``batch``."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Evaluation metrics on held-out data (keys like ``eval_loss``, ``eval_acc``)."""

    def client_sizes(self) -> list[int]:
        """Number of training examples per client (weights for weighted aggregation)."""
        return [1] * self.num_clients

    def describe(self) -> dict[str, Any]:
        """Facts about the task worth recording in ``config.json`` / ``summary.json``."""
        return {}

    def base_fingerprint(self) -> str | None:
        """The fingerprint of the pretrained weights its model starts from (None: none); a run
        records it (``describe()['base_fingerprint']``), and a rebuild, export or resume on other
        weights is refused."""
        return None
