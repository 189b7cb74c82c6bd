"""Crash-safe runs: a checksummed, append-only history log and ``hiso run --resume DIR``.

A run killed at any point leaves a prefix of each of its files (config.json is written whole
first). So the cut tests truncate an uninterrupted run's files to the states a kill can leave
(between rounds, between a round's history record and its metrics row, a torn record, a torn
metrics line, before model.pt), resume, and compare with the uninterrupted run bit for bit.
The SIGKILL tests kill real ``hiso run`` processes at several points and do the same.
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import run_cli
from conftest import wait_exit
from hiso.config import load_config
from hiso.core.history import HistoryWriter, RoundRecord, parse_history, read_history
from hiso.core.seeds import round_seeds
from hiso.patience import Patience
from hiso.runners.rundir import run_to_dir

QUAD = ["--task", "quadratic", "--dim", "40", "--clients", "6", "--sampled", "3", "--eval-every", "4"]
WALL = {"wall_s", "client_s"}  # wall-clock keys: the only ones a resumed run may change
WALL_SUMMARY = {"wall_s_train", "wall_s_total", "s_per_round", "peak_rss_mb", "peak_rss_mb_run", "client",
                "checkpoints"}  # (checkpoints: what a run wrote and started from, which a resume changes)
CLIENT_EXACT = ("answers", "forwards_per_round", "backwards_per_round", "resident_bytes")  # "client": the counted part


_cli = run_cli


def _cfg(args):
    """The RunConfig the CLI makes of ``args`` (flags like QUAD)."""
    kv = dict(zip(args[::2], args[1::2]))
    return load_config(None, **{k[2:].replace("-", "_"): v for k, v in kv.items()})


def _rows(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path) -> None:
    """model.pt, history.bin, metrics (all but wall-clock keys) and summary are identical."""
    assert (a / "history.bin").read_bytes() == (b / "history.bin").read_bytes()
    ra, rb = _rows(a), _rows(b)
    assert [{k: v for k, v in r.items() if k not in WALL} for r in ra] == \
        [{k: v for k, v in r.items() if k not in WALL} for r in rb]
    ma, mb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    assert ma["round"] == mb["round"] and ma.keys() == mb.keys()
    for part in ("model", "h"):
        if part in ma:
            assert ma[part].keys() == mb[part].keys()
            assert all(torch.equal(ma[part][k], mb[part][k]) for k in ma[part])
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert {k: v for k, v in sa.items() if k not in WALL_SUMMARY} == \
        {k: v for k, v in sb.items() if k not in WALL_SUMMARY}
    # a client's work is counted the same (its seconds and memory are measurements)
    assert [sa["client"][k] for k in CLIENT_EXACT] == [sb["client"][k] for k in CLIENT_EXACT]


# ------------------------------------------------------------------------- the log itself

def _records(n, tau=2, P=3, m=2):
    rng = np.random.default_rng(0)
    return [RoundRecord(r, round_seeds(0, r, 0, tau, P),
                        rng.standard_normal((tau, P)).astype(np.float32), tuple(range(r % 3, r % 3 + m)))
            for r in range(n)]


def _old_log(recs, tau, P, version):
    """A history file as hiso before protocol v2 wrote it (version 1, or 2 with CRCs)."""
    out = struct.pack("<4sBHH", b"HSOH", version, tau, P)
    for r in recs:
        body = (struct.pack("<IH", r.round, len(r.participants)) + np.asarray(r.participants, "<u4").tobytes()
                + r.seeds.astype("<u8").tobytes() + r.scalars.astype("<f4").tobytes())
        out += body + (struct.pack("<I", zlib.crc32(body)) if version == 2 else b"")
    return out


def _equal_records(a, b):
    return len(a) == len(b) and all(x.round == y.round and x.participants == y.participants
                                    and np.array_equal(x.seeds, y.seeds) and np.array_equal(x.scalars, y.scalars)
                                    for x, y in zip(a, b))


def test_a_torn_last_record_is_dropped_and_damage_before_the_end_is_an_error(tmp_path):
    path = tmp_path / "h.bin"
    recs = _records(5)
    with HistoryWriter(path, 2, 3) as w:
        for r in recs:
            w.write(r)
    data = path.read_bytes()
    log = parse_history(path)
    assert log.version == 3 and log.torn == 0 and _equal_records(log.records, recs)
    last = log.ends[4]
    for cut in range(last, len(data)):  # every length a write of the last record can be cut to
        path.write_bytes(data[:cut])
        assert _equal_records(read_history(path)[2], recs[:4]), cut
    # a full-length last record with a bad checksum (a crash left garbage): torn as well
    bad = bytearray(data)
    bad[-6] ^= 0x40
    path.write_bytes(bytes(bad))
    assert _equal_records(read_history(path)[2], recs[:4])
    # the same damage in a record before the last is an error, not a silent loss
    bad = bytearray(data)
    bad[log.ends[2] - 6] ^= 0x40
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="record 1 .* checksum"):
        read_history(path)


def test_older_logs_are_still_read_but_not_continued(tmp_path):
    rng = np.random.default_rng(1)
    recs = [RoundRecord(r, rng.integers(0, 2**63, (2, 3), dtype=np.uint64), rng.standard_normal((2, 3)), (r % 3,))
            for r in range(3)]  # drawn seeds, as before protocol v2
    path = tmp_path / "h.bin"
    for version in (1, 2):
        path.write_bytes(_old_log(recs, 2, 3, version))
        assert parse_history(path).version == version and _equal_records(read_history(path)[2], recs)
        with pytest.raises(ValueError, match="cannot be continued"):
            HistoryWriter(path, 2, 3, keep=2)
    path.write_bytes(_old_log(recs, 2, 3, 1)[:-3])
    with pytest.raises(ValueError, match="truncated"):  # version 1 has no checksum to tell torn from damaged
        read_history(path)


def test_the_header_names_seed_dtype_and_directions_and_records_carry_no_seeds(tmp_path):
    path = tmp_path / "h.bin"
    recs = [RoundRecord(r, round_seeds(5, r, r % 2, 1, 5), np.full((1, 5), 0.5 + r, np.float32), (0, 2), r % 2)
            for r in range(4)]
    with HistoryWriter(path, 1, 5, seed=5, scalar_dtype="float16", directions="torch-normal") as w:
        for r in recs:
            w.write(r)
        with pytest.raises(ValueError, match="derived seeds"):  # seeds drawn by someone else: not this run's
            w.write(RoundRecord(4, np.ones((1, 5), np.uint64), np.zeros((1, 5)), (0,)))
        with pytest.raises(ValueError, match="float16 values"):  # not what the wire carried
            w.write(RoundRecord(4, round_seeds(5, 4, 0, 1, 5), np.full((1, 5), 0.1, np.float32), (0,)))
    log = parse_history(path)
    assert (log.seed, log.scalar_dtype, log.directions) == (5, "float16", "torch-normal")
    assert _equal_records(log.records, recs) and [r.attempt for r in log.records] == [0, 1, 0, 1]
    # a record is round, attempt, participants, 5 float16 scalars and a CRC: 1 + 1 + 3 + 10 + 4 bytes
    assert np.diff(log.ends).tolist() == [19] * 4
    with pytest.raises(ValueError, match="run seed 5"):  # continuing it as another run
        HistoryWriter(path, 1, 5, keep=2, seed=6, scalar_dtype="float16")


def test_the_writer_continues_after_the_records_it_keeps(tmp_path):
    path = tmp_path / "h.bin"
    recs = _records(4)
    with HistoryWriter(path, 2, 3) as w:
        for r in recs:
            w.write(r)
    path.write_bytes(path.read_bytes()[:-5])  # torn round 3
    with HistoryWriter(path, 2, 3, keep=2) as w:  # rounds 2.. are redone
        w.write(recs[2])
        w.write(recs[3])
    assert _equal_records(read_history(path)[2], recs)
    with pytest.raises(ValueError, match="cannot keep 9"):
        HistoryWriter(path, 2, 3, keep=9)


# ----------------------------------------------------------- resume from every kind of cut

def _cut(full: Path, to: Path, rows: int, records: int, *, torn_history=0, torn_line=False):
    """``to``: what a kill leaves of ``full`` with ``rows`` metrics rows and ``records`` log
    records written, plus optionally a torn record / half a metrics line after them."""
    shutil.copytree(full, to)
    (to / "summary.json").unlink()
    (to / "model.pt").unlink()
    lines = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
    text = "".join(lines[:rows])
    if torn_line:
        text += lines[rows][: len(lines[rows]) // 2]
    (to / "metrics.jsonl").write_text(text)
    log = parse_history(full / "history.bin")
    data = (full / "history.bin").read_bytes()
    end = log.ends[records]
    if torn_history:
        end += min(torn_history, log.ends[records + 1] - end - 1)
    (to / "history.bin").write_bytes(data[:end])


CUTS = {  # name: (metrics rows, history records, options)
    "before-row-0": (0, 0, {}),
    "between-rounds": (4, 3, {}),
    "record-logged-row-not": (4, 4, {}),
    "torn-record-and-line": (6, 5, {"torn_history": 7, "torn_line": True}),
    "metrics-ahead-of-a-torn-log": (8, 5, {"torn_history": 30}),
    "all-rounds-no-model": (11, 10, {}),
}


@pytest.mark.parametrize("algorithm, extra", [("hiso", []), ("decomfl", ["--local-steps", "2"])])
def test_resume_after_every_kind_of_cut_is_bit_identical(tmp_path, capsys, algorithm, extra):
    args = [*QUAD, "--rounds", "10", "--algorithm", algorithm, *extra]
    full = tmp_path / "full"
    run_to_dir(_cfg(args), full)
    for name, (rows, records, opts) in CUTS.items():
        d = tmp_path / name
        _cut(full, d, rows, records, **opts)
        code, out, err = _cli(["run", "--resume", str(d), "--quiet"], capsys)
        assert code == 0, (name, err)
        assert_same_run(full, d)
    # a log damaged before its end is reported, not papered over
    d = tmp_path / "damaged"
    _cut(full, d, 6, 5)
    data = bytearray((d / "history.bin").read_bytes())
    data[parse_history(d / "history.bin").ends[2] - 6] ^= 1
    (d / "history.bin").write_bytes(bytes(data))
    code, _, err = _cli(["run", "--resume", str(d), "--quiet"], capsys)
    assert code == 2 and "checksum" in err and len(err.strip().splitlines()) == 1


# every fault and two attacks (a lie that scales, one that sends NaN), robust aggregation
FAULTY = ["--drop-rate", "0.2", "--late-rate", "0.15", "--duplicate-rate", "0.1", "--corrupt-rate", "0.15",
          "--byzantine", "2", "--attack", "scale,nan", "--attack-scale", "3", "--aggregate", "median"]


def _nan_lie_in_flight(cfg) -> int | None:
    """The first round after which a NaN lie is still in flight (late): resuming there needs
    that answer's content (the next round rejects it as non-finite, not as late)."""
    from hiso.core.messages import MessageError, decode_uplink
    from hiso.runners.faults import unseal
    from hiso.runners.rundir import build_simulation
    from hiso.tasks.registry import build_task
    sim = build_simulation(cfg, build_task(cfg))
    for r in range(1, cfg.rounds):
        sim.step()
        for _, data in sim.pending:
            try:
                decode_uplink(unseal(data), sim.server.wire)
            except MessageError:
                return r
    return None


