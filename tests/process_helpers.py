"""What only the tests do to hiso's processes: collect exited children, and break a local Flower
federation (:class:`hiso.flower.launch.LocalFederation`) on purpose."""

from __future__ import annotations

import os
import signal


def reap_children() -> None:
    """Collect this process's children that have exited (re-parented orphans are never waited
    for by anyone else)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_serverapp(fed, sig: int = signal.SIGKILL) -> list[int]:
    """Kill ``fed``'s running ServerApp processes (a crashed server); their pids."""
    pids = fed.serverapps()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def nodes_online(fed) -> list[dict]:
    """The SuperNodes ``fed``'s SuperLink lists as online."""
    res = fed._flwr("supernode", "ls", "local", "--format", "json")
    return [n for n in res.get("nodes", []) if n.get("status") == "online"]


def kill_node(fed, i: int, sig: int = signal.SIGKILL) -> None:
    """Kill ``fed``'s SuperNode ``i`` (and the ClientApp it may be running, and its worker) at once."""
    fed._stop(f"supernode{i}", sig)
    fed._stop(f"worker{i}", sig)
