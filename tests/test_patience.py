"""hiso.patience: a wait's bound counts seconds at the speed a loaded machine offers."""

import pytest

from hiso import patience
from hiso.patience import Patience


@pytest.fixture
def machine(monkeypatch):
    """A fake clock and load average on a 2-core machine: ``m["t"]`` wall seconds, ``m["load"]``."""
    m = {"t": 0.0, "load": 0.5}
    monkeypatch.setattr(patience.time, "monotonic", lambda: m["t"])
    monkeypatch.setattr(patience.os, "getloadavg", lambda: (m["load"], 0.0, 0.0))
    monkeypatch.setattr(patience, "cores", lambda: 2)
    return m


def test_an_idle_machine_keeps_the_bound(machine):
    clock = Patience(10)
    machine["t"] = 9.9
    assert not clock.spent()
    machine["t"] = 10.1
    assert clock.spent()


def test_a_loaded_machine_lengthens_it_in_proportion(machine):
    """Load 8 on 2 cores: a process gets a quarter of a core, so 10 s last 40 s of wall time."""
    clock = Patience(10)
    machine["load"] = 8.0
    machine["t"] = 39.0
    assert not clock.spent() and clock.used == pytest.approx(9.75)
    machine["t"] = 41.0
    assert clock.spent()


def test_progress_restarts_the_count(machine):
    clock = Patience(10)
    machine["t"] = 9.0
    assert not clock.spent()
    clock.restart()
    machine["t"] = 18.0
    assert not clock.spent() and clock.used == pytest.approx(9.0)
