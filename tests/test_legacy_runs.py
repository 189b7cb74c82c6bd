"""Runs made before the methods-as-plugins refactor (issue 40) rebuild, resume and export bit for bit
with the code of today.

The runs are in tests/fixtures/legacy (made at the commit fixtures.json names, by make.sh there),
one folder per method or variant: ``full`` (ROUNDS rounds), ``short`` (the same run finished at
SHORT rounds), ``stopped`` (ROUNDS asked, stopped after STOP_AFTER rounds, its checkpoint.pt
left), ``export`` (``hiso export`` of full); fixtures.json says which a fixture has. Each test
works on copies in tmp_path, through the ``hiso`` command in-process (the CLI is what users keep).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from cli_helpers import run_cli

HERE = Path(__file__).parent / "fixtures" / "legacy"
MANIFEST = json.loads((HERE / "fixtures.json").read_text())
FIXTURES = MANIFEST["fixtures"]
SHORT = [n for n, f in FIXTURES.items() if "short" in f["parts"]]
STOPPED = [n for n, f in FIXTURES.items() if "stopped" in f["parts"]]
LOGGED = [n for n in FIXTURES if n in SHORT or n in STOPPED]  # the others are full-model baselines
BASELINES = [n for n in FIXTURES if n not in LOGGED]

DP_CHANGED = {"train_loss", "bytes_up", "dp_participations_max", "dp_epsilon"}  # what a DP run reports otherwise since issue 41 (see below)
DP_CHANGED_SUMMARY = {"privacy", "communication_per_client", "final_train_loss", "train_loss"}
WALL = {"wall_s", "client_s"}  # metrics keys a resumed run may change (measured time)
WALL_SUMMARY = {"wall_s_train", "wall_s_total", "s_per_round", "peak_rss_mb", "peak_rss_mb_run", "client",
                "checkpoints"}  # summary keys that are measurements, or the resume's own bookkeeping
CLIENT_COUNTED = ("answers", "forwards_per_round", "backwards_per_round", "resident_bytes")


@pytest.fixture(autouse=True)
def _legacy_task_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # runs of --task legacy_task:TinyMLP


def _copy(name: str, part: str, tmp_path: Path) -> Path:
    to = tmp_path / part
    shutil.copytree(HERE / name / part, to)
    return to


def _hiso(capsys, *args) -> str:
    code, out, err = run_cli([str(a) for a in args], capsys)
    assert code == 0, f"hiso {' '.join(map(str, args))}: exit {code}\n{err}"
    return out + err


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _differences(got, want, where: str = "") -> list[str]:
    """Where ``got`` and ``want`` (nested dicts of tensors and plain values) differ; tensors must
    have the same dtype, shape and bits (NaN and -0.0 included)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: {type(got).__name__}, not a dict"]
        out = [f"{where}/{k}: missing" for k in want.keys() - got.keys()]
        out += [f"{where}/{k}: not in the saved state" for k in got.keys() - want.keys()]
        for k in want.keys() & got.keys():
            out += _differences(got[k], want[k], f"{where}/{k}")
        return out
    if torch.is_tensor(want):
        if not torch.is_tensor(got) or (got.dtype, got.shape) != (want.dtype, want.shape):
            return [f"{where}: {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}, "
                    f"saved {want.dtype} {tuple(want.shape)}"]
        bits = [t.detach().cpu().reshape(-1).contiguous().view(torch.uint8) for t in (got, want)]
        return [] if torch.equal(*bits) else [f"{where}: other values"]
    return [] if got == want else [f"{where}: {got!r}, saved {want!r}"]


def _rows(d: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in WALL}
            for line in (d / "metrics.jsonl").read_text().splitlines()]


def _summary(d: Path) -> dict:
    s = json.loads((d / "summary.json").read_text())
    counted = {k: s["client"][k] for k in CLIENT_COUNTED} if "client" in s else None
    return {**{k: v for k, v in s.items() if k not in WALL_SUMMARY}, "client": counted}


