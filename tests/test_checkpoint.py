"""``DIR/checkpoint.pt``: a resumed run replays only the rounds after its last checkpoint, and ends
bit for bit as the uninterrupted run; a checkpoint that is not this run's (another configuration,
another log, past the log it keeps, damaged) or that the replay cannot use is named and the log
is replayed from x_0 as before."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli
from hiso.config import ConfigError, load_config
from hiso.core.history import parse_history
from hiso.core.state import ModelState
from hiso.runners.checkpoint import FILE, load_start
from hiso.runners.rundir import run_to_dir
from test_resume import FAULTY, QUAD, _cfg, assert_same_run


def _stop_at(k):
    def progress(row):
        if row["round"] == k:
            raise KeyboardInterrupt
    return progress


def _interrupted(cfg, d: Path, k: int) -> None:
    """What a run of ``cfg`` stopped after round ``k`` leaves in ``d`` (its checkpoint included)."""
    with pytest.raises(KeyboardInterrupt):
        run_to_dir(cfg, d, progress=_stop_at(k))


def _applied_rounds(monkeypatch) -> list[int]:
    """The rounds ModelState.apply is called for from now on (any replica)."""
    seen = []
    real = ModelState.apply

    def apply(self, rec):
        seen.append(rec.round)
        return real(self, rec)
    monkeypatch.setattr(ModelState, "apply", apply)
    return seen


def _summary(d):
    return json.loads((d / "summary.json").read_text())


def _same(full, d):
    """assert_same_run, the checkpoints' own bookkeeping apart (writes differ by design)."""
    sa, sb = _summary(full), _summary(d)
    for s, p in ((sa, full), (sb, d)):
        s.pop("checkpoints", None)
        (p / "summary.json").write_text(json.dumps(s))
    assert_same_run(full, d)


