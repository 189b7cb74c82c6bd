"""What a run directory asks of the runner it drives (:func:`hiso.runners.rundir.run_to_dir`):
one base every runner extends (the simulators, FedKSeed's, the full-model one, the Flower
ServerApps), so a run asks its runner's attributes and never probes for them."""

from __future__ import annotations

from typing import Any


class Runner:
    """The defaults of a runner without faults, privacy, cost measures or a folded state."""

    unreliable: bool = False  # faults or attackers: each rejection logged; resume needs the metrics rows
    sealed: bool = False  # a CRC-32 frame on the uplinks (the in-process transport unwraps it)
    privacy: Any = None  # the run's DP ledger (hiso.runners.accounting), if it keeps one
    cost: Any = None  # a client's computation and memory (hiso.runners.client_cost), if measured
    state: Any = None  # the server's ModelState (checkpointed by a scalar run, its H tracked), if it folds one

    def measure_client(self) -> None:
        """A client's memory on one extra answer (:mod:`hiso.runners.client_cost`); none by default."""
