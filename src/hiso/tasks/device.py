"""Run any task's model on a GPU without the task knowing.

Tasks move each batch to their model's device (the built-in ones do; a user's task should too),
so a task runs on a GPU once its model is there: :class:`OnDevice` moves every model the task
builds. Nothing else changes: the core works on the parameters' device, and the Philox
direction families generate each direction there (bit-identical to the CPU's: integer Philox,
then a single binary32 rounding per operation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import hardware
from .base import Task


def resolve(device: str) -> torch.device:
    """``device`` as a torch device, refusing a CUDA device this machine does not have."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not hardware.has("cuda"):
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device here "
                             f"(torch {torch.__version__}; a CPU build, or no GPU): use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")
    return dev


class OnDevice(Task):
    """``task`` with every model it builds moved to ``device``; all else is the task's own."""

    def __init__(self, task: Task, device: str | torch.device):
        self.task = task
        self.device = resolve(str(device))

    def __getattr__(self, name: str) -> Any:  # everything this class does not define
        return getattr(self.__dict__["task"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("task", "device"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.task, name, value)

    def build_model(self) -> nn.Module:
        return self.task.build_model().to(self.device)

    def batch(self, client: int, round: int, step: int, batch_size: int) -> Any:
        return self.task.batch(client, round, step, batch_size)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.task.loss(model, batch)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self.task.evaluate(model)

    def client_sizes(self) -> list[int]:
        return self.task.client_sizes()

    def describe(self) -> dict[str, Any]:
        return {**self.task.describe(), "device": str(self.device)}


def on_device(task: Task, device: str) -> Task:
    """``task`` as it is for the CPU, else wrapped in :class:`OnDevice` (once)."""
    if str(device) == "cpu" or isinstance(task, OnDevice):
        return task
    return OnDevice(task, device)