def _faulty_cuts(full: Path, cfg) -> dict[str, int]:
    """Rounds after which to cut ``full``: right after a round whose late answers were still in
    flight (the next row rejects them as wrong_round), one whose late NaN lie was, after a round
    that was planned again, after one with a corrupt answer, and early."""
    rows = _rows(full)
    after = lambda pred: next(r for r in range(1, len(rows) - 1) if pred(r))  # noqa: E731
    return {"late-in-flight": after(lambda r: rows[r + 1]["rejected"].get("wrong_round")),
            "nan-lie-in-flight": _nan_lie_in_flight(cfg),
            "replanned": after(lambda r: rows[r]["replanned"] > 0),
            "corrupt": after(lambda r: rows[r]["rejected"].get("checksum")),
            "early": 1}


@pytest.mark.parametrize("mode", ["fast", "faithful"])
def test_a_run_with_faults_and_attackers_resumes_bit_for_bit(tmp_path, capsys, mode):
    """The fault and attack draws are functions of the run seed and the plan, so a resumed run
    draws them again: model, history, metrics, summary (fault and rejection counts included)
    and rejections.log end as the uninterrupted run's, whichever round it was cut after."""
    args = [*QUAD, "--rounds", "16", "--mode", mode, "--local-steps", "2", *FAULTY]
    full = tmp_path / "full"
    assert _cli(["run", "--out", str(full), *args, "--quiet"], capsys)[0] == 0
    rel = json.loads((full / "summary.json").read_text())["reliability"]
    assert rel["rounds_replanned"] > 0 and rel["late_in_flight_at_end"] >= 0
    assert all(rel["injected"][k] > 0 for k in ("drop", "late", "duplicate", "corrupt", "attacked"))
    for name, r in _faulty_cuts(full, _cfg(args)).items():
        d = tmp_path / name
        _cut(full, d, r + 1, r)
        code, _, err = _cli(["run", "--resume", str(d), "--quiet"], capsys)
        assert code == 0, (name, err)
        assert_same_run(full, d)
        assert (d / "rejections.log").read_bytes() == (full / "rejections.log").read_bytes(), name


