"""A stopped hiso leaves nothing behind: SIGTERM, SIGINT, SIGHUP or an error stop every process
it started (hiso.procs), whether a federation (`hiso flower`, with or without per-node workers)
or a worker pool (`hiso compare --jobs 2`). Processes are found by an environment tag every
descendant inherits (conftest.tagged), so even one that left the process tree is seen."""

from __future__ import annotations

import importlib.util
import signal
import sys
import textwrap
import time

import pytest

from conftest import rows_logged, run_within, wait_exit, wait_progress, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux only")
needs_flwr = pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="the flower extra is not installed")

# a child that starts a grandchild in a new session and exits (an orphan, like Flower's
# detached SuperExec whose parent died), and a child that ignores SIGTERM
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from hiso.procs import own_processes
    with own_processes(grace=1.0):
        subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)"]).wait()
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(600)"], stdout=open(sys.argv[1], "w"))
        if sys.argv[2] == "raise":
            while "ready" not in open(sys.argv[1]).read():
                time.sleep(0.05)
            raise RuntimeError("boom")
        time.sleep(600)
""")


def _none_left(spawned, within_s: float = 10.0) -> None:
    """No process of the command outlives it by more than ``within_s`` (multiprocessing's
    resource tracker ends when it notices its parent's exit, a moment later)."""
    wait_until(lambda: not spawned.left(), f"the command's processes to end ({spawned.left()} left)", within_s)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP", "raise"])
def test_own_processes_stops_orphans_and_stubborn_children(spawned, tmp_path, how):
    ready = tmp_path / "ready"
    ready.write_text("")
    p = spawned.start([sys.executable, "-c", TREE, str(ready), how])
    if how != "raise":  # (raising, it stops right after the stubborn child is ready)
        wait_progress(lambda: int("ready" in ready.read_text()) + len(spawned.left()), 4, "the tree to start", p,
                      stall_s=120)
        assert len(spawned.left()) == 3  # the owner, the orphan, the stubborn child
        p.send_signal(getattr(signal, how))
    wait_exit(p, 60)
    assert p.returncode != 0 and "ready" in ready.read_text()
    assert spawned.left() == []


# an owner started with SIGHUP and SIGINT ignored (nohup; a shell's background job)
IGNORING = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from hiso.procs import own_processes
    with own_processes(grace=1.0):
        open(sys.argv[1], "w").write("ready")
        time.sleep(600)
""")


def test_own_processes_keeps_signals_it_was_started_ignoring(spawned, tmp_path):
    """`nohup hiso flower ...` survives the terminal's SIGHUP; SIGTERM still stops it."""
    ready = tmp_path / "ready"
    p = spawned.start([sys.executable, "-c", IGNORING, str(ready)])
    wait_progress(lambda: ready.exists() and ready.read_text() == "ready", True, "the owner to start", p,
                  stall_s=120)
    for sig in (signal.SIGHUP, signal.SIGINT):
        p.send_signal(sig)
    time.sleep(1.0)
    assert p.poll() is None  # still running
    p.send_signal(signal.SIGTERM)
    assert wait_exit(p, 60) != 0
    assert spawned.left() == []


# an owner whose child leaves an orphan (re-parented to the owner) that exits before it does
ZOMBIE = textwrap.dedent("""
    import os, subprocess, sys, time
    from hiso.procs import own_processes
    with own_processes(grace=1.0):
        subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                          "subprocess.Popen([sys.executable, '-c', 'pass'], start_new_session=True)"]).wait()
        time.sleep(3)  # the orphan has exited by now: a zombie child of ours
    me = str(os.getpid())
    zombies = []
    for d in os.listdir("/proc"):
        try:
            st = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if st[1] == me and st[0] == "Z":
            zombies.append(d)
    print("zombies", len(zombies))
""")


def test_own_processes_leaves_no_zombie(tmp_path):
    """Children that exited on their own (Flower's SuperExecs, re-parented to us) are collected
    before the command exits, not handed to init as zombies."""
    from conftest import SRC
    r = run_within([sys.executable, "-c", ZOMBIE], 120, env={**__import__("os").environ, "PYTHONPATH": SRC})
    assert "zombies 0" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.flower
@needs_flwr
@pytest.mark.parametrize("sig,worker", [("SIGTERM", False), ("SIGHUP", True)])
def test_hiso_flower_stopped_mid_run_leaves_no_process(spawned, tmp_path, sig, worker):
    out = tmp_path / "run"
    p = spawned.hiso("flower", "--task", "quadratic", "--dim", "20", "--clients", "2", "--sampled", "2",
                     "--local-steps", "1", "--perturbations", "2", "--rounds", "200", "--eval-every", "100",
                     "--threads", "1", "--nodes", "2", "--round-timeout", "60", "--seed", "1",
                     "--workdir", str(tmp_path / "fed"), "--out", str(out), *(["--worker"] if worker else []))
    wait_progress(lambda: rows_logged(out), 2, "two rounds over Flower", p)  # mid-run: every process up
    running = spawned.left()
    assert len(running) >= 5  # hiso, SuperLink, SuperExec(s), ServerApp, SuperNodes (+ workers)
    p.send_signal(getattr(signal, sig))
    wait_exit(p, 120)
    _none_left(spawned)
    assert p.returncode == 128 + getattr(signal, sig), p.log.read_text()[-3000:]
    assert rows_logged(out) < 200  # it did stop mid-run


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [("SIGTERM", 128 + signal.SIGTERM), ("SIGINT", 128 + signal.SIGINT)])
def test_hiso_compare_jobs_stopped_leaves_no_worker(spawned, tmp_path, sig, code):
    out = tmp_path / "cmp"
    p = spawned.hiso("compare", "--task", "quadratic", "--dim", "2000", "--clients", "4", "--sampled", "2",
                     "--rounds", "100000", "--eval-every", "1000", "--threads", "1", "--seeds", "0",
                     "--lr-grid", "hiso=0.01", "--lr-grid", "decomfl=0.01", "--jobs", "2", "--quiet",
                     "--out", str(out))
    runs = lambda: sum(rows_logged(d) > 2 for d in (out / "runs").glob("*/*/*"))  # noqa: E731
    wait_progress(runs, 2, "both runs of the pool to log rounds", p)
    p.send_signal(getattr(signal, sig))
    wait_exit(p, 120)
    _none_left(spawned)
    assert p.returncode == code, p.log.read_text()[-3000:]


