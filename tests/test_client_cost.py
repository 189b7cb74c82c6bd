"""A client's computation and memory (hiso.runners.client_cost): the forwards and
backpropagations recorded per client-round are the ones the loss function really ran, the
memory probe measures what a known allocation pattern allocates, and hiso compare's table
carries the columns."""

from pathlib import Path

import pytest
import torch

from hiso.config import RunConfig
from hiso.report.table import ArmResult, RunResult, build_table, csv_columns, footer, to_csv, to_markdown
from hiso.runners.client_cost import tensors_bytes, transient_peak
from hiso.runners.rundir import build_simulation, run_to_dir
from hiso.tasks.registry import build_task


class Counting:
    """Wraps a task's loss: counts its calls (forwards) and the backpropagations through them."""

    def __init__(self, loss):
        self.loss, self.forwards, self.backwards = loss, 0, 0

    def __call__(self, model, batch):
        self.forwards += 1
        out = self.loss(model, batch)
        if out.requires_grad:
            def seen(g):
                self.backwards += 1
                return g
            out.register_hook(seen)
        return out


# (algorithm, options, forwards and backwards per client-round worked out from each method's rule)
CASES = [
    ("hiso", dict(perturbations=3, local_steps=2), (2 * (3 + 1), 0)),  # tau (P + 1), forward differences
    ("decomfl", dict(perturbations=2, local_steps=2, difference="central"), (2 * 2 * 2, 0)),  # 2 tau P
    ("feedsign", dict(local_steps=3), (3 * 2, 0)),  # P = 1, central: 2 per step
    ("fedkseed", dict(local_steps=2, seed_pool=8), (2 * 2, 0)),  # one pool direction, central: 2 per step
    ("ferret", dict(local_steps=2, ferret_k=4, ferret_blocks=2), (2, 2)),  # SGD: 1 forward + 1 backward a step
    ("fedavg", dict(local_steps=3), (3, 3)),
    ("fedzo", dict(perturbations=2, local_steps=2), (2 * (2 + 1), 0)),
]


@pytest.mark.parametrize("algorithm,opts,expected", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["fast", "faithful"])
def test_work_per_client_round_is_what_the_loss_ran(algorithm, opts, expected, mode):
    if mode == "faithful" and algorithm in ("fedavg", "fedzo"):
        pytest.skip("the full-model baselines have one mode")
    cfg = RunConfig(task="quadratic", dim=50, clients=5, sampled=2, rounds=3, algorithm=algorithm, mode=mode,
                    seed=1, **opts)
    task = build_task(cfg)
    counter = Counting(task.loss)
    task.loss = counter
    sim = build_simulation(cfg, task)
    for _ in range(cfg.rounds):
        sim.step()
    answers = cfg.rounds * cfg.sampled
    assert sim.cost.answers == answers
    assert (sim.cost.forwards, sim.cost.backwards) == (counter.forwards, counter.backwards)
    assert (sim.cost.forwards, sim.cost.backwards) == (expected[0] * answers, expected[1] * answers)
    assert sim.cost.seconds > 0


def test_transient_peak_measures_what_is_allocated_at_once():
    n = 1 << 20  # 4 MiB of float32

    def one_after_another():
        for _ in range(3):
            t = torch.ones(n)
            del t

    def together():
        a, b = torch.ones(n), torch.ones(n)
        return float(a[0] + b[0])

    keep = torch.ones(n)  # alive before: not counted
    seq, how = transient_peak(one_after_another)
    both, _ = transient_peak(together)
    assert "profiler" in how
    assert 4 * n <= seq < 4 * n + (64 << 10)
    assert 8 * n <= both < 8 * n + (64 << 10)
    del keep


def test_transient_peak_keeps_allocation_events_only(monkeypatch):
    """The profiler records no event per op while it measures (a quantized base's many small ops
    made those events the run's peak), and a profiler after it records ops again."""
    import torch.autograd.profiler as tap
    from torch.profiler import ProfilerActivity, profile

    kept = []
    disable = tap._disable_profiler

    def recording():
        res = disable()
        kept.append({e.name() for e in res.events()})
        return res

    monkeypatch.setattr(tap, "_disable_profiler", recording)

    def many_ops():
        x = torch.ones(1 << 16)
        for _ in range(20):
            x = torch.sin(x) + 1

    peak, _ = transient_peak(many_ops)
    assert peak >= 2 * 4 * (1 << 16)
    assert kept[-1] == {"[memory]"}
    with profile(activities=[ProfilerActivity.CPU]):
        torch.sin(torch.ones(4))
    assert "aten::sin" in kept[-1]


