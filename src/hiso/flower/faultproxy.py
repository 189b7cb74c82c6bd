"""A TCP forwarder that injects network faults between SuperNodes and a SuperLink (tests, bench).

Latency, jitter, stalls and bandwidth delay the bytes of each direction (a chunk's delivery
time never precedes the previous one's: TCP keeps order); resets abort both ends of a
connection with an RST (``SO_LINGER`` 0) as a chunk crosses, in either direction, so a
request may be lost before the SuperLink sees it or its answer after the SuperLink acted on
it. ``cut("blackhole")`` is a link down: nothing moves and new connections hang until
``heal()``, then the held bytes go on, as TCP's retransmissions would deliver them;
``cut("refuse")`` resets every open connection and every new one (a peer that rejects).
This machine has no netem qdisc, so the proxy is where latency and loss come from, on
loopback or on a veth pair alike. It runs its own asyncio loop in a daemon thread; faults
can be changed while it runs (plain attributes, read per chunk).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

CHUNK = 65536


@dataclass
class FaultProxy:
    """Forward ``listen_host:port`` to ``target_host:target_port`` with the faults below."""

    target_port: int
    port: int = 0  # where it listens (0: a free port, read back after start())
    latency_s: float = 0.0  # one way, each direction
    jitter_s: float = 0.0  # uniform in [0, jitter_s] on top of the latency, per chunk
    reset_p: float = 0.0  # probability that a chunk crossing resets its connection
    stall_p: float = 0.0  # probability that a chunk (and what follows it) is held stall_s more
    stall_s: float = 0.0
    bandwidth: float | None = None  # bytes/s per direction, shared by all connections
    seed: int = 0
    listen_host: str = "127.0.0.1"
    target_host: str = "127.0.0.1"
    mode: str = "up"  # up | blackhole | refuse (cut() and heal() set it)
    stats: dict = field(default_factory=lambda: dict.fromkeys(
        ("connections", "refused", "resets", "stalls", "bytes_up", "bytes_down"), 0))

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._conns: set[tuple] = set()
        self._busy = {True: 0.0, False: 0.0}  # bandwidth: when each direction's link is free
        self._loop: asyncio.AbstractEventLoop | None = None
        self._healed: asyncio.Event | None = None
        self._server = None

    # -- control (from any thread)
    def start(self) -> "FaultProxy":
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True, name=f"faultproxy:{self.target_port}").start()
        ready.wait(10)
        if self._server is None:
            raise OSError(f"fault proxy: could not listen on {self.listen_host}:{self.port}")
        return self

    def cut(self, how: str = "blackhole") -> None:
        """Take the link down: ``blackhole`` holds every byte, ``refuse`` resets every connection."""
        if how not in ("blackhole", "refuse"):
            raise ValueError(f"cut: blackhole or refuse, not {how!r}")
        self.mode = how
        self._call(self._healed.clear)
        if how == "refuse":
            self._call(self._reset_all)

    def heal(self) -> None:
        self.mode = "up"
        self._call(self._healed.set)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._call(self._shutdown)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, fn) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is gone
            pass

    # -- the loop
    def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._healed = asyncio.Event()
        if self.mode == "up":
            self._healed.set()
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, self.listen_host, self.port, reuse_address=True))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError:
            ready.set()
            return
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _shutdown(self) -> None:
        self._server.close()
        self._reset_all()
        self._healed.set()  # what waits for the link ends (its connection is gone)
        self._loop.call_later(0.05, self._loop.stop)

    def _reset_all(self) -> None:
        for conn in list(self._conns):
            self._reset(conn)

    def _reset(self, conn: tuple) -> None:
        self._conns.discard(conn)
        for w in conn:
            _abort(w)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        if self.mode == "refuse":
            self.stats["refused"] += 1
            _abort(writer)
            return
        await self._healed.wait()  # link down: the connection hangs, as an unanswered SYN does
        if self.mode == "refuse":
            self.stats["refused"] += 1
            _abort(writer)
            return
        try:
            ur, uw = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            self.stats["refused"] += 1
            _abort(writer)
            return
        conn = (writer, uw)
        self._conns.add(conn)
        try:
            await asyncio.gather(self._pump(reader, uw, conn, True), self._pump(ur, writer, conn, False))
        finally:
            if conn in self._conns:
                self._conns.discard(conn)
                for w in conn:
                    w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: tuple, up: bool) -> None:
        """Read ``src`` and schedule each chunk; a writer task delivers it when it is due."""
        queue: asyncio.Queue = asyncio.Queue()
        deliver = asyncio.ensure_future(self._deliver(queue, dst, conn, up))
        due = 0.0
        try:
            while conn in self._conns:
                try:
                    data = await src.read(CHUNK)
                except (OSError, asyncio.IncompleteReadError):
                    data = b""
                if not data:
                    break
                if self.reset_p and self._rng.random() < self.reset_p:
                    self.stats["resets"] += 1
                    self._reset(conn)
                    break
                delay = self.latency_s + (self._rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
                if self.stall_p and self._rng.random() < self.stall_p:
                    self.stats["stalls"] += 1
                    delay += self.stall_s
                due = max(due, time.monotonic() + delay)
                queue.put_nowait((due, data))
        finally:
            queue.put_nowait(None)
            await deliver

    async def _deliver(self, queue: asyncio.Queue, dst: asyncio.StreamWriter, conn: tuple, up: bool) -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            await self._healed.wait()  # link down: the bytes wait for it
            if self.bandwidth:
                now = time.monotonic()
                self._busy[up] = max(now, self._busy[up]) + len(data) / self.bandwidth
                await asyncio.sleep(self._busy[up] - now)
            if conn not in self._conns:
                return
            self.stats["bytes_up" if up else "bytes_down"] += len(data)
            try:
                dst.write(data)
                await dst.drain()
            except (OSError, RuntimeError):
                self._reset(conn)
                return
        if conn in self._conns:  # the other side closed: pass the end of stream on
            try:
                dst.write_eof()
            except (OSError, RuntimeError):
                pass


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()
