"""Shared test setup: thread counts, and a tiny task with several parameter tensors (an MLP on
synthetic regression data)."""

from __future__ import annotations

import os

# One thread per test process unless the caller chose otherwise. Set here, before torch or numba
# is imported (they read these once, at import): the suite runs many short tests and subprocesses
# (hiso runs, Flower nodes) on small shared machines, and OpenMP/MKL/numba pools sized to every
# core made it stall on a busy 2-core machine (spinning threads of several processes fighting for
# the same cores). Subprocesses inherit the environment, so they get one thread too.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# Flower's processes run at niceness 15 by default (hiso.flower.launch, to spare a user's other
# work); beside busy processes at 0 that starves them (a nice-15 process gets ~3 % of a core
# that a nice-0 one wants) and their rounds crawl. In tests they run at the tests' own niceness.
os.environ.setdefault("HISO_FLOWER_NICE", str(os.nice(0)))

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hiso
from hiso import hardware, procs
from hiso.patience import Patience
from hiso.tasks.base import Task
from process_helpers import reap_children

SRC = str(Path(hiso.__file__).parents[1])


# ------------------------------------------------------------- processes the tests start
# A test that starts processes (a ``hiso`` command, a federation) must stop them whatever
# happens: when it fails, at the end of the session, and when the test process itself is
# stopped (``timeout`` sends SIGTERM: turned into an exception below, so teardowns run) or
# killed (SIGKILL runs nothing: every process started here has PR_SET_PDEATHSIG, and a hiso
# command that gets SIGTERM stops everything it started, see hiso.procs).


def _as_from_a_terminal() -> None:
    """A started command's stop signals at their defaults, as a terminal starts it, whatever the
    test run inherited (under nohup or as a shell's background job SIGHUP and SIGINT are ignored,
    and a command keeps ignoring what it was started ignoring); and it dies with its test."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    procs.die_with_parent()


def pytest_configure(config):
    procs.become_subreaper()  # so that what a test's processes orphan is still ours at the end

    def stop(signum, frame):
        raise procs.Stopped(signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


# ------------------------------------------------------------- float32 unless about autocast
# ``--autocast auto`` takes bf16 forwards for a full-parameter language task where the CPU has AMX
# (hiso.hardware). A test compares forwards at float32 tolerances, so every test runs its tasks in
# float32 on every machine: this fixture reports the bf16 units absent, in this process and in
# every process the test starts. Tests about autocast are marked ``autocast`` and see the hardware
# as it is, or as ``$HISO_HARDWARE`` reports it (``HISO_HARDWARE=amx=1 pytest`` runs the suite as
# a host with AMX would; tests/README.md lists the switches).


@pytest.fixture(autouse=True)
def float32_unless_about_autocast(request, monkeypatch):
    if request.node.get_closest_marker("autocast") is None:
        said = {k: v for k, v in hardware.overrides().items() if k != "amx"}
        monkeypatch.setenv(hardware.ENV, ",".join([*(f"{k}={int(v)}" for k, v in said.items()), "amx=0"]))


def machine() -> str:
    """The CPU, its vector extensions and the kernels torch runs on it: what float bits depend on."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    field = lambda name: next((l.split(":", 1)[1].strip() for l in info if l.startswith(name)), "")  # noqa: E731
    vector = sorted(f for f in field("flags").split() if f.startswith(("avx", "fma", "amx")))
    chosen = os.environ.get("ATEN_CPU_CAPABILITY")
    return (f"{field('model name') or 'CPU ?'} ({' '.join(vector) or 'no AVX'}); torch {torch.__version__}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
            + (f" (ATEN_CPU_CAPABILITY={chosen})" if chosen else "") + f"; hiso sees {hardware.summary()}")


