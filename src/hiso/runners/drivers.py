"""Each method family's in-process pieces behind one interface (:func:`driver_of` a method's
registry entry): its simulator, the log it keeps and resumes from, whether its server state is
checkpointed, and what the rest asks of a run by what it needs (where its model comes from, whether
its clients' replicas catch up on a log, whether a seed pool plays its rounds, its records' shape):
the run directory, rebuild, ``hiso plan``, ``hiso compare``, the Flower apps and the command line.

* :class:`ScalarDriver`: seeds and scalars, one log every replica folds (HiSo, DeComFL, ...);
* :class:`PoolDriver`: FedKSeed, its pool's own log;
* :class:`Driver` itself: the full-model baselines, no log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


class Driver:
    """A family without a log (the full-model baselines): nothing to resume, rebuild or checkpoint."""

    keeps_log = False  # a log its model is rebuilt and resumed from
    model_from = "model.pt"  # where a run's model is read (hiso.runners.runmodel): its model.pt only
    checkpointed = False  # the server state saved every so often (checkpoint.pt; model.pt starts a continuation)
    # its clients keep a replica that catches up on the one log (the core's client: join handshake,
    # snapshots); on Flower the node's replica on disk, kept loaded by a per-node worker and found
    # in place by a resumed ServerApp
    replica_catches_up = False
    pool_rounds = False  # a seed pool plays its rounds (PoolRounds): its server, its clients' pool states

    def record_shape(self, cfg) -> tuple[int, int] | None:
        """The shape of its log's records, (local steps, perturbations), that a resume checks (None:
        no core log)."""
        return None

    def simulation(self, cfg, task, on_record: Callable | None = None):
        from .fullmodel import FullModelSimulation
        return FullModelSimulation(task, cfg)

    def resume_point(self, out: Path, cfg) -> tuple[list[str], list]:
        """The metrics rows kept and the logged records a resume of the run in ``out`` starts from."""
        from .runfiles import resume_point
        return resume_point(out, self.record_shape(cfg), cfg)

    def log_writer(self, out: Path, cfg, records: list, resume: bool):
        """The context manager writing the run's log (None: it keeps none)."""
        return None

    def logged_rounds(self, out: Path) -> int | None:
        """The rounds the log in ``out`` holds, where a finished run whose log was cut after it
        ended continues from its log (None: no such log)."""
        return None

    def finite_state(self, sim, task, cfg, out: Path, rounds: int) -> dict | None:
        """After a diverged run: the state to save in place of ``sim``'s if that one is not finite
        (None: keep it; the full-model runner never writes a non-finite step)."""
        return None


class ScalarDriver(Driver):
    keeps_log = checkpointed = replica_catches_up = True
    model_from = "log"  # x_0 and the log replayed (or model.pt where it is that round)

    def record_shape(self, cfg) -> tuple[int, int] | None:
        return cfg.zo().shape

    def finite_state(self, sim, task, cfg, out: Path, rounds: int) -> dict | None:
        from ..core.history import read_history
        from ..core.state import ModelState
        from .common import finite
        st = sim.state
        if finite(st.params) and (st.h is None or finite(st.h)):
            return None
        # x_0 plus the logged rounds: exactly the state before the bad round (as `hiso rebuild`)
        last = ModelState(task.build_model(), st.cfg, run_seed=cfg.seed)
        last.replay(read_history(out / "history.bin")[2][:rounds])
        return last.state_dict()

    def simulation(self, cfg, task, on_record: Callable | None = None):
        from .accounting import privacy_ledger
        from .faults import Attackers, Faults
        from .simulate import Simulation
        faults = Faults(cfg.drop_rate, cfg.late_rate, cfg.duplicate_rate, cfg.corrupt_rate, seed=cfg.seed)
        attackers = (Attackers(task.num_clients, cfg.byzantine, cfg.attack, cfg.attack_scale, seed=cfg.seed,
                               per_round=cfg.byzantine_per_round) if cfg.byzantine else None)
        return Simulation(task, cfg.zo(), clients_per_round=cfg.sampled, seed=cfg.seed,
                          batch_size=cfg.batch_size, mode=cfg.mode, perturb_mode=cfg.perturb_mode,
                          weighted=cfg.weighted, eval_every=cfg.eval_every, on_record=on_record,
                          rule=cfg.aggregate, trim=cfg.trim, faults=faults if faults.active else None,
                          attackers=attackers, snapshot_after=cfg.snapshot_after, bandwidth=cfg.bandwidth,
                          batch_memory=cfg.batch_memory_bytes, dp_seed=cfg.dp_noise_seed,
                          privacy=privacy_ledger(cfg), secagg=cfg.secagg_config)

    def log_writer(self, out: Path, cfg, records: list, resume: bool):
        from ..core.history import HistoryWriter
        return HistoryWriter(out / "history.bin", *self.record_shape(cfg), keep=len(records) if resume else None,
                             seed=cfg.seed, scalar_dtype=cfg.scalar_dtype, directions=cfg.direction_spec)

    def logged_rounds(self, out: Path) -> int | None:
        from ..core.history import parse_history
        return len(parse_history(out / "history.bin").records) if (out / "history.bin").is_file() else None


class PoolDriver(Driver):
    keeps_log = pool_rounds = True
    model_from = "pool-log"  # x_0, the pool's log folded and materialised once

    def simulation(self, cfg, task, on_record: Callable | None = None):
        from .inprocess import FedKSeedSimulation
        return FedKSeedSimulation(task, cfg, on_record)

    def resume_point(self, out: Path, cfg) -> tuple[list[str], list]:
        from .runfiles import pool_resume_point, resume_point
        return pool_resume_point(out, cfg, resume_point(out, None)[0])

    def log_writer(self, out: Path, cfg, records: list, resume: bool):
        from ..methods.fedkseed import PoolLogWriter
        from ..methods.fedkseed_method import FedKSeed
        return PoolLogWriter(out / "history.bin", cfg.local_steps, FedKSeed.of(cfg).seed_pool, cfg.seed,
                             cfg.scalar_dtype, keep=records)


DRIVERS = {"scalar": ScalarDriver(), "seed-pool": PoolDriver(), "full-model": Driver()}


def driver_of(info) -> Driver:
    """The driver of a method (its registry entry, ``RunConfig.method``), by its family."""
    return DRIVERS[info.family]