def test_tensors_bytes_counts_a_storage_once():
    x = torch.zeros(100)
    assert tensors_bytes([x, x[:10], x.view(10, 10)]) == 400
    assert tensors_bytes([x, torch.zeros(5, dtype=torch.float64)]) == 440


def test_summary_records_the_client_and_its_memory(tmp_path):
    base = dict(task="quadratic", dim=1000, clients=4, sampled=2, rounds=2, seed=0, eval_every=2)
    hiso = run_to_dir(RunConfig(algorithm="hiso", **base), tmp_path / "h")["client"]
    dec = run_to_dir(RunConfig(algorithm="decomfl", **base), tmp_path / "d")["client"]
    fer = run_to_dir(RunConfig(algorithm="ferret", ferret_k=4, ferret_blocks=2, **base), tmp_path / "f")["client"]
    # the quadratic's model: x and its curvatures, 1,000 float32 each; HiSo adds H (1,000 float32)
    assert dec["resident_bytes"] == 8000 and hiso["resident_bytes"] == 12000
    assert hiso["answers"] == 4 and hiso["forwards_per_round"] == 1 * (5 + 1) and hiso["backwards_per_round"] == 0
    assert fer["forwards_per_round"] == 1 and fer["backwards_per_round"] == 1
    for c in (hiso, dec, fer):
        assert c["transient_peak_bytes"] > 0 and c["peak_bytes"] == c["resident_bytes"] + c["transient_peak_bytes"]
        assert c["s_per_round"] > 0
    # Ferret's answer holds x_r's copy, the gradient and the update (3 d float32) at least
    assert fer["transient_peak_bytes"] >= 3 * 4000


def _run(seed, client):
    rows = [{"round": r, "wall_s": 0.1 * r, "bytes_up": 10 * r, "bytes_down": 10 * r, "eval_acc": 0.1 * r}
            for r in range(3)]
    return RunResult(Path("."), seed, {"clients": 2, "rounds": 2, "eval_every": 1, "task": "mnist", "sampled": 1},
                     rows, {"communication_per_client": {"bytes_up_mean": 1.0, "bytes_down_mean": 1.0},
                            "s_per_round": 0.1, **({"client": client} if client else {})})


def test_table_shows_client_work_seconds_and_memory():
    c0 = {"forwards_per_round": 6.0, "backwards_per_round": 0.0, "s_per_round": 0.002, "peak_bytes": 3_000_000}
    c1 = {**c0, "s_per_round": 0.004, "peak_bytes": 5_000_000}
    ref = ArmResult("hiso", "hiso", 1e-3, [_run(0, c0), _run(1, c1)])
    fer = ArmResult("ferret", "ferret", 1e-3, [_run(0, {"forwards_per_round": 1.0, "backwards_per_round": 1.0,
                                                          "s_per_round": 0.01, "peak_bytes": 7_500})])
    old = ArmResult("old", "decomfl", 1e-3, [_run(0, None)])  # a run from before these columns
    t = build_table([ref, fer, old], "hiso", "eval_acc")
    md = to_markdown(t).splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in md[2:]}
    w, s, m = (header.index(k) for k in ("client fwd + bwd / round", "client s / round", "client peak memory"))
    assert (cells["HiSo"][w], cells["HiSo"][s], cells["HiSo"][m]) == ("6 + 0", "3 ms", "5 MB")  # mean s, max memory
    assert (cells["Ferret"][w], cells["Ferret"][m]) == ("1 + 1", "7.5 KB")
    assert (cells["old"][w], cells["old"][s], cells["old"][m]) == ("—", "—", "—")
    cols = csv_columns("eval_acc")
    lines = [line.split(",") for line in to_csv(t).splitlines()]
    assert lines[0] == cols
    hi = lines[1]
    assert float(hi[cols.index("client_forwards_per_round")]) == 6.0
    assert float(hi[cols.index("client_s_per_round")]) == pytest.approx(0.003)
    assert float(hi[cols.index("client_peak_bytes")]) == 5_000_000
    assert lines[3][cols.index("client_peak_bytes")] == ""
    assert "client fwd + bwd / round" in footer(t)
