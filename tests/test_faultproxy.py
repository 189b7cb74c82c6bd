"""The fault proxy (hiso.flower.faultproxy) against an echo server: each fault measured."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hiso.flower.faultproxy import FaultProxy


@pytest.fixture
def echo():
    srv = socket.create_server(("127.0.0.1", 0))

    def serve(c):
        with c:
            try:
                while data := c.recv(65536):
                    c.sendall(data)
            except OSError:
                pass

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def _conn(proxy: FaultProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        data = s.recv(n - len(out))
        if not data:
            raise ConnectionError("closed")
        out += data
    return out


def _round_trip(s: socket.socket, data: bytes = b"x") -> float:
    t = time.monotonic()
    s.sendall(data)
    assert _recv(s, len(data)) == data
    return time.monotonic() - t


def test_latency_and_jitter_delay_each_way_and_keep_order(echo):
    with FaultProxy(echo) as plain, FaultProxy(echo, latency_s=0.1, jitter_s=0.05, seed=1) as slow:
        with _conn(plain) as a, _conn(slow) as b:
            _round_trip(a)  # through (not timed: a loaded machine may take any time)
            rtts = [_round_trip(b) for _ in range(4)]
            assert all(t >= 0.2 for t in rtts), rtts  # at least 2 x latency (a loaded machine adds, never takes)
            for i in range(30):  # jittered chunks never overtake one another
                b.sendall(bytes([i]))
                time.sleep(0.002)
            assert _recv(b, 30) == bytes(range(30))
        assert slow.stats["bytes_up"] == slow.stats["bytes_down"] == 4 + 30


def test_bandwidth_cap_is_measured(echo):
    n = 200_000
    with FaultProxy(echo, bandwidth=1_000_000) as p, _conn(p) as s:
        t = _round_trip(s, b"y" * n)
    assert t >= 0.2 * 0.95  # 200 kB at 1 MB/s each way, the two directions overlapping
    assert p.stats["bytes_up"] == p.stats["bytes_down"] == n


def test_stalls_hold_a_connection(echo):
    with FaultProxy(echo, stall_p=1.0, stall_s=0.3) as p, _conn(p) as s:
        assert _round_trip(s) >= 0.6
    assert p.stats["stalls"] == 2


def test_reset_connections_are_seen_as_resets(echo):
    with FaultProxy(echo, reset_p=1.0) as p, _conn(p) as s:
        s.sendall(b"hello")
        with pytest.raises(ConnectionResetError):
            s.recv(10)
    assert p.stats["resets"] == 1 and p.stats["bytes_up"] == 0


def test_a_few_percent_of_resets(echo):
    with FaultProxy(echo, reset_p=0.05, seed=3) as p:
        lost = 0
        for _ in range(40):
            with _conn(p) as s:
                try:
                    _round_trip(s)
                except (ConnectionResetError, ConnectionError):
                    lost += 1
    assert lost == p.stats["resets"] and 0 < lost < 12


def test_blackhole_holds_bytes_until_healed_and_refuse_resets(echo):
    with FaultProxy(echo) as p, _conn(p) as s:
        _round_trip(s)
        p.cut("blackhole")
        s.sendall(b"held")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(4)
        late = _conn(p)  # a new connection during the cut is accepted but goes nowhere
        late.sendall(b"late")
        late.settimeout(0.3)
        with pytest.raises(socket.timeout):
            late.recv(4)
        p.heal()
        s.settimeout(10)
        late.settimeout(10)
        assert _recv(s, 4) == b"held" and _recv(late, 4) == b"late"  # what was held goes on
        p.cut("refuse")
        with pytest.raises((ConnectionResetError, ConnectionError)):
            s.sendall(b"x")
            _recv(s, 1)
        with pytest.raises((ConnectionResetError, ConnectionError)):  # (the reset may come as it connects)
            with _conn(p) as again:
                again.sendall(b"x")
                _recv(again, 1)
        late.close()
        p.heal()
        with _conn(p) as back:
            _round_trip(back)  # through again
    assert p.stats["refused"] == 1


def test_bad_cut_is_refused(echo):
    with FaultProxy(echo) as p, pytest.raises(ValueError, match="blackhole or refuse"):
        p.cut("down")