VARIANTS = {
    "hiso": [],
    "decomfl-momentum-stepnorm": ["--algorithm", "decomfl", "--momentum", "0.9", "--step-norm", "std"],
    "hiso-tau2-every": ["--local-steps", "2", "--h-source", "every"],
    "feedsign": ["--algorithm", "feedsign"],
    "ferret": ["--algorithm", "ferret", "--lr", "0.05", "--snapshot-after", "100"],  # (K is 0 at d = 40)
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_from_a_checkpoint_replays_only_the_rounds_after_it(tmp_path, capsys, monkeypatch, variant):
    args = [*QUAD, "--rounds", "14", *VARIANTS[variant]]
    full = tmp_path / "full"
    run_to_dir(_cfg(args), full)
    cut = tmp_path / "cut"
    _interrupted(_cfg([*args, "--checkpoint-every", "3"]), cut, 8)
    saved = torch.load(cut / FILE, weights_only=True)
    assert saved["round"] == 6 and len(parse_history(cut / "history.bin").records) == 8
    seen = _applied_rounds(monkeypatch)
    code, _, err = run_cli(["run", "--resume", str(cut), "--quiet"], capsys)
    assert code == 0, err
    assert seen[:2] == [6, 7] and 5 not in seen  # model and H from round 6: rounds 0-5 are not replayed
    s = _summary(cut)["checkpoints"]
    assert s["resumed_from"] == 6 and s["every"] == "3 rounds"
    assert not (cut / FILE).exists()  # the run ended: model.pt holds its state
    _same(full, cut)


def test_a_checkpoint_written_without_a_state_digest_is_still_used(tmp_path, capsys, monkeypatch):
    """Checkpoints made before they carried their state's SHA-256 resume as they did."""
    args = [*QUAD, "--rounds", "12"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_to_dir(_cfg(args), full)
    _interrupted(_cfg([*args, "--checkpoint-every", "3"]), cut, 8)
    blob = torch.load(cut / FILE, weights_only=True)
    del blob["state_sha256"]
    torch.save(blob, cut / FILE)
    seen = _applied_rounds(monkeypatch)
    code, _, err = run_cli(["run", "--resume", str(cut), "--quiet"], capsys)
    assert code == 0 and err == "", err
    assert seen[0] == 6 and _summary(cut)["checkpoints"]["resumed_from"] == 6
    _same(full, cut)


def test_the_state_digest_changes_with_any_value_key_or_dtype():
    from hiso.runners.checkpoint import state_digest
    state = {"round": 3, "model": {"w": torch.arange(6.0).reshape(2, 3)}, "h": {"value": 0.5}}
    d = state_digest(state)
    assert d == state_digest(torch.load(_saved(state), weights_only=True))  # a file round trip keeps it
    for edit in (lambda s: s["model"]["w"].view(-1)[5].add_(1e-6), lambda s: s.update(round=4),
                 lambda s: s["model"].update(w=s["model"]["w"].double()), lambda s: s["h"].update(value=0.25),
                 lambda s: s["model"].update(v=s["model"].pop("w"))):
        other = {"round": 3, "model": {"w": torch.arange(6.0).reshape(2, 3)}, "h": {"value": 0.5}}
        edit(other)
        assert state_digest(other) != d


def _saved(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_checkpoints_are_written_as_configured_and_cost_is_reported(tmp_path):
    d = tmp_path / "r"
    summary = run_to_dir(_cfg([*QUAD, "--rounds", "10", "--checkpoint-every", "4"]), d)
    assert summary["checkpoints"]["writes"] == 2 and summary["checkpoints"]["every"] == "4 rounds"
    assert summary["checkpoints"]["bytes"] > 0 and summary["checkpoints"]["resumed_from"] is None
    assert not (d / FILE).exists()
    assert run_to_dir(_cfg([*QUAD, "--rounds", "10", "--checkpoint-every", "0"]), tmp_path / "n"
                      )["checkpoints"]["writes"] == 0


def _foreign(tmp_path, args, other_args, k=8, every="3"):
    """A run of ``args`` cut after round ``k`` whose checkpoint.pt is another run's (``other_args``)."""
    cut, other = tmp_path / "cut", tmp_path / "other"
    _interrupted(_cfg([*args, "--checkpoint-every", every]), cut, k)
    _interrupted(_cfg([*other_args, "--checkpoint-every", every]), other, k)
    shutil.copy(other / FILE, cut / FILE)
    return cut


@pytest.mark.parametrize("case, why", [
    ("other-config", "another algorithm configuration"),
    ("other-log", "another history.bin"),
    ("damaged", "cannot be read"),
    ("past-the-log", "past the 5 rounds the log keeps"),
    ("edited-state", "holds another state than the one it was written with"),
])
def test_a_checkpoint_not_of_this_run_is_named_and_the_log_replayed(tmp_path, capsys, monkeypatch, case, why):
    args = [*QUAD, "--rounds", "12"]
    full = tmp_path / "full"
    run_to_dir(_cfg(args), full)
    if case == "other-config":
        cut = _foreign(tmp_path, args, [*QUAD, "--rounds", "12", "--lr", "0.02"])
    elif case == "other-log":
        cut = _foreign(tmp_path, args, [*QUAD, "--rounds", "12", "--sampled", "2"])
    else:
        cut = tmp_path / "cut"
        _interrupted(_cfg([*args, "--checkpoint-every", "3"]), cut, 8)
        if case == "damaged":
            (cut / FILE).write_bytes((cut / FILE).read_bytes()[:-40])
        elif case == "edited-state":  # one weight changed by hand, the file otherwise as written
            blob = torch.load(cut / FILE, weights_only=True)
            w = next(iter(blob["state"]["model"].values()))
            w.view(-1)[0] += 1.0
            torch.save(blob, cut / FILE)
        else:  # the history cut back below the checkpoint's round (a torn tail, say)
            lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)[:6]
            (cut / "metrics.jsonl").write_text("".join(lines))
    seen = _applied_rounds(monkeypatch)
    code, _, err = run_cli(["run", "--resume", str(cut), "--quiet"], capsys)
    assert code == 0, err
    assert why in err and "replaying the log from round 0" in err and len(err.strip().splitlines()) == 1
    assert seen[0] == 0
    assert _summary(cut)["checkpoints"]["resumed_from"] is None
    _same(full, cut)


def test_where_the_replay_needs_earlier_states_the_checkpoint_is_not_used(tmp_path, capsys):
    """Faithful mode (clients rebuilt at the round they last took part in) and a server that
    sends snapshots sooner than the checkpoint's round replay from x_0 and say why."""
    for name, extra, why in [("faithful", ["--mode", "faithful"], "faithful mode"),
                             ("snapshots", ["--snapshot-after", "2"], "snapshot")]:
        args = [*QUAD, "--rounds", "12", *extra]
        full, cut = tmp_path / f"{name}-full", tmp_path / name
        run_to_dir(_cfg(args), full)
        _interrupted(_cfg([*args, "--checkpoint-every", "3"]), cut, 8)
        code, _, err = run_cli(["run", "--resume", str(cut), "--quiet"], capsys)
        assert code == 0 and why in err and "replaying the log from round 0" in err, err
        _same(full, cut)


def test_a_run_with_faults_resumes_from_a_checkpoint_before_its_last_round(tmp_path, capsys):
    """Late answers in flight at the cut are recomputed at the last logged round's state: a
    checkpoint of an earlier round is used, one of that very round is not."""
    args = [*QUAD, "--rounds", "12", "--local-steps", "2", *FAULTY]
    full = tmp_path / "full"
    run_to_dir(_cfg(args), full)
    for k, every, used in [(8, "3", 6), (6, "3", None)]:
        cut = tmp_path / f"cut{k}"
        _interrupted(_cfg([*args, "--checkpoint-every", every]), cut, k)
        code, _, err = run_cli(["run", "--resume", str(cut), "--quiet"], capsys)
        assert code == 0, err
        assert _summary(cut)["checkpoints"]["resumed_from"] == used
        assert (used is None) == ("late answers in flight" in err)
        _same(full, cut)
        assert (cut / "rejections.log").read_bytes() == (full / "rejections.log").read_bytes()


def test_checkpoint_every_is_checked_and_may_change_on_resume(tmp_path, capsys):
    for bad in ("5d", "-3", "soon"):
        code, _, err = run_cli(["run", "--out", str(tmp_path / "x"), "--checkpoint-every", bad, "--quiet"], capsys)
        assert code == 2 and "checkpoint_every" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ConfigError):
        load_config(None, checkpoint_every="1 fortnight")
    args = [*QUAD, "--rounds", "12"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_to_dir(_cfg(args), full)
    _interrupted(_cfg([*args, "--checkpoint-every", "3"]), cut, 7)
    code, _, err = run_cli(["run", "--resume", str(cut), "--checkpoint-every", "2", "--quiet"], capsys)
    assert code == 0, err
    assert _summary(cut)["checkpoints"]["every"] == "2 rounds"  # as asked now; config.json keeps the run's
    assert str(json.loads((cut / "config.json").read_text())["checkpoint_every"]) == "3"
    _same(full, cut)


def test_force_removes_an_old_checkpoint(tmp_path, capsys):
    d = tmp_path / "r"
    _interrupted(_cfg([*QUAD, "--rounds", "12", "--checkpoint-every", "3"]), d, 7)
    assert (d / FILE).exists()
    assert run_cli(["run", "--out", str(d), "--force", *QUAD, "--rounds", "2", "--quiet"], capsys)[0] == 0
    assert not (d / FILE).exists() and load_start(d, _cfg(QUAD), 2) == (None, "")
    assert json.loads((d / "summary.json").read_text())["checkpoints"]["model_pt"]["round"] == 2


def test_a_finished_run_continued_to_more_rounds_starts_from_its_model_pt(tmp_path, capsys, monkeypatch):
    """summary.json ties model.pt to the run as a checkpoint does: ``--rounds N`` over a finished
    run loads it and replays nothing; a model.pt that is not the summary's is named and replayed.
    (8: an evaluation round, as an old horizon that was not one keeps its evaluation row.)"""
    args = [*QUAD, "--rounds", "12", "--momentum", "0.5"]
    full, short = tmp_path / "full", tmp_path / "short"
    run_to_dir(_cfg(args), full)
    run_to_dir(_cfg([*args[:-4], "--rounds", "8", "--momentum", "0.5"]), short)
    assert _summary(short)["checkpoints"]["model_pt"]["round"] == 8
    spare = tmp_path / "spare"
    shutil.copytree(short, spare)
    seen = _applied_rounds(monkeypatch)
    code, _, err = run_cli(["run", "--resume", str(short), "--rounds", "12", "--quiet"], capsys)
    assert code == 0, err
    assert seen[0] == 8 and _summary(short)["checkpoints"]["resumed_from"] == 8
    _same(full, short)
    # another run's model.pt in its place: named, and the log replayed
    other = tmp_path / "other"
    run_to_dir(_cfg([*args[:-4], "--rounds", "8", "--momentum", "0.5", "--sampled", "2"]), other)
    shutil.copy(other / "model.pt", spare / "model.pt")
    shutil.copy(other / "summary.json", spare / "summary.json")
    seen.clear()
    code, _, err = run_cli(["run", "--resume", str(spare), "--rounds", "12", "--quiet"], capsys)
    assert code == 0 and "checkpoint.pt was written with another history.bin" in err and seen[0] == 0, err
    _same(full, spare)
    # its own model.pt edited by hand: named, and the log replayed
    edited = tmp_path / "edited"
    run_to_dir(_cfg([*args[:-4], "--rounds", "8", "--momentum", "0.5"]), edited)
    state = torch.load(edited / "model.pt", weights_only=True)
    state["momentum"][next(iter(state["momentum"]))].view(-1)[0] += 1.0
    torch.save(state, edited / "model.pt")
    seen.clear()
    code, _, err = run_cli(["run", "--resume", str(edited), "--rounds", "12", "--quiet"], capsys)
    assert code == 0 and "checkpoint.pt holds another state than the one it was written with" in err, err
    assert len(err.strip().splitlines()) == 1 and seen[0] == 0
    _same(full, edited)


def test_a_checkpoint_that_cannot_be_written_stops_the_checkpoints_not_the_run(tmp_path, capsys, monkeypatch):
    from hiso.runners import checkpoint as ck
    from hiso.atomic import torch_tmp

    def full_disk(path, blob):
        torch_tmp(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ck, "save_atomic", full_disk)
    args = [*QUAD, "--rounds", "10"]
    d = tmp_path / "r"
    summary = run_to_dir(_cfg([*args, "--checkpoint-every", "3"]), d)
    err = capsys.readouterr().err
    assert summary["rounds_done"] == 10 and summary["checkpoints"]["writes"] == 0
    assert "No space left" in summary["checkpoints"]["failed"]
    assert err.count("could not be written at round 3") == 1 and "replays the log from round 0" in err
    assert not (d / FILE).exists() and not torch_tmp(d / FILE).exists()
    run_to_dir(_cfg(args), tmp_path / "plain")
    _same(tmp_path / "plain", d)


def test_eval_and_export_of_an_unfinished_run_start_from_its_checkpoint(tmp_path, monkeypatch):
    """load_run_model (hiso eval, hiso export): a round at or after the checkpoint's is the
    replay's, bit for bit, with only the rounds after the checkpoint applied; an earlier round
    replays from x_0."""
    from hiso.runners.runmodel import load_run_model
    args = [*QUAD, "--rounds", "14"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_to_dir(_cfg(args), full)
    _interrupted(_cfg([*args, "--checkpoint-every", "3"]), cut, 8)
    for r, first in [(8, 6), (7, 6), (6, 6), (4, 0)]:
        seen = _applied_rounds(monkeypatch)
        got = load_run_model(cut, round=r)
        assert (seen[0] if seen else r) == first and got.round == r, (r, seen)
        want = load_run_model(full, round=r)
        assert all(torch.equal(a, b) for a, b in zip(got.model.state_dict().values(), want.model.state_dict().values()))
        monkeypatch.undo()
