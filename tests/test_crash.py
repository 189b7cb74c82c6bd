"""A run directory killed at any write, or stopped by a full disk, resumes bit for bit.

Each trial kills a tiny quadratic run (checkpoints every 2 rounds) at a random write event
(tests/crash_harness.py: what SIGKILL leaves, a torn last write included), checks that every file
written whole is absent or whole, resumes the copy with ``hiso run --out DIR --resume`` (killing
it again in some trials) and compares history.bin and model.pt with an uninterrupted run's. Half
the trials kill a finished 4-round run while it is being extended to 6 rounds.
HISO_CRASH_TRIALS sets the number of trials (CI: 200; bench/crash_trials.py runs more).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import time

import pytest
import torch

from crash_harness import Crash
from hiso.cli import main

ARGS = ["run", "--task", "quadratic", "--dim", "16", "--directions", "torch-normal", "--seed", "3", "--checkpoint-every", "2",
        "--quiet"]
WHOLE = ("config.json", "summary.json", "model.pt", "checkpoint.pt")  # written whole: never torn


def hiso(*args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([*ARGS, *args])
    return rc, err.getvalue()


@contextlib.contextmanager
def dies(crash):
    """Swallow what the kill raised (Killed, or what a library's cleanup turned it into), and only that."""
    try:
        yield
    except BaseException:
        if not crash.dead:
            raise


def whole_or_absent(d) -> str | None:
    """Why a file of ``d`` that is written whole is torn (None: none is)."""
    for name in WHOLE:
        p = d / name
        if not p.exists():
            continue
        try:
            json.loads(p.read_text()) if name.endswith(".json") else torch.load(p, weights_only=True)
        except Exception as e:
            return f"{name} is torn ({type(e).__name__})"
    return None


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y


def same_model(a, b) -> bool:
    return _equal(torch.load(a, weights_only=True), torch.load(b, weights_only=True))


def trials(tmp, n: int, seed: int = 0) -> dict:
    """``n`` kill-and-resume trials in ``tmp``; the counts of each outcome (raises on a failure)."""
    ref = tmp / "ref"
    assert hiso("--rounds", "6", "--out", str(ref))[0] == 0
    with Crash(tmp / "count", None) as c:
        hiso("--rounds", "6", "--out", str(tmp / "count"))
    fresh_events = c.events
    assert hiso("--rounds", "4", "--out", str(tmp / "base4"))[0] == 0
    with Crash(tmp / "count4", None) as c:
        shutil.copytree(tmp / "base4", tmp / "count4")
        hiso("--rounds", "6", "--out", str(tmp / "count4"), "--resume")
    extend_events = c.events
    rng = random.Random(seed)
    counts = {"trials": 0, "resumed": 0, "killed_twice": 0, "refused": 0, "fresh_events": fresh_events,
              "extend_events": extend_events}
    for t in range(n):
        run, snap = tmp / f"t{t}", tmp / f"t{t}.snap"
        extend = t % 2 == 1
        if extend:
            shutil.copytree(tmp / "base4", run)
        at = rng.randrange(extend_events if extend else fresh_events)
        with Crash(run, at, snap, seed=rng.randrange(2**32)) as c, dies(c):
            hiso("--rounds", "6", "--out", str(run), *(["--resume"] if extend else []))
        assert c.dead, f"trial {t}: event {at} never came"
        shutil.rmtree(run)
        why = whole_or_absent(snap)
        assert why is None, f"trial {t} (killed at event {at}{', extending' if extend else ''}): {why}"
        if rng.random() < 0.25:  # killed again while resuming
            again = tmp / f"t{t}.snap2"
            with Crash(snap, rng.randrange(fresh_events), again, seed=rng.randrange(2**32)) as c2, dies(c2):
                hiso("--rounds", "6", "--out", str(snap), "--resume")
            if c2.dead:
                shutil.rmtree(snap)
                snap = again
                counts["killed_twice"] += 1
                assert whole_or_absent(snap) is None, f"trial {t}, second kill: {whole_or_absent(snap)}"
        rc, err = hiso("--rounds", "6", "--out", str(snap), "--resume")
        counts["trials"] += 1
        if rc == 2 and len(err.strip().splitlines()) == 1:
            counts["refused"] += 1
            counts.setdefault("why", []).append(f"trial {t} (event {at}): {err.strip()}")
        else:
            assert rc == 0, f"trial {t} (event {at}): exit {rc}: {err}"
            assert (snap / "history.bin").read_bytes() == (ref / "history.bin").read_bytes(), f"trial {t}: history"
            assert same_model(snap / "model.pt", ref / "model.pt"), f"trial {t}: model.pt"
            rows = [json.loads(line)["round"] for line in (snap / "metrics.jsonl").read_text().splitlines()]
            assert rows == list(range(7)), f"trial {t}: metrics.jsonl holds rounds {rows}"
            counts["resumed"] += 1
        shutil.rmtree(snap)
    return counts


def test_killed_anywhere_resumes_bit_for_bit(tmp_path, monkeypatch):
    # a killed process leaves what the OS holds, fsynced or not (fsync is for a power loss, which
    # this does not model): skipped, it was a third of the test's time on a busy disk
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    n = int(os.environ.get("HISO_CRASH_TRIALS", "200"))
    t0 = time.perf_counter()
    counts = trials(tmp_path, n)
    print(f"\ncrash trials: {counts} in {time.perf_counter() - t0:.1f} s")
    assert counts["trials"] == n and counts["refused"] == 0, counts.get("why")  # every state a kill leaves resumes


def test_a_file_size_limit_is_named_in_one_line_and_loses_nothing(tmp_path):
    """A real limit (RLIMIT_FSIZE: the kernel's EFBIG, as a full disk's ENOSPC), in this process
    for the run's length only: files cannot grow past 4,000 bytes, so metrics.jsonl reaches it."""
    import resource
    import signal

    args = ["--rounds", "20"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert hiso(*args, "--out", str(ref))[0] == 0
    old, sig = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4000, old[1]))  # (the soft limit only: restored below)
    try:
        rc, err = hiso(*args, "--out", str(run))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, sig)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "File too large" in lines[0] and "--resume" in lines[0], err
    print(f"\n{lines[0]}")
    assert whole_or_absent(run) is None and not (run / "summary.json").exists()
    rc, err = hiso(*args, "--out", str(run), "--resume")
    assert rc == 0, err
    assert (run / "history.bin").read_bytes() == (ref / "history.bin").read_bytes()
    assert same_model(run / "model.pt", ref / "model.pt")


@pytest.mark.parametrize("at", [0, 3, 9, 14, 20, 26])
def test_full_disk_is_named_in_one_line_and_loses_nothing(tmp_path, at):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert hiso("--rounds", "6", "--out", str(ref))[0] == 0
    with Crash(run, at, full=True, seed=at) as c:
        rc, err = hiso("--rounds", "6", "--out", str(run))
    if not c.dead:
        pytest.skip(f"the run has fewer than {at + 1} write events")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "No space left on device" in lines[0], err
    assert whole_or_absent(run) is None
    rc, err = hiso("--rounds", "6", "--out", str(run), "--resume")
    assert rc == 0, err
    assert (run / "history.bin").read_bytes() == (ref / "history.bin").read_bytes()
    assert same_model(run / "model.pt", ref / "model.pt")