# ------------------------------------------------------------- the tests' own guard

INNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path

    def test_starts_and_hangs(spawned):
        # a hiso-like owner whose child detaches (its own session), as Flower's SuperExec does
        spawned.start([sys.executable, "-c", "import subprocess, sys, time\\n"
                       "from hiso.procs import own_processes\\n"
                       "with own_processes(grace=1.0):\\n"
                       "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\\n"
                       "    time.sleep(600)\\n"])
        Path(%(marker)r).write_text(spawned.tag)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_processes_a_test_started_stop_when_the_test_process_is_stopped(spawned, tmp_path, sig):
    """A pytest run stopped by `timeout` (SIGTERM: teardowns run) or killed (SIGKILL: the
    children's PR_SET_PDEATHSIG, then hiso's own cleanup) leaves none of its processes."""
    from conftest import tagged
    marker = tmp_path / "tag"
    (tmp_path / "test_inner.py").write_text(INNER % {"marker": str(marker)})
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    inner = spawned.start([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          env={"PYTHONPATH": tests_dir}, cwd=tmp_path)
    wait_progress(lambda: marker.exists() and len(tagged(marker.read_text())) >= 2, True, "the inner test to start",
                  inner, stall_s=120)
    tag = marker.read_text()
    assert len(tagged(tag)) == 2  # the owner and its detached child
    inner.send_signal(getattr(signal, sig))
    wait_exit(inner, 60)
    wait_progress(lambda: not tagged(tag), True, "the inner test's processes to stop", stall_s=30)