@pytest.mark.parametrize("extra", [["--dp-mode", "central"], ["--dp-mode", "local", "--drop-rate", "0.2"]],
                         ids=["central", "local-faults"])
def test_a_dp_run_resumes_bit_for_bit_bytes_and_epsilon_included(tmp_path, capsys, extra):
    """Under DP no answer carries a loss, so the bytes a resumed run counts for the logged rounds
    are those of answers without one, as the run sent them; its ledger counts the logged
    participants again: metrics (bytes, dp_epsilon, dp_participations_max) and summary (the
    worst client's epsilon) end as the uninterrupted run's."""
    pytest.importorskip("dp_accounting")
    args = [*QUAD, "--rounds", "8", "--dp-clip", "5", "--dp-noise-multiplier", "1", "--dp-delta", "1e-5", *extra]
    full = tmp_path / "full"
    assert _cli(["run", "--out", str(full), *args, "--quiet"], capsys)[0] == 0
    assert json.loads((full / "summary.json").read_text())["privacy"]["participations_max"] > 1
    for r in (2, 5):
        d = tmp_path / f"cut{r}"
        _cut(full, d, r + 1, r)
        code, _, err = _cli(["run", "--resume", str(d), "--quiet"], capsys)
        assert code == 0, err
        assert_same_run(full, d)


