"""Flower federations under network faults: the scenarios of tests/test_flower_faults.py and
bench/flower_faults.py, and the checks both make.

Each SuperNode reaches the SuperLink through its own :class:`hiso.flower.faultproxy.FaultProxy`
on 127.0.0.1, or from its own network namespace across a veth pair (one node can be cut off
alone). A run under faults loses answers, so its log
cannot equal a fault-free ``hiso run`` after the first round that lost one; :func:`audit_log`
checks instead that every logged round is exactly what the in-process simulator computes for
that round's participants at that round's model (its sample and seeds drawn again, each
participant's answer recomputed, the aggregate compared bit for bit), and
:func:`simulator_prefix` how many leading rounds equal the fault-free run's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from hiso.config import RunConfig
from hiso.core.history import read_history
from hiso.flower.faultproxy import FaultProxy
from hiso.flower.launch import LocalFederation, free_port, rounds_logged
from hiso.patience import Patience


def can_make_namespaces() -> bool:
    """Whether this process may make network namespaces and veth pairs (root, ``ip``, unshare)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def veth_namespaces(n: int):
    """``n`` network namespaces, each joined to this one by a veth pair (10.243.i.1 here,
    10.243.i.2 there); yields [(namespace, our end's interface, our end's address)]."""
    tag, made = f"h43p{os.getpid() % 100000}", []
    try:
        for i in range(n):
            ns, a, b = f"{tag}n{i}", f"{tag}a{i}", f"{tag}b{i}"  # (interface names: 15 characters at most)
            _ip("netns", "add", ns)
            made.append((ns, a))
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", b, "netns", ns)
            _ip("addr", "add", f"10.243.{i}.1/30", "dev", a)
            _ip("link", "set", a, "up")
            for cmd in (("addr", "add", f"10.243.{i}.2/30", "dev", b), ("link", "set", b, "up"), ("link", "set", "lo", "up")):
                _ip("-n", ns, *cmd)
        yield [(ns, a, f"10.243.{i}.1") for i, (ns, a) in enumerate(made)]
    finally:
        for ns, a in made:
            subprocess.run(["ip", "link", "del", a], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def proxied_federation(workdir: Path, nodes: int, worker: bool = False, netns: list | None = None, **faults):
    """A LocalFederation whose node i talks to the SuperLink through ``proxies[i]`` (``faults``:
    FaultProxy's fields; ``worker``: per-node workers); yields (federation, proxies). Every
    process and proxy stopped after. ``netns`` (from :func:`veth_namespaces`): node i runs in
    namespace i and reaches its proxy across the veth pair."""
    with ExitStack() as stack:
        link = free_port()
        hosts = [h for _, _, h in netns] if netns else ["127.0.0.1"] * nodes
        proxies = [stack.enter_context(FaultProxy(link, seed=i, listen_host=hosts[i], **faults)) for i in range(nodes)]
        fed = LocalFederation(nodes=nodes, workdir=workdir, port=link, worker=worker,
                              node_link_ports={i: p.port for i, p in enumerate(proxies)},
                              node_link_hosts={i: hosts[i] for i in range(nodes)},
                              node_prefix={i: ["ip", "netns", "exec", ns] for i, (ns, _, _) in enumerate(netns or [])})
        stack.callback(fed.stop)
        fed.start()
        yield fed, proxies


def rounds_done(out: Path) -> int:
    """Rounds logged in ``out`` (metrics.jsonl's rows less round 0's evaluation)."""
    return max(rounds_logged(out) - 1, 0)


def wait_rounds(out: Path, n: int, stall_s: float = 240.0) -> None:
    """Until ``n`` rounds are logged; fails after ``stall_s`` seconds without a new one, counted at
    the speed the machine offers (hiso.patience: a loaded machine lengthens the wait)."""
    last, clock = rounds_done(out), Patience(stall_s)
    while (now := rounds_done(out)) < n:
        if now != last:
            last = now
            clock.restart()
        elif clock.spent():
            raise TimeoutError(f"{out}: no round in {stall_s} s (at {now}, waiting for {n})")
        time.sleep(0.2)


def audit_log(cfg: RunConfig, out: Path) -> int:
    """Recompute every round of ``out``'s log in process with its logged participants; assert
    each record (seeds, participants, scalars) and the final model and H are the simulator's
    bit for bit. Returns the rounds checked."""
    from hiso.core.messages import decode_downlink, encode_downlink
    from hiso.runners.simulate import Simulation
    from hiso.tasks.registry import build_task
    recs = read_history(out / "history.bin")[2]
    sim = Simulation(build_task(cfg), cfg.zo(), cfg.sampled, seed=cfg.seed, batch_size=cfg.batch_size)
    srv, wire = sim.server, sim.server.wire
    for rec in recs:
        srv.plan_logged(rec)  # the logged sample holds the participants; the seeds are the derived ones
        ups = [sim._fast_answer(cid, decode_downlink(encode_downlink(srv.downlink(cid), wire), wire))
               for cid in rec.participants]
        mine = srv.aggregate(ups, partial=True)
        assert mine is not None and mine.participants == rec.participants, (rec.round, mine)
        assert mine.seeds.tobytes() == rec.seeds.tobytes() and mine.scalars.tobytes() == rec.scalars.tobytes(), \
            f"round {rec.round}: the logged scalars are not the participants' answers"
        sim.state.apply(mine)
    final = torch.load(out / "model.pt", weights_only=False)
    assert final["round"] == len(recs) == cfg.rounds
    assert all(torch.equal(p, final["model"][n]) for n, p in sim.state.named)
    assert _same_h(sim.state, final)
    return len(recs)


def _same_h(state, final: dict) -> bool:
    """H equal to the run's final one (DeComFL has none)."""
    if state.h is None:
        return "h" not in final or not final["h"]
    return all(torch.equal(h, final["h"][n]) for (n, _), h in zip(state.named, state.h))


def simulator_prefix(cfg: RunConfig, out: Path, sim_dir: Path) -> tuple[int, bool]:
    """(leading rounds whose records equal a fault-free ``hiso run``'s, whether all do and the
    final models are equal)."""
    from hiso.runners.rundir import run_to_dir
    if not (sim_dir / "model.pt").exists():
        run_to_dir(cfg, sim_dir)
    key = lambda r: (r.participants, r.attempt, r.seeds.tobytes(), r.scalars.tobytes())  # noqa: E731
    a, b = read_history(out / "history.bin")[2], read_history(sim_dir / "history.bin")[2]
    n = 0
    while n < min(len(a), len(b)) and key(a[n]) == key(b[n]):
        n += 1
    x, y = (torch.load(d / "model.pt", weights_only=False)["model"] for d in (out, sim_dir))
    return n, n == len(a) == len(b) and all(torch.equal(x[k], y[k]) for k in x)


def check_replicas(state_dir: Path, cfg: RunConfig, out: Path) -> list[int]:
    """Every partition's replica on the nodes' disk replays the log's rest to the server's final
    model and H, bit for bit; returns the round each replica held. (The replay runs on a copy:
    the replica is a memory map, and replaying on it would write the file under its round.)"""
    from hiso.core import ModelState
    from hiso.flower.app import open_replica
    from hiso.tasks.registry import build_task
    task = build_task(cfg)
    lineage = (out / "flower-lineage").read_text().strip()
    recs = read_history(out / "history.bin")[2]
    final = torch.load(out / "model.pt", weights_only=False)
    held = []
    for pid in range(cfg.clients):
        _, rep = open_replica(cfg, lineage, pid, str(state_dir), LocalFederation.config_text(cfg))
        assert rep.reset_reason is None, (pid, rep.reset_reason)
        held.append(rep.state.round)
        state = ModelState(task.build_model(), cfg.zo(), round=rep.state.round, run_seed=cfg.seed)
        with torch.no_grad():
            for a, b in zip(state.params + (state.h or []), rep.state.params + (rep.state.h or [])):
                a.copy_(b)
        rep.close()
        state.replay(recs[state.round:])
        assert all(torch.equal(p, final["model"][n]) for n, p in state.named), f"partition {pid}: model"
        assert _same_h(state, final), f"partition {pid}: H"
    return held


def figures(out: Path, logs: Path, proxies=(), t0: float | None = None) -> dict:
    """What a run under faults cost: rounds that lost an answer, re-plans, the SuperNodes'
    reconnections (Flower's retry log lines), the proxies' counts, protocol bytes, wall time."""
    fl = json.loads((out / "flower.json").read_text())["flower"]
    attempts = [*fl.get("earlier_attempts", []), fl]
    timings = [t for a in attempts for t in a.get("timings", [])]
    retries = tries = 0
    for f in logs.glob("supernode*.log"):
        for m in re.finditer(r"Connection successful after [\d.]+ seconds and (\d+) tries", f.read_text(errors="replace")):
            retries += 1
            tries += int(m.group(1)) - 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fig = {"rounds": len(rows) - 1, "rounds_lost_an_answer": sum(t["participants"] != t["sampled"] for t in timings),
           "answers_lost": sum(len(set(t["sampled"]) - set(t["participants"])) for t in timings),
           "replanned": sum(a.get("rounds_replanned", 0) for a in attempts),
           "queries_resent": sum(a.get("queries_resent", 0) for a in attempts),
           "serverapp_attempts": len(attempts), "node_reconnects": retries, "node_failed_tries": tries,
           "protocol_bytes": int(sum(r.get("bytes_up", 0) + r.get("bytes_down", 0) for r in rows)),
           "max_round_s": max((t["send_and_receive_s"] for t in timings), default=0.0)}
    if proxies:
        for k in ("connections", "refused", "resets", "stalls", "bytes_up", "bytes_down"):
            fig["proxy_" + k] = sum(p.stats[k] for p in proxies)
    if t0 is not None:
        fig["wall_s"] = round(time.monotonic() - t0, 1)
    return fig


# ------------------------------------------------------------- the scenarios


def _node_log_count(log: Path, *needles: str) -> int:
    """How many times a SuperNode's log says any of ``needles``."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(text.count(n) for n in needles)


_BACK = ("Connection successful after", "Receiving:")  # a reconnection after failed tries, a message in
_SENT = ("Sent successfully", "Failed to send message")  # an answer sent, or its upload given up


def _nodes_online(fed) -> int:
    """Nodes the SuperLink counts online (a heartbeat within its patience)."""
    return sum(n.get("status") == "online" for n in fed._flwr("supernode", "ls", "local", "--format", "json")["nodes"])


def _wait_until(done, what: str, within_s: float = 300.0, every_s: float = 0.5) -> None:
    """Until ``done()``, counted at the speed the machine offers (hiso.patience)."""
    clock = Patience(within_s)
    while not done():
        if clock.spent():
            raise TimeoutError(f"{what} within {within_s} s")
        time.sleep(every_s)


def cut_off_one_node(cfg: RunConfig, work: Path, *, round_timeout: float, cut_s: float, after: int = 1,
                     how: str = "blackhole", worker: bool = False, **faults) -> dict:
    """Scenario 1 (and 2, with ``faults`` on every link): node ``nodes-1`` cut off for ``cut_s``
    seconds once ``after`` rounds are logged, then back. ``how``: the proxy's ``blackhole`` or
    ``refuse``, or ``link``: every node in its own network namespace and the last one's veth
    pair set down. Returns the figures and the checks.

    The cut lands on a round boundary: the run directory's HOLD file (hiso.flower.transport.hold)
    keeps the ServerApp from sending round ``after``'s first message until the link is down, and
    the link comes back only once that round is logged (at least ``cut_s`` later), so the round
    is planned, sent and closed while the node is unreachable, however slow the machine; the
    next round waits (HOLD again) until the node polls again and the SuperLink counts it online,
    and the one after until the node answered what that round sent it (a query or its train
    message), so the node is known and waited for by then."""
    out, t0 = work / "flower", time.monotonic()
    with ExitStack() as stack:
        netns = stack.enter_context(veth_namespaces(cfg.clients)) if how == "link" else None
        fed, proxies = stack.enter_context(proxied_federation(work / "fed", cfg.clients, worker, netns, **faults))
        if cut_s > 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "HOLD").write_text(f"{after}\n")
        # the join waits long: on a loaded machine the nodes' start (and 3 % of chunks reset) can
        # outlast the default minute, and a ServerApp that gave up would look like a stall here
        run_id = fed.submit(cfg, out, round_timeout=round_timeout, wait_nodes_s=600)
        if cut_s > 0:
            try:
                wait_rounds(out, after)
            except TimeoutError as e:  # say what the ServerApp said
                raise TimeoutError(f"{e}\nServerApp log:\n{fed.logs_of(run_id)[-4000:]}") from None
            if netns:
                _ip("link", "set", netns[-1][1], "down")
            else:
                proxies[-1].cut(how)
            (out / "HOLD").write_text(f"{after + 1}\n")  # round `after` goes on; the one after waits
            time.sleep(cut_s)
            wait_rounds(out, after + 1)  # the link comes back once a round closed without the node
            node_log = fed.logs / f"supernode{cfg.clients - 1}.log"
            seen = _node_log_count(node_log, *_BACK)  # (nothing gets through while the link is down)
            if netns:
                _ip("link", "set", netns[-1][1], "up")
            else:
                proxies[-1].heal()
            # the next round goes once the node polls again (its channel backs off after a long cut)
            # and the SuperLink counts it online (a heartbeat: the ServerApp sees only online nodes)
            _wait_until(lambda: _node_log_count(node_log, *_BACK) > seen, "the cut-off node did not reconnect")
            _wait_until(lambda: _nodes_online(fed) == cfg.clients, "the cut-off node was not online again", every_s=2)
            sent = _node_log_count(node_log, *_SENT)
            (out / "HOLD").write_text(f"{after + 2}\n")
            # and the one after once the node answered what that round sent it (its train message, or
            # the query that learns it again if the ServerApp forgot it while it was offline)
            _wait_until(lambda: _node_log_count(node_log, *_SENT) > sent, "the cut-off node answered nothing")
            (out / "HOLD").unlink()
        try:
            fed.wait(run_id, timeout=300)
        finally:  # the ServerApp's log lives in the SuperLink: keep it
            (work / "serverapp.log").write_text(fed.logs_of(run_id))
        fig = figures(out, fed.logs, proxies, t0)
        fig["replicas_held"] = check_replicas(fed.state_dir, cfg, out)
    fig["rounds_audited"] = audit_log(cfg, out)
    fig["simulator_prefix"], fig["equals_simulator"] = simulator_prefix(cfg, out, work / "sim")
    return fig


def _cli(args: list[str], **kw) -> subprocess.Popen:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "hiso.cli", "flower", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _communicate(p: subprocess.Popen, within_s: float) -> tuple[str, str]:
    """``p.communicate()``, failing after ``within_s`` seconds at the speed the machine offers."""
    clock = Patience(within_s)
    while True:
        try:
            return p.communicate(timeout=1.0)  # (retried: no output is lost)
        except subprocess.TimeoutExpired:
            if clock.spent():
                raise TimeoutError(f"{p.args[:4]}: not done within {within_s} s") from None


def _stop(p: subprocess.Popen) -> None:
    """``p`` and everything it started (its SuperLink, SuperNodes), if a wait ran out or failed."""
    from hiso import procs
    if p.poll() is None:
        procs.stop_tree(p.pid)
        procs.stop_processes([p.pid])
        p.wait(timeout=10)


def superlink_killed(cfg: RunConfig, work: Path, *, round_timeout: float, after: int = 1,
                     worker: bool = False) -> dict:
    """Scenario 3: ``hiso flower`` whose SuperLink is SIGKILLed once ``after`` rounds are logged
    fails, naming the resume command; ``hiso flower --resume DIR --workdir W`` finishes the run."""
    from hiso import procs
    out, wd, t0 = work / "flower", work / "fed", time.monotonic()
    args = ["--task", cfg.task, "--algorithm", cfg.algorithm, "--clients", str(cfg.clients),
            "--sampled", str(cfg.sampled), "--rounds", str(cfg.rounds), "--dim", str(cfg.dim),
            "--local-steps", str(cfg.local_steps), "--perturbations", str(cfg.perturbations),
            "--lr", str(cfg.lr), "--seed", str(cfg.seed), "--eval-every", str(cfg.eval_every),
            "--threads", str(cfg.threads), "--round-timeout", str(round_timeout)] + (["--worker"] if worker else [])
    first = _cli([*args, "--out", str(out), "--workdir", str(wd)])
    try:
        wait_rounds(out, after)
        links = [p for p in procs.with_env(f"FLWR_HOME={wd / 'flwr-home'}")
                 if b"flower-superlink" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(links) == 1, links
        os.kill(links[0], signal.SIGKILL)
        killed_at = rounds_done(out)
        _, err = _communicate(first, 300)
    finally:
        _stop(first)
    hint = f"hiso flower --resume {out} --workdir {wd}"
    assert first.returncode != 0 and hint in err, (first.returncode, err[-2000:])
    again = _cli(["--resume", str(out), "--workdir", str(wd), *(["--worker"] if worker else [])])
    try:
        res_out, res_err = _communicate(again, 900)
    finally:
        _stop(again)
    assert again.returncode == 0, res_err[-3000:]
    fig = figures(out, wd / "logs", (), t0)
    fig.update(killed_after_rounds=killed_at, first_exit=first.returncode,
               replicas_held=check_replicas(wd / "replicas", cfg, out), rounds_audited=audit_log(cfg, out))
    fig["simulator_prefix"], fig["equals_simulator"] = simulator_prefix(cfg, out, work / "sim")
    return fig