def pytest_report_header(config):
    return [f"machine: {machine()}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(f"machine: {machine()}")  # (also under -q, which hides the header)


def pytest_sessionfinish(session, exitstatus):
    procs.stop_tree(grace=5.0)  # anything a test started and left behind, orphans included
    reap_children()


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries HISO_TEST_TAG=tag (inherited by every descendant,
    even one that left the tree: Flower's detached SuperExec, an orphaned ClientApp)."""
    return tagged_by(f"HISO_TEST_TAG={tag}")


def tagged_by(entry: str) -> list[int]:
    """Live processes (but this one) whose environment holds ``entry`` (NAME=value)."""
    return procs.with_env(entry)


class Spawned:
    """Processes started by a test, each in its own session and tagged (see :func:`tagged`)."""

    def __init__(self, logdir: Path):
        self.tag = uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []
        self.logdir = logdir

    def hiso(self, *args: str, **kw) -> subprocess.Popen:
        """``python -m hiso.cli ARGS`` (a real command: it owns what it starts)."""
        return self.start([sys.executable, "-m", "hiso.cli", *args], **kw)

    def start(self, argv, env=None, **kw) -> subprocess.Popen:
        env = {**os.environ, **(env or {}), "HISO_TEST_TAG": self.tag}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
        log = self.logdir / f"proc{len(self.procs)}.log"
        with open(log, "wb") as f:  # a file, not a pipe: a chatty process never blocks on it
            p = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_as_from_a_terminal,
                                 stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw)
        p.log = log
        self.procs.append(p)
        return p

    def left(self) -> list[int]:
        return tagged(self.tag)

    def stop(self) -> None:
        """SIGTERM what is still running (a hiso command cleans up on it), then kill every tagged
        process left, then reap."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        t_end = time.monotonic() + 30
        while any(p.poll() is None for p in self.procs) and time.monotonic() < t_end:
            time.sleep(0.1)
        procs.stop_processes([p.pid for p in self.procs if p.poll() is None] + self.left(), grace=2.0)
        for p in self.procs:
            p.wait()
        procs.reap_orphans()  # what they orphaned and this process (a subreaper) adopted


@pytest.fixture
def spawned(tmp_path):
    """Start processes through this; they are all stopped at teardown, pass or fail."""
    s = Spawned(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def wait_progress(progress, target, what: str, proc: subprocess.Popen | None = None, stall_s: float = 300.0,
                  poll: float = 0.2):
    """Wait until ``progress()`` (a count: rounds logged, processes up) reaches ``target``.

    The limit is on progress, not on the total: the clock restarts whenever the count grows,
    and it runs at the speed the machine offers (:class:`hiso.patience.Patience`: on a loaded
    machine a second counts less), so a slow, busy machine only makes the wait longer, while a
    stuck run fails after ``stall_s`` such seconds without progress; a process ``proc`` that
    exits first fails at once."""
    last, clock = None, Patience(stall_s)
    while True:
        v = progress()
        if v >= target:
            return v
        if v != last:
            last = v
            clock.restart()
        if proc is not None and proc.poll() is not None:
            log = Path(proc.log).read_text(errors="replace") if hasattr(proc, "log") else ""
            raise AssertionError(f"{what}: the process exited {proc.returncode} first\n{log[-4000:]}")
        if clock.spent():
            raise AssertionError(f"{what}: no progress for {stall_s} s (at {last!r} of {target!r}; "
                                 "seconds counted at the share of a core the machine's load leaves)")
        time.sleep(poll)


def wait_until(done, what: str, within_s: float, poll: float = 0.1) -> None:
    """Wait until ``done()``, for at most ``within_s`` seconds counted at the speed the machine
    offers (a loaded machine lengthens the wait; see :class:`hiso.patience.Patience`)."""
    clock = Patience(within_s)
    while not done():
        if clock.spent():
            raise AssertionError(f"{what}: not within {within_s} s (counted at the share of a core "
                                 "the machine's load leaves)")
        time.sleep(poll)


def wait_exit(proc: subprocess.Popen, within_s: float = 300.0) -> int:
    """``proc``'s exit code, waiting at most ``within_s`` seconds counted as :func:`wait_until` does."""
    wait_until(lambda: proc.poll() is not None, f"process {proc.pid} to exit", within_s)
    return proc.returncode


def run_within(argv, within_s: float = 300.0, clock: Patience | None = None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, **kw)``, killed (and failing) after
    ``within_s`` seconds counted as :func:`wait_until` does instead of a wall-clock ``timeout``
    (``clock``: a Patience to count on instead, whose ``used`` then tells how long it took)."""
    clock = clock or Patience(within_s)
    within_s = clock.seconds
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as p:
        while True:
            try:
                out, err = p.communicate(timeout=1.0)  # (retried: no output is lost)
                return subprocess.CompletedProcess(argv, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                if clock.spent():
                    p.kill()
                    out, err = p.communicate()
                    raise AssertionError(f"{argv[:4]}: not done within {within_s} s (counted at the share of "
                                         f"a core the machine's load leaves)\n{err[-3000:]}") from None


def rows_logged(path: Path) -> int:
    """Rounds logged in a run directory's metrics.jsonl (0 before it exists)."""
    try:
        return max(0, len((path / "metrics.jsonl").read_text().splitlines()) - 1)
    except OSError:
        return 0


class TinyTask(Task):
    name = "tiny"

    def __init__(self, num_clients: int = 20, seed: int = 0, n_per_client: int = 32, d_in: int = 6):
        super().__init__(num_clients, seed)
        g = torch.Generator().manual_seed(seed)
        self.X = torch.randn(num_clients, n_per_client, d_in, generator=g)
        w = torch.randn(d_in, 1, generator=g)
        self.Y = torch.tanh(self.X @ w) + 0.1 * torch.randn(num_clients, n_per_client, 1, generator=g)
        self.d_in = d_in

    def build_model(self) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return nn.Sequential(nn.Linear(self.d_in, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 1))

    def batch(self, client, round, step, batch_size):
        rng = np.random.default_rng([self.seed, client, round, step])
        idx = torch.as_tensor(rng.choice(self.X.shape[1], size=min(batch_size, self.X.shape[1]), replace=False))
        return self.X[client, idx], self.Y[client, idx]

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def evaluate(self, model):
        with torch.no_grad():
            return {"eval_loss": float(((model(self.X.reshape(-1, self.d_in)) - self.Y.reshape(-1, 1)) ** 2).mean())}


@pytest.fixture
def tiny_task():
    return TinyTask()
