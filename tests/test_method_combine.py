"""A method's own ``combine`` is the server's rule, in the simulator and the Flower ServerApp:
each logged record is the method's combine of that round's answers (a method that is not
FeedSign, so that a server calling the default rule for it is caught)."""

import sys
import textwrap

import numpy as np
import pytest

from hiso.config import RunConfig
from hiso.core.history import read_history
from hiso.methods.registry import user_method_class

USER = '''
import numpy as np
from dataclasses import dataclass
from hiso.core.method import Method

CALLS = []  # (answers, aggregate) of each call, in order

@dataclass(frozen=True)
class Largest(Method):
    """The server keeps the answer of largest magnitude per entry, not their mean."""
    def combine(self, g, w, rule, trim):
        g = np.asarray(g, dtype=np.float64)
        out = np.take_along_axis(g, np.abs(g).argmax(axis=0)[None], axis=0)[0]
        CALLS.append((g.copy(), out))
        return out
'''
CFG = dict(task="quadratic", dim=20, clients=3, sampled=3, local_steps=2, perturbations=3, lr=0.02, rounds=4,
           eval_every=2, threads=1, seed=5)


@pytest.fixture
def method(tmp_path):
    path = tmp_path / "largest.py"
    path.write_text(textwrap.dedent(USER))
    spec = f"{path}:Largest"
    calls = sys.modules[user_method_class(spec).__module__].CALLS
    calls.clear()
    return spec, calls


def _check(run_dir, calls, rounds):
    records = read_history(run_dir / "history.bin")[2]
    assert len(records) == rounds and len(calls) == rounds
    for rec, (g, out) in zip(records, calls):
        assert not np.allclose(out, g.mean(axis=0))  # the rule is not the mean here
        assert np.array_equal(rec.scalars, out.astype(np.float32))


def test_the_simulator_logs_the_methods_combine(tmp_path, method):
    from hiso.runners.rundir import run_to_dir
    spec, calls = method
    run_to_dir(RunConfig(**CFG, algorithm=spec), tmp_path / "sim")
    _check(tmp_path / "sim", calls, CFG["rounds"])


def test_the_serverapp_logs_the_methods_combine(tmp_path, method):
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from hiso.flower.app import Settings, serve
    from hiso.flower.loopback import LoopbackGrid, server_task
    spec, calls = method
    cfg = RunConfig(**CFG, algorithm=spec)
    with server_task():
        serve(LoopbackGrid(cfg, tmp_path / "replicas", {100: 0, 101: 1, 102: 2}), cfg,
              Settings(out_dir=str(tmp_path / "f"), round_timeout=0.3, poll_s=0.0, suspect_grace_s=0.0))
    _check(tmp_path / "f", calls, CFG["rounds"])
