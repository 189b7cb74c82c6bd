"""A SuperLink and N SuperNodes on 127.0.0.1 as processes: start them, submit and wait for runs, stop all.

What it runs are Flower's own commands (printed with ``--verbose``), so the same
federation can be started by hand on several machines (docs/flower.md)::

    flower-superlink --insecure --port PL
    flower-supernode --insecure --superlink 127.0.0.1:PL --port PN_i \\
        --node-config "partition-id=i state-dir='DIR'"
    flwr run <hiso>/flower/project local --run-config overrides.toml --format json
    flwr ls local --run-id RUN --format json     # until the status is finished:*

``flwr run`` only submits the run and exits 0 whatever happens to it, so the launcher polls
the run's status and raises :class:`FlowerRunError` unless it is ``finished:completed``.
Telemetry, update checks and runtime dependency installation are switched off. With
``tls=True`` it makes a CA and a server certificate for 127.0.0.1; with ``auth=True`` an EC
key per SuperNode, registered with ``flwr supernode register`` before the node starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..patience import Patience
from ..procs import descendants as _descendants
from ..procs import cpu_ticks, die_with_parent, reap_orphans, stop_processes, with_env
from .certs import HOST, make_node_key, make_tls

PROJECT = Path(__file__).parent / "project"
PROJECT_WORKER = Path(__file__).parent / "project_worker"  # the relay ClientApp (per-node workers)
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
             "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}


class FlowerRunError(RuntimeError):
    """The run did not finish successfully (its status and the ServerApp's log say why)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _refuse_busy(port: int, what: str) -> None:
    """Fail at once if something already listens on ``port``: the process about to start there
    could not bind it, and waiting for the port would find the other listener instead."""
    with socket.socket() as s:
        if s.connect_ex((HOST, port)) == 0:
            raise FlowerRunError(f"{HOST}:{port} is already in use: cannot start {what} there")


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Wait for ``proc`` to listen on ``port``. ``timeout`` bounds the time the process spends
    without using CPU (stuck), not its start: on a busy machine a start takes longer."""
    last, t_last = cpu_ticks(proc.pid), time.monotonic()
    while True:
        if proc.poll() is not None:
            raise FlowerRunError(f"{what} exited with code {proc.returncode} while starting")
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        now = cpu_ticks(proc.pid)
        if now != last:
            last, t_last = now, time.monotonic()
        elif time.monotonic() - t_last > timeout:
            raise FlowerRunError(f"{what} did not listen on {HOST}:{port} and did nothing for {timeout} s")
        time.sleep(0.2)


@dataclass
class LocalFederation:
    """A SuperLink and ``nodes`` SuperNodes on loopback; a context manager that stops them all."""

    nodes: int
    workdir: Path | None = None
    tls: bool = False
    auth: bool = False
    partitions: list | None = None  # node i's partition, or list of partitions (default: i; see clients)
    clients: int | None = None  # without partitions: clients 0..clients-1 dealt to the nodes in turn
    verbose: bool = False
    start_timeout: float = 120.0
    port: int = 0  # the SuperLink's port (0: a free one)
    node_link_port: int | None = None  # where SuperNodes reach the SuperLink (a byte-counting proxy)
    node_link_ports: dict[int, int] = field(default_factory=dict)  # node i's own way there (a fault proxy each)
    node_link_hosts: dict[int, str] = field(default_factory=dict)  # ... at another address (a veth pair's end)
    node_prefix: dict[int, list[str]] = field(default_factory=dict)  # argv before node i's (ip netns exec NS):
    # its port is then out of our sight: it is not waited for (the ServerApp waits for the nodes)
    worker: bool = False  # a long-lived worker per node (hiso.flower.worker) behind the relay ClientApp
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    out_dirs: dict[str, Path] = field(default_factory=dict)  # run id -> its run directory

    def __post_init__(self) -> None:
        self._own_workdir = self.workdir is None
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix="hiso-flower-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home = self.workdir / "flwr-home"
        self.state_dir = self.workdir / "replicas"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        if not self.partitions:
            from .parts import spread
            self.partitions = spread(self.clients, self.nodes) if self.clients else list(range(self.nodes))
        bindir = str(Path(sys.executable).parent)  # flower-superlink spawns flower-superexec by name
        self.env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(self.home),
                    "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
        self.bin = Path(bindir)
        self.node_ports: dict[int, int] = {}
        self.certs: dict[str, Path] = {}
        self.keys: dict[int, tuple[Path, Path]] = {}

    # -- processes
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        if self.verbose:
            print("$", " ".join(argv), file=sys.stderr)
        logf = open(self.logs / f"{name}.log", "ab")
        # own session: stop() ends the process group it heads, and nothing else; it dies with
        # us even if we are SIGKILLed (no handler runs then)
        # niceness HISO_FLOWER_NICE (default 15) in absolute terms, not added to ours
        inc = max(0, int(os.environ.get("HISO_FLOWER_NICE", "15")) - os.nice(0))
        p = subprocess.Popen(["nice", "-n", str(inc), *argv], env=self.env,
                             stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, cwd=self.workdir, preexec_fn=die_with_parent)
        logf.close()
        self.procs[name] = p
        return p

    def _tls_link_args(self) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        return ["--ssl-certfile", str(self.certs["cert"]), "--ssl-keyfile", str(self.certs["key"]),
                "--ssl-ca-certfile", str(self.certs["ca"])]

    def _flwr(self, *args: str, timeout: float = 60.0) -> dict:
        r = subprocess.run([str(self.bin / "flwr"), *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout, cwd=self.workdir)
        try:
            return json.loads(r.stdout[r.stdout.index("{"):])
        except ValueError:
            raise FlowerRunError(f"flwr {' '.join(args)} exited {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}") from None

    def start(self) -> "LocalFederation":
        if self.tls or self.auth:
            self.certs = make_tls(self.workdir / "certs") if self.tls else {}
        self.port = self.port or free_port()
        _refuse_busy(self.port, "flower-superlink")
        conn = {"address": f"{HOST}:{self.port}"}
        if self.tls:
            conn["root-certificates"] = str(self.certs["ca"].resolve())
        else:
            conn["insecure"] = True
        self.home.mkdir(parents=True, exist_ok=True)
        lines = ['[superlink]', 'default = "local"', '', '[superlink.local]']
        lines += [f"{k} = {json.dumps(v)}" for k, v in conn.items()]
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")
        argv = [str(self.bin / "flower-superlink"), *self._tls_link_args(), "--port", str(self.port)]
        if self.auth:
            argv.append("--enable-supernode-auth")
        sl = self._spawn("superlink", argv)
        _wait_port(self.port, sl, self.start_timeout, "flower-superlink")
        for i in range(self.nodes):
            self.start_node(i, wait=i not in self.node_prefix)
        return self

    def start_node(self, i: int, *, register: bool = True, wait: bool = True) -> subprocess.Popen:
        """Start (or restart) SuperNode ``i``; its replica directory is kept across restarts.

        With authentication on, its key is made and registered first (``register=False``
        makes a key the SuperLink does not know: such a node must be refused)."""
        if self.auth and i not in self.keys:
            self.keys[i] = make_node_key(self.workdir / "keys", f"node{i}")
            if register:
                res = self._flwr("supernode", "register", str(self.keys[i][1]), "local", "--format", "json")
                if not res.get("success", False):
                    raise FlowerRunError(f"could not register node {i}: {res}")
        port = self.node_ports.setdefault(i, free_port())
        _refuse_busy(port, f"flower-supernode {i}")
        from .parts import node_config_value
        part = self.partitions[i] if i < len(self.partitions) else i
        nc = f"partition-id={node_config_value(part if isinstance(part, list) else [part])} state-dir='{self.state_dir}'"
        if self.worker:  # the node's worker, (re)started with it
            sock = self.workdir / "workers" / f"node{i}.sock"
            sock.parent.mkdir(exist_ok=True)
            self._stop(f"worker{i}")
            w = self._spawn(f"worker{i}", [sys.executable, "-m", "hiso.flower.worker", "--socket", str(sock)])
            last, t_last = cpu_ticks(w.pid), time.monotonic()
            while not sock.exists():  # bounded by the worker's progress (CPU used), as _wait_port
                now = cpu_ticks(w.pid)
                if now != last:
                    last, t_last = now, time.monotonic()
                if w.poll() is not None or time.monotonic() - t_last > self.start_timeout:
                    raise FlowerRunError(f"the worker of node {i} did not start (see {self.logs}/worker{i}.log)")
                time.sleep(0.1)
            nc += f" worker-socket='{sock}'"
        link = f"{self.node_link_hosts.get(i, HOST)}:{self.node_link_ports.get(i) or self.node_link_port or self.port}"
        argv = [*self.node_prefix.get(i, []), str(self.bin / "flower-supernode"), "--superlink", link,
                "--port", str(port),
                "--node-config", nc]
        argv += ["--root-certificates", str(self.certs["ca"])] if self.tls else ["--insecure"]
        if self.auth:
            argv += ["--auth-supernode-private-key", str(self.keys[i][0])]
        p = self._spawn(f"supernode{i}", argv)
        if wait:
            _wait_port(port, p, self.start_timeout, f"flower-supernode {i}")
        return p

    def serverapps(self) -> list[int]:
        """The pids of the ServerApp processes running now (children of the SuperLink's tree)."""
        p = self.procs.get("superlink")
        out = []
        for pid in _descendants(p.pid) if p else []:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"flwr-serverapp" in f.read():
                        out.append(pid)
            except OSError:
                pass
        return out

    def _stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        pids = _descendants(p.pid) + [p.pid]  # detached children (superexec, apps) included
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            p.wait(timeout=10)

    def stop(self) -> None:
        for name in [n for n in self.procs if n.startswith(("supernode", "worker"))] + ["superlink"]:
            self._stop(name)
        # what left the tree (an app whose parent died first) still carries our FLWR_HOME
        stop_processes(with_env(f"FLWR_HOME={self.home}"), grace=5.0)
        reap_orphans()  # and those that ended before: where we are a subreaper, they are ours

    def __enter__(self) -> "LocalFederation":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_workdir and exc[0] is None and not self.verbose:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- runs
    def submit(self, cfg: RunConfig, out_dir: str | Path, *, round_timeout: float | None = None,
               min_nodes: int | None = None, wait_nodes_s: float | None = None, resume: bool = False) -> str:
        """``flwr run`` the app with ``cfg``; returns the run id (the run goes on in the federation).
        ``round_timeout``, ``wait_nodes_s``: None, from what the ServerApp measures (:mod:`hiso.flower.timeouts`).
        ``resume``: ``out_dir`` holds an interrupted run of ``cfg`` (its ServerApp died): continue it.
        A DP noise key in ``cfg`` is refused (the run config reaches every ClientApp)."""
        from .records import noise_seed_refusal
        if why := noise_seed_refusal(cfg):
            raise ValueError(why)
        over = self.workdir / f"run-{time.time_ns()}.toml"
        import tomli_w
        over.write_text(tomli_w.dumps({
            "hiso-config": self.config_text(cfg), "out-dir": str(Path(out_dir).resolve()),
            "round-timeout": float(round_timeout or 0.0), "min-nodes": int(min_nodes if min_nodes is not None else self.nodes),
            "wait-nodes-s": float(wait_nodes_s or 0.0), "resume": bool(resume)}))
        res = self._flwr("run", str(PROJECT_WORKER if self.worker else PROJECT), "local", "--run-config", str(over), "--format", "json", timeout=120)
        if not res.get("success"):
            raise FlowerRunError(f"flwr run failed: {res.get('error-message', res)}")
        self.out_dirs[str(res["run-id"])] = Path(out_dir)
        return str(res["run-id"])

    @staticmethod
    def config_text(cfg: RunConfig) -> str:
        """The configuration as it travels in the run config (and keys the nodes' replicas)."""
        return cfg.model_dump_json()

    def status(self, run_id: str) -> dict:
        res = self._flwr("ls", "local", "--run-id", run_id, "--format", "json")
        runs = res.get("runs") or []
        if not res.get("success") or not runs:
            raise FlowerRunError(f"flwr ls: no run {run_id}: {res}")
        return runs[0]

    def wait(self, run_id: str, timeout: float, poll: float = 3.0, on_poll=None, progress=None) -> dict:
        """Block until the run finishes; raise FlowerRunError unless it completed.

        ``timeout`` bounds the time *without progress*, not the whole run: ``progress()`` (by
        default the rounds logged in the run's directory) restarts the clock whenever it grows,
        and the clock runs at the speed the machine offers (:class:`hiso.patience.Patience`),
        so a busy machine makes a run slower, not failed, and a stuck one is stopped after
        ``timeout`` seconds without a round."""
        if progress is None:
            out = self.out_dirs.get(run_id)
            progress = (lambda: rounds_logged(out)) if out is not None else (lambda: 0)
        last, clock = progress(), Patience(timeout)
        while True:
            st = self.status(run_id)
            if st["status"].startswith("finished"):
                break
            if on_poll is not None:
                on_poll(st)
            now = progress()
            if now != last:
                last = now
                clock.restart()
            elif clock.spent():
                self._flwr("stop", run_id, "local", "--format", "json")
                raise FlowerRunError(f"run {run_id} still {st['status']}: no round in {timeout} s (at {last}; "
                                     "stopped it)")
            reap_orphans()  # Flower starts an app process per run and message: collect those that ended
            time.sleep(poll)
        if st["status"] != "finished:completed":
            log = self.logs_of(run_id)
            raise FlowerRunError(f"run {run_id} {st['status']}: {st.get('status-details')}\n{log[-3000:]}")
        return st

    def logs_of(self, run_id: str) -> str:
        try:
            r = subprocess.run([str(self.bin / "flwr"), "log", run_id, "local", "--show"], env=self.env,
                               capture_output=True, text=True, timeout=20, cwd=self.workdir)
            return r.stdout + r.stderr
        except (subprocess.TimeoutExpired, OSError) as e:
            return f"(no log: {e})"

    def run(self, cfg: RunConfig, out_dir: str | Path, timeout: float = 600.0, **kw) -> dict:
        return self.wait(self.submit(cfg, out_dir, **kw), timeout)


def rounds_logged(out: Path) -> int:
    """Rows in a run directory's metrics.jsonl (0 before it exists): the run's progress."""
    try:
        with open(Path(out) / "metrics.jsonl", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0