def test_resume_in_faithful_mode_rebuilds_the_clients(tmp_path, capsys):
    """Faithful clients are real replicas: each is rebuilt at the round it last took part in,
    so downlinks (and bytes) after the resume are the uninterrupted run's."""
    args = [*QUAD, "--rounds", "10", "--mode", "faithful", "--local-steps", "2", "--h-source", "every"]
    full = tmp_path / "full"
    run_to_dir(_cfg(args), full)
    d = tmp_path / "cut"
    _cut(full, d, 6, 5)
    assert _cli(["run", "--resume", str(d), "--quiet"], capsys)[0] == 0
    assert_same_run(full, d)


def test_a_diverged_run_cut_before_its_summary_resumes_to_the_same_end(tmp_path, capsys):
    """Killed after its diverging round (row written) or just before it: resumed, it stops at
    the same round with the same model and exit 1."""
    args = [*QUAD, "--dim", "20", "--algorithm", "decomfl", "--lr", "2.2", "--rounds", "300"]
    full = tmp_path / "full"
    r = run_to_dir(_cfg(args), full)["diverged"]["round"]
    assert r < 300
    for rows, records in [(r + 1, r), (r, r - 1)]:
        d = tmp_path / f"cut{rows}"
        _cut(full, d, rows, records)
        code, _, err = _cli(["run", "--resume", str(d), "--quiet"], capsys)
        assert code == 1 and "diverged" in err
        assert_same_run(full, d)


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(["run", "--out", str(out), *QUAD, "--rounds", "5", "--quiet"], capsys)[0] == 0
    # a finished run: said so, exit 0, nothing rewritten
    before = (out / "summary.json").read_bytes()
    code, stdout, _ = _cli(["run", "--resume", str(out), "--quiet"], capsys)
    assert code == 0 and "finished" in stdout and (out / "summary.json").read_bytes() == before
    # options that agree with config.json are fine, one that changes it is refused in one line
    (out / "summary.json").unlink()
    code, _, err = _cli(["run", "--resume", str(out), "--dim", "40", "--lr", "0.5", "--quiet"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "lr" in err and "config.json" in err
    conf = tmp_path / "c.toml"
    conf.write_text("rounds = 3\n")  # (more rounds continue it: tests/test_extend.py)
    code, _, err = _cli(["run", "--resume", str(out), "--config", str(conf), "--quiet"], capsys)
    assert code == 2 and "rounds" in err
    assert _cli(["run", "--resume", str(out), "--dim", "40", "--quiet"], capsys)[0] == 0
    for args, needle in [(["--resume", str(out), "--force"], "choose one"),
                         (["--resume", str(out), "--out", str(out)], "--out DIR"),
                         ([], "--out DIR"),
                         (["--resume", str(tmp_path / "nothing")], "config.json")]:
        code, _, err = _cli(["run", *args, "--quiet"], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (args, err)
    # full-model baselines keep no log: refused, and the directory is left as it was
    fa = tmp_path / "fedavg"
    assert _cli(["run", "--out", str(fa), *QUAD, "--rounds", "3", "--algorithm", "fedavg", "--quiet"], capsys)[0] == 0
    (fa / "summary.json").unlink()
    rows = (fa / "metrics.jsonl").read_bytes()
    code, _, err = _cli(["run", "--resume", str(fa), "--quiet"], capsys)
    assert code == 2 and "fedavg runs cannot be resumed" in err
    assert (fa / "metrics.jsonl").read_bytes() == rows


def test_out_with_resume_continues_the_same_run_starts_a_new_one_refuses_another(tmp_path, capsys):
    """`hiso run ARGS --out DIR --resume`: one command to run or continue, whatever DIR holds."""
    args = [*QUAD, "--rounds", "10"]
    full = tmp_path / "full"
    assert _cli(["run", "--out", str(full), *args, "--quiet"], capsys)[0] == 0
    # absent, then present but empty, then killed before config.json (a stray partial file): it starts
    for name, prepare in [("absent", None), ("empty", "mkdir"), ("no-config", "stray")]:
        d = tmp_path / name
        if prepare:
            d.mkdir()
        if prepare == "stray":
            (d / "metrics.jsonl").write_text('{"round": 0, "trai')
        code, _, err = _cli(["run", *args, "--out", str(d), "--resume", "--quiet"], capsys)
        assert code == 0, err
        assert_same_run(full, d)
    # a run cut mid-way: continued, and equal to the uninterrupted one
    cut = tmp_path / "cut"
    _cut(full, cut, 5, 4)
    code, _, err = _cli(["run", *args, "--out", str(cut), "--resume", "--quiet"], capsys)
    assert code == 0, err
    assert_same_run(full, cut)
    kept = (full / "metrics.jsonl").read_text().splitlines(keepends=True)[:5]
    assert (cut / "metrics.jsonl").read_text().startswith("".join(kept))  # wall_s too: continued, not redone
    # a finished run: nothing to do, nothing rewritten
    before = (cut / "summary.json").read_bytes()
    code, stdout, _ = _cli(["run", *args, "--out", str(cut), "--resume", "--quiet"], capsys)
    assert code == 0 and "finished" in stdout and (cut / "summary.json").read_bytes() == before
    # another run in DIR: one line, exit 2, nothing written
    (cut / "summary.json").unlink()
    files = {f.name: f.read_bytes() for f in cut.iterdir()}
    code, _, err = _cli(["run", *args, "--lr", "0.5", "--out", str(cut), "--resume", "--quiet"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "another run" in err and "lr" in err
    assert {f.name: f.read_bytes() for f in cut.iterdir()} == files
    for bad, needle in [(["--resume"], "--out DIR"), (["--out", str(cut), "--resume", "--force"], "choose one")]:
        code, _, err = _cli(["run", *args, *bad, "--quiet"], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (bad, err)


# ------------------------------------------------------------------- real SIGKILLs

def _spawn(args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "hiso.cli", "run", "--quiet", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _rows_written(d: Path) -> int:
    try:
        return (d / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _kill_after(proc, d: Path, rows: int, limit: float = 120.0) -> None:
    """SIGKILL ``proc`` once ``d`` holds ``rows`` metrics rows (a wait of ``limit`` seconds at the
    speed the machine offers, hiso.patience)."""
    clock = Patience(limit)
    while _rows_written(d) < rows:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {rows} rows: "
                                 f"{proc.stderr.read().decode()[-500:]}")
        if clock.spent():
            raise AssertionError(f"no {rows} rows after {limit} s")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    wait_exit(proc, 30)


@pytest.mark.parametrize("extra, kills", [
    ([], (3, 9, 16)),  # HiSo, tau = 1: killed three times, a torn record faked after the second
    (["--local-steps", "2", "--h-source", "every", "--mode", "faithful"], (7,)),
    pytest.param(["--local-steps", "2", *FAULTY], (4, 11, 17), marks=pytest.mark.slow),  # faults, attackers
])
def test_a_run_killed_with_sigkill_and_resumed_is_the_uninterrupted_run(tmp_path, extra, kills):
    args = [*QUAD, "--rounds", "24", "--dim", "2000", *extra]
    ref = tmp_path / "ref"
    run_to_dir(_cfg(args), ref)
    d = tmp_path / "killed"
    procs = []
    try:
        p = _spawn(["--out", str(d), *args])
        procs.append(p)
        for i, rows in enumerate(kills):
            _kill_after(p, d, rows)
            assert not (d / "summary.json").exists()
            if i == len(kills) - 1 or i == 1:  # a write torn by the kill: the last record cut short
                h = d / "history.bin"
                log = parse_history(h)
                if len(log.records):
                    os.truncate(h, log.ends[-1] - 3)
            p = _spawn(["--resume", str(d)])
            procs.append(p)
        assert wait_exit(p, 300) == 0, p.stderr.read().decode()[-1000:]
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    assert_same_run(ref, d)


def test_a_run_logged_before_protocol_v2_still_rebuilds_but_is_not_resumed(tmp_path, capsys):
    """history.bin version 2 (drawn seeds stored in each record): `hiso rebuild` replays it bit
    for bit; `hiso run --resume` refuses it in one line and changes nothing."""
    d = tmp_path / "run"
    run_to_dir(_cfg([*QUAD, "--rounds", "6"]), d)
    log = parse_history(d / "history.bin")
    (d / "history.bin").write_bytes(_old_log(log.records, log.tau, log.P, 2))
    code, _, err = _cli(["rebuild", str(d), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = torch.load(tmp_path / "rb.pt"), torch.load(d / "model.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    before = (d / "history.bin").read_bytes()
    (d / "summary.json").unlink()
    code, _, err = _cli(["run", "--resume", str(d), "--quiet"], capsys)
    assert code == 2 and "before protocol v2" in err and len(err.strip().splitlines()) == 1
    assert (d / "history.bin").read_bytes() == before


def test_a_run_made_before_the_directions_option_rebuilds_with_torch_normal(tmp_path, capsys):
    """A config.json without `directions` was written when torch-normal was the only family (its
    history.bin of version 1 or 2 does not name a family): rebuild and eval replay it with that
    family, not today's default, and get the run's model."""
    d = tmp_path / "run"
    run_to_dir(_cfg([*QUAD, "--rounds", "6", "--directions", "torch-normal"]), d)
    log = parse_history(d / "history.bin")
    (d / "history.bin").write_bytes(_old_log(log.records, log.tau, log.P, 2))
    raw = json.loads((d / "config.json").read_text())
    del raw["directions"]
    (d / "config.json").write_text(json.dumps(raw))
    code, _, err = _cli(["rebuild", str(d), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    a, b = torch.load(tmp_path / "rb.pt"), torch.load(d / "model.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    code, _, err = _cli(["eval", str(d), "--round", "4"], capsys)
    row4 = json.loads((d / "metrics.jsonl").read_text().splitlines()[4])
    assert code == 0 and json.loads((d / "eval.json").read_text())["metrics"]["gap"] == row4["gap"], err


def test_resume_replays_a_log_in_one_place():
    """Every driver resumes through hiso.core.round.replay_log: no other code plans or closes a
    logged round (a LoggedRounds' own plan_logged / close_logged may hand it to its server)."""
    import ast
    from pathlib import Path

    import hiso

    src = Path(hiso.__file__).parent
    callers = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("plan_logged", "close_logged") and fn.name != node.func.attr):
                    callers.append(f"{path.relative_to(src)}:{fn.name}")
    assert sorted(set(callers)) == ["core/round.py:replay_log"]
