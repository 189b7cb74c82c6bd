"""Start a SuperLink and N SuperNodes on 127.0.0.1, run hiso on them, stop everything.

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
from ..procs import descendants as _descendants
from ..procs import cpu_ticks, die_with_parent, stop_processes, with_env

PROJECT = Path(__file__).parent / "project"
PROJECT_WORKER = Path(__file__).parent / "project_worker"  # the relay ClientApp (per-node workers)
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
             "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
HOST = "127.0.0.1"


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


def make_tls(dirpath: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost (test and local use)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    dirpath.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hiso test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address(HOST))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    out = {"ca": dirpath / "ca.crt", "cert": dirpath / "server.pem", "key": dirpath / "server.key"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    return out


def make_node_key(dirpath: Path, name: str) -> tuple[Path, Path]:
    """An EC (P-384) key pair in OpenSSH format, as SuperNode authentication wants."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    dirpath.mkdir(parents=True, exist_ok=True)
    k = ec.generate_private_key(ec.SECP384R1())
    priv, pub = dirpath / name, dirpath / f"{name}.pub"
    priv.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                     serialization.NoEncryption()))
    priv.chmod(0o600)
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return priv, pub


@dataclass
class LocalFederation:
    """A SuperLink and ``nodes`` SuperNodes on loopback; a context manager that stops them all."""

    nodes: int
    workdir: Path | None = None
    tls: bool = False
    auth: bool = False
    partitions: list[int] | None = None  # node i's partition (default: i)
    verbose: bool = False
    start_timeout: float = 120.0
    port: int = 0  # the SuperLink's port (0: a free one)
    node_link_port: int | None = None  # where SuperNodes reach the SuperLink (a byte-counting proxy)
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
        self.partitions = self.partitions or list(range(self.nodes))
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
            self.start_node(i)
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
        part = self.partitions[i] if i < len(self.partitions) else i
        nc = f"partition-id={part} state-dir='{self.state_dir}'"
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
        argv = [str(self.bin / "flower-supernode"), "--superlink", f"{HOST}:{self.node_link_port or self.port}",
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

    def kill_serverapp(self, sig: int = signal.SIGKILL) -> list[int]:
        """Kill the running ServerApp processes (a crashed server, for tests); their pids."""
        pids = self.serverapps()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def nodes_online(self) -> list[dict]:
        res = self._flwr("supernode", "ls", "local", "--format", "json")
        return [n for n in res.get("nodes", []) if n.get("status") == "online"]

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill SuperNode ``i`` (and the ClientApp it may be running, and its worker) at once."""
        self._stop(f"supernode{i}", sig)
        self._stop(f"worker{i}", sig)

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
    def submit(self, cfg: RunConfig, out_dir: str | Path, *, round_timeout: float = 30.0,
               min_nodes: int | None = None, wait_nodes_s: float = 60.0, resume: bool = False) -> str:
        """``flwr run`` the app with ``cfg``; returns the run id (the run goes on in the federation).
        ``resume``: ``out_dir`` holds an interrupted run of ``cfg`` (its ServerApp died): continue it.
        A DP noise key in ``cfg`` is refused (the run config reaches every ClientApp)."""
        from .records import noise_seed_refusal
        if why := noise_seed_refusal(cfg):
            raise ValueError(why)
        over = self.workdir / f"run-{time.time_ns()}.toml"
        import tomli_w
        over.write_text(tomli_w.dumps({
            "hiso-config": self.config_text(cfg), "out-dir": str(Path(out_dir).resolve()),
            "round-timeout": float(round_timeout), "min-nodes": int(min_nodes if min_nodes is not None else self.nodes),
            "wait-nodes-s": float(wait_nodes_s), "resume": bool(resume)}))
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
        so a busy machine makes a run slower, not failed, and a stuck one is stopped after
        ``timeout`` seconds without a round."""
        if progress is None:
            out = self.out_dirs.get(run_id)
            progress = (lambda: rounds_logged(out)) if out is not None else (lambda: 0)
        last, t_last = progress(), time.monotonic()
        while True:
            st = self.status(run_id)
            if st["status"].startswith("finished"):
                break
            if on_poll is not None:
                on_poll(st)
            now = progress()
            if now != last:
                last, t_last = now, time.monotonic()
            elif time.monotonic() - t_last > timeout:
                self._flwr("stop", run_id, "local", "--format", "json")
                raise FlowerRunError(f"run {run_id} still {st['status']}: no round in {timeout} s (at {last}; "
                                     "stopped it)")
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


def run_local(cfg: RunConfig, out: str | Path, nodes: int, *, tls: bool = False, auth: bool = False,
              round_timeout: float = 30.0, timeout: float = 3600.0, workdir: str | Path | None = None,
              verbose: bool = False, progress=None, resume: bool = False, worker: bool = False) -> dict:
    """Start a loopback federation of ``nodes`` SuperNodes (partitions 0..nodes-1), run ``cfg``
    into ``out`` (``resume``: continue the interrupted run there), stop every process; returns
    the run's final status (raises unless completed, or after ``timeout`` seconds without a
    round logged)."""
    if not 1 <= nodes <= cfg.clients:
        raise ValueError(f"need 1 to {cfg.clients} nodes (node i serves partition i), got {nodes}")
    from .records import noise_seed_refusal
    if why := noise_seed_refusal(cfg):
        raise ValueError(why)
    if worker and not cfg.scalar_only:
        raise ValueError(f"{cfg.algorithm}: per-node workers serve the scalar-only algorithms (hiso, decomfl)")
    if cfg.clients != nodes:
        print(f"hiso flower: {cfg.clients} partitions on {nodes} nodes: partitions without a node never answer",
              file=sys.stderr)
    with LocalFederation(nodes=nodes, workdir=Path(workdir) if workdir else None, tls=tls, auth=auth,
                         verbose=verbose, worker=worker) as fed:
        try:
            run_id = fed.submit(cfg, out, round_timeout=round_timeout, resume=resume)
            if verbose:
                print(f"run {run_id}; logs in {fed.logs}", file=sys.stderr)
            return fed.wait(run_id, timeout, on_poll=progress)
        except BaseException:  # the work directory stays (logs, replicas): say where, and how to go on
            resumable = cfg.scalar_only and (Path(out) / "config.json").exists() \
                and not (Path(out) / "summary.json").exists()
            print(f"hiso flower: Flower's logs and the nodes' replicas are kept in {fed.workdir}"
                  + (f"; to continue: hiso flower --resume {out}"
                     f"{f' --nodes {nodes}' if nodes != cfg.clients else ''} --workdir {fed.workdir}" if resumable else ""),
                  file=sys.stderr)
            raise


def missed_answers_note(out: str | Path) -> str | None:
    """One line naming the partitions whose sampled rounds closed without their answer (a node
    down, late or refused), from the run's ``flower.json``; None when every sampled client answered.
    ``flwr`` reports such a run as completed: without this nothing on the terminal would say so."""
    try:
        timings = json.loads(Path(out, "flower.json").read_text())["flower"]["timings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    sampled: dict[int, int] = {}
    missed: dict[int, int] = {}
    rounds = 0
    for t in timings:
        lost = set(t.get("sampled", [])) - set(t.get("participants", []))
        rounds += bool(lost)
        for pid in t.get("sampled", []):
            sampled[pid] = sampled.get(pid, 0) + 1
        for pid in lost:
            missed[pid] = missed.get(pid, 0) + 1
    if not missed:
        return None
    worst = sorted(missed, key=lambda p: (-missed[p], p))
    parts = ", ".join(f"partition {p} missed {missed[p]} of its {sampled[p]}" for p in worst[:3])
    more = f" and {len(worst) - 3} more partitions" if len(worst) > 3 else ""
    return (f"note: {rounds} of {len(timings)} rounds closed without every sampled client's answer ({parts}{more}): "
            f"a node down, late or refused; the run went on with those that answered (flower.json, the ServerApp log)")