def _resumed_from(d: Path) -> int | None:
    """The round the resume of ``d`` started from (None: it replayed the log from x_0)."""
    return (json.loads((d / "summary.json").read_text()).get("checkpoints") or {}).get("resumed_from")


def assert_is_the_full_run(d: Path, full: Path, config_but=()) -> None:
    """``d`` ended as the legacy run ``full``: history.bin and model.pt byte for byte, metrics and
    summary but measured times, and every setting of full's config.json (settings added since may
    join it)."""
    assert (d / "history.bin").read_bytes() == (full / "history.bin").read_bytes()
    assert _differences(_load(d / "model.pt"), _load(full / "model.pt")) == []
    # the bytes too (torch.save writes the same file for the same dict; a torch upgrade could
    # change that while the check above still holds)
    assert (d / "model.pt").read_bytes() == (full / "model.pt").read_bytes()
    rows, want_rows, summary, want_summary = _rows(d), _rows(full), _summary(d), _summary(full)
    if json.loads((full / "config.json").read_text()).get("dp_clip") is not None:
        # under DP no training loss leaves a client since these runs were made (issue 41): rounds
        # resumed today carry none (and their uplinks its bytes less); the model and log are the same
        rows, want_rows = ([{k: v for k, v in r.items() if k not in DP_CHANGED} for r in x] for x in (rows, want_rows))
        summary, want_summary = ({k: v for k, v in x.items() if k not in DP_CHANGED_SUMMARY}
                                 for x in (summary, want_summary))
    assert rows == want_rows
    assert summary == want_summary
    got, want = (json.loads((p / "config.json").read_text()) for p in (d, full))
    keys = want.keys() - set(config_but)
    assert {k: got.get(k, "(missing)") for k in keys} == {k: want[k] for k in keys}
    assert not (d / "checkpoint.pt").exists()


# ------------------------------------------------------------------------------- rebuild

@pytest.mark.parametrize("name", LOGGED)
def test_rebuild_gives_what_the_run_saved(tmp_path, capsys, name):
    """hiso rebuild of the last round is full's model.pt, of round SHORT short's model.pt."""
    full = _copy(name, "full", tmp_path)
    cases = [([], full / "model.pt")]
    if name in SHORT:
        cases.append((["--round", FIXTURES[name]["short"]], HERE / name / "short" / "model.pt"))
    for args, want in cases:
        out = tmp_path / "rebuilt.pt"
        _hiso(capsys, "rebuild", full, "--out", out, *args)
        got, saved = _load(out), _load(want)  # FedKSeed's seed-pool sums included
        assert _differences(got, saved) == []


@pytest.mark.parametrize("name", BASELINES)
def test_a_full_model_run_is_still_refused_what_needs_a_log(tmp_path, capsys, name):
    """A full-model run keeps no log: rebuild and a longer resume are refused, nothing written."""
    full = _copy(name, "full", tmp_path)
    before = {p.name: p.read_bytes() for p in full.iterdir()}
    code, _, err = run_cli(["rebuild", str(full), "--out", str(tmp_path / "x.pt")], capsys)
    assert code == 2 and not (tmp_path / "x.pt").exists(), err
    rounds = str(FIXTURES[name]["rounds"] + 2)
    code, _, err = run_cli(["run", "--resume", str(full), "--rounds", rounds, "--quiet"], capsys)
    assert code == 2, err
    assert {p.name: p.read_bytes() for p in full.iterdir()} == before


# -------------------------------------------------------------------------------- resume

@pytest.mark.parametrize("name", SHORT)
def test_a_finished_run_continued_to_more_rounds_is_the_longer_run(tmp_path, capsys, name):
    """short, continued with --resume --rounds ROUNDS, is full; it starts from short's model.pt
    where the code that wrote it did."""
    full, short = HERE / name / "full", _copy(name, "short", tmp_path)
    kept = (short / "metrics.jsonl").read_text()
    _hiso(capsys, "run", "--resume", short, "--rounds", FIXTURES[name]["rounds"], "--quiet")
    assert_is_the_full_run(short, full)
    assert (short / "metrics.jsonl").read_text().startswith(kept)  # continued, not redone
    assert _resumed_from(short) == FIXTURES[name]["extended_from"]


