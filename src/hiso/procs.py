"""Every process hiso starts stops with it.

A ``hiso`` command owns the processes it starts (the Flower federation: SuperLink, SuperNodes,
their SuperExecs, the ServerApp and the ClientApps Flower starts per message, per-node
workers; ``hiso compare --jobs N``'s worker pool). They are one group in the sense that
matters here, the command's tree of descendants: Flower starts its SuperExec in a new session
(so no single POSIX process group can hold the federation), so the command makes itself a
*child subreaper* (Linux) and an orphan whose parent died first is re-parented to it instead of
to init, and stays in the tree.

:func:`own_processes` turns SIGTERM, SIGINT and SIGHUP (what ``timeout``, a batch scheduler,
Ctrl-C or a closed terminal send) into a :class:`Stopped` exception in the main thread (a
signal the command was started ignoring, SIGHUP under ``nohup``, SIGINT in a shell's background
job, stays ignored), so the ``finally``/``with`` paths that stop runs in order (a federation's
``stop``, the pool's shutdown) run as they do for any other exception; whatever is still alive below the command
then is stopped by :func:`stop_processes` (SIGTERM, a grace period, SIGKILL). Processes that
hiso starts directly also get ``PR_SET_PDEATHSIG`` (:func:`die_with_parent`), so a SIGKILLed
hiso (which runs no handler) still takes them down, and Flower's own processes watch their
parent's pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (a KeyboardInterrupt, so every path that handles Ctrl-C handles it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# resolved here, once: a child between fork and exec (preexec_fn) must not dlopen anything
_PRCTL = _libc_prctl()


def _prctl(option: int, arg: int) -> bool:
    return _PRCTL is not None and _PRCTL(option, arg, 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn``: the child gets ``sig`` when the process that started it dies (Linux).

    Linux ties this to the *thread* that forked: start such children from a thread that
    outlives them (the main thread, in hiso)."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper(on: bool = True) -> bool:
    """Orphans among this process's descendants are re-parented to it, not to init (Linux)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, int(on))


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    st = _stat(pid)
    if st is None:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return not os.path.isdir("/proc")  # no /proc: os.kill's answer is all there is
    return st[0] not in ("Z", "X")


def cpu_ticks(pid: int) -> int | None:
    """CPU time a process has used (user + system, in clock ticks); None if it is gone or
    unknown (no /proc). A process whose count grows is working, however slowly."""
    st = _stat(pid)
    try:
        return int(st[11]) + int(st[12]) if st is not None else None
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (by /proc parent links), deepest first."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for d in entries:
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                children.setdefault(int(st[1]), []).append(int(d))
    out, todo = [], list(children.get(pid, []))
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(children.get(c, []))
    return out[::-1]


def with_env(entry: str) -> list[int]:
    """Live processes (but this one) whose environment holds ``entry`` (``NAME=value``): every
    descendant inherits it, even one that left the process tree (Linux; [] without /proc)."""
    needle, out = entry.encode(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for d in entries:
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read().split(b"\0") and alive(int(d)):
                        out.append(int(d))
            except OSError:
                pass
    return out


def _reap(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def exited_children() -> list[int]:
    """This process's children that have exited and wait to be collected (zombies)."""
    me, out = os.getpid(), []
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{me}/task/{t}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        out.extend(c for c in kids if (st := _stat(c)) is not None and st[0] == "Z")
    return out


def _waited_for_elsewhere() -> set[int]:
    """Children a ``subprocess.Popen`` or a ``multiprocessing`` process object of this process
    will wait for: collecting them here would take their exit status from their owner."""
    import gc

    owners = tuple(m.Popen for m in (sys.modules.get("subprocess"), sys.modules.get("multiprocessing.popen_fork"))
                   if m is not None)
    # type(o), not isinstance: isinstance may ask an object's __class__, which some lazy module
    # attributes answer with a deprecation warning (torch.distributed.reduce_op)
    return {o.pid for o in gc.get_objects() if issubclass(type(o), owners) and o.returncode is None}


def orphans() -> list[int]:
    """Exited children that nothing in this process will wait for: orphans re-parented to a
    subreaper (Flower's SuperExecs and apps whose parent ended first)."""
    zombies = exited_children()
    return [z for z in zombies if z not in _waited_for_elsewhere()] if zombies else []


def reap_orphans() -> list[int]:
    """Collect :func:`orphans`, which would otherwise stay zombies for as long as this process
    runs; returns their pids."""
    done = orphans()
    _reap(done)
    return done


def stop_processes(pids, grace: float = 5.0) -> None:
    """SIGTERM ``pids``, wait up to ``grace`` seconds for them to end, SIGKILL the rest."""
    pids = every = [p for p in pids if p != os.getpid()]
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        t_end = time.monotonic() + wait_s
        while True:
            _reap(pids)  # our own children (re-parented orphans included) would stay zombies
            pids = [p for p in pids if alive(p)]
            if not pids or time.monotonic() > t_end:
                break
            time.sleep(0.05)
        if not pids:
            break
    _reap(every)  # those that ended while being stopped: alive() drops a zombie unreaped


def stop_tree(root: int | None = None, keep=(), grace: float = 5.0, sweeps: int = 5) -> None:
    """Stop every descendant of ``root`` (default: this process) but ``keep``, until none is
    left (a process may start another while its siblings are being stopped)."""
    root = os.getpid() if root is None else root
    keep = set(keep)
    for _ in range(sweeps):
        pids = [p for p in descendants(root) if p not in keep and alive(p)]
        if not pids:
            return
        stop_processes(pids, grace)


def _exits_with_us() -> set[int]:
    """Helpers that end by themselves when this process does: multiprocessing's resource
    tracker (it ignores SIGTERM, so stopping it would cost the whole grace period)."""
    rt = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(rt, "_resource_tracker", None), "_pid", None)
    return {pid} if pid else set()


@contextlib.contextmanager
def own_processes(grace: float = 5.0):
    """Run the body as the owner of every process it starts (see the module's docstring).

    Stop signals raise :class:`Stopped` once; a second one while the cleanup runs is ignored,
    so the cleanup is not cut short. On leaving, by any path, every process started in the
    body and still alive is stopped, and those that already exited are reaped. Main thread only
    (signal handlers)."""
    me = os.getpid()
    before = set(descendants(me))
    reaper = become_subreaper()
    stopping: list[int] = []

    def handler(signum, frame):
        if stopping:
            return
        stopping.append(signum)
        raise Stopped(signum)

    # a signal the command was started ignoring stays ignored: `nohup hiso ...` (SIGHUP) and a
    # shell's background job (SIGINT) must not be stopped by it
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        stopping.append(0)
        try:
            stop_tree(me, keep=before | _exits_with_us(), grace=grace)
            # and collect the ones that had already exited: orphans re-parented to us (Flower's
            # SuperExecs) would otherwise outlive the command as zombies
            _reap(p for p in descendants(me) if p not in before)
            reap_orphans()
        finally:
            if reaper:
                become_subreaper(False)
            for s, h in old.items():
                signal.signal(s, h)