@pytest.mark.parametrize("name", STOPPED)
def test_a_stopped_run_resumes_to_the_uninterrupted_run(tmp_path, capsys, name):
    """stopped resumes from its checkpoint.pt where the code that wrote it did, and ends as full."""
    full, stopped = HERE / name / "full", _copy(name, "stopped", tmp_path)
    _hiso(capsys, "run", "--resume", stopped, "--quiet")
    assert_is_the_full_run(stopped, full, config_but={"checkpoint_every"})
    assert _resumed_from(stopped) == FIXTURES[name]["resumed_from"]


@pytest.mark.parametrize("name", SHORT)
def test_a_killed_run_replays_its_log_and_resumes_to_the_uninterrupted_run(tmp_path, capsys, name):
    """What a kill leaves of full (no model.pt, no summary; the log cut after round SHORT with a
    torn record behind it, a torn metrics line) resumes, replaying the legacy log from x_0."""
    full, cut = HERE / name / "full", _copy(name, "full", tmp_path)
    log, short_log = (full / "history.bin").read_bytes(), (HERE / name / "short" / "history.bin").read_bytes()
    assert log.startswith(short_log) and len(log) > len(short_log) + 5  # (the log is append-only)
    (cut / "model.pt").unlink()
    (cut / "summary.json").unlink()
    (cut / "history.bin").write_bytes(log[:len(short_log) + 5])
    lines = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
    rows = FIXTURES[name]["short"] + 1
    (cut / "metrics.jsonl").write_text("".join(lines[:rows]) + lines[rows][:20])
    _hiso(capsys, "run", "--resume", cut, "--quiet")
    assert_is_the_full_run(cut, full)


# -------------------------------------------------------------------------------- export

def _export_files(d: Path, run_dir: Path) -> tuple[dict, dict, dict, str]:
    """An export's tensors, safetensors metadata, hiso.json and model card, the run's directory and
    hiso's version (which say where and by what it was made, not what) left out."""
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = {k: json.loads(v) for k, v in f.metadata().items()}
    meta = json.loads((d / "hiso.json").read_text())
    for m in (meta, *header.values()):
        assert Path(m.pop("run_dir")) == run_dir.resolve()
        m.pop("hiso_version")
        m.get("hiso", m).pop("privacy", None)  # a DP run's guarantee is stated otherwise since issue 41
    card = (d / "README.md").read_text()
    assert str(run_dir.resolve()) in card
    card = "\n".join(x for x in card.splitlines() if "privacy" not in x.lower())
    return tensors, header, meta, card.replace(str(run_dir.resolve()), "RUN")


@pytest.mark.parametrize("name", list(FIXTURES))
def test_export_is_the_legacy_export(tmp_path, capsys, name):
    """hiso export of full writes what the legacy code wrote (export); of round SHORT, short's model."""
    full, made = _copy(name, "full", tmp_path), HERE / name / "export"
    _hiso(capsys, "export", full, "--out", tmp_path / "e")
    got, want = _export_files(tmp_path / "e", full), _export_files(made, Path(json.loads(
        (made / "hiso.json").read_text())["run_dir"]))
    assert _differences(got[0], want[0]) == [] and got[1:] == want[1:]
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == sorted(p.name for p in made.iterdir())
    if name in SHORT:
        r = FIXTURES[name]["short"]
        _hiso(capsys, "export", full, "--out", tmp_path / "e3", "--round", r)
        tensors = _export_files(tmp_path / "e3", full)[0]
        assert _differences(tensors, _load(HERE / name / "short" / "model.pt")["model"]) == []
