"""Runs made before the methods-as-plugins refactor (issue 40) replay bit for bit with the code of
today, on any CPU: rebuilt, exported, refused where they keep no log, and a killed run's log
replayed by a resume. (Resuming them to new rounds: test_legacy_resume.py.)

The runs are in tests/fixtures/legacy (made at the commit fixtures.json names, by make.sh there),
one folder per method or variant: ``full`` (ROUNDS rounds), ``short`` (the same run finished at
SHORT rounds), ``stopped`` (ROUNDS asked, stopped after STOP_AFTER rounds, its checkpoint.pt
left), ``export`` (``hiso export`` of full); fixtures.json says which a fixture has. Each test
works on copies in tmp_path, through the ``hiso`` command in-process (the CLI is what users keep).
None of these checks computes a forward, so none depends on the CPU, and none is skipped.
"""

import json
import shutil
from pathlib import Path

import pytest

from cli_helpers import run_cli
from legacy_helpers import (BASELINES, FIXTURES, HERE, LOGGED, MANIFEST, SHORT, assert_same_run, cut, differences,
                            load, resumed_from, run_digest)


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
        got, saved = load(out), load(want)  # FedKSeed's seed-pool sums included
        assert differences(got, saved) == []


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


# ------------------------------------------------------------------- a killed run's log

@pytest.mark.parametrize("name", SHORT)
def test_a_killed_runs_torn_log_is_replayed_to_the_rounds_it_holds(tmp_path, capsys, name):
    """What a kill leaves of short (its log with a torn record behind, a torn metrics line, no
    model.pt or summary) resumes, replaying the legacy log from x_0, to short as it was saved:
    the torn record and line dropped, nothing computed."""
    short = HERE / name / "short"
    d = cut(name, FIXTURES[name]["short"], tmp_path / "full", torn=True)
    shutil.copy(short / "config.json", d / "config.json")  # short's settings: it ends where the log does
    _hiso(capsys, "run", "--resume", d, "--quiet")
    assert_same_run(d, short, legacy=True)
    assert resumed_from(d) is None  # (full kept no checkpoint: replayed from x_0)


def test_the_forward_digests_are_the_fixtures_runs():
    """fixtures.json's forward digests (test_legacy_resume.py) are those of the full runs' logs
    and metrics, as the machine that made them computed them."""
    made = {n: run_digest(HERE / n / "full") for n in LOGGED}
    assert MANIFEST["forward_digests"] == made, "a fixture added? record its digest (legacy_helpers.run_digest)"


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
        # the run by its path then, by its directory's name now (an export names no machine path)
        assert m.pop("run_dir", None) in (None, str(run_dir.resolve())) and m.pop("run", run_dir.name) == run_dir.name
        m.pop("hiso_version")
        m.pop("trained", None)  # the run's rounds and bytes, said since exports travel
        m.get("hiso", m).pop("privacy", None)  # a DP run's guarantee is stated otherwise since issue 41
    card = (d / "README.md").read_text()  # (a model card in the Hugging Face format since exports travel)
    assert meta["config_sha256"] in card and str(meta["round"]) in card
    return tensors, header, meta, ""


@pytest.mark.parametrize("name", list(FIXTURES))
def test_export_is_the_legacy_export(tmp_path, capsys, name):
    """hiso export of full writes what the legacy code wrote (export); of round SHORT, short's model."""
    full, made = _copy(name, "full", tmp_path), HERE / name / "export"
    _hiso(capsys, "export", full, "--out", tmp_path / "e")
    got, want = _export_files(tmp_path / "e", full), _export_files(made, Path(json.loads(
        (made / "hiso.json").read_text())["run_dir"]))
    assert differences(got[0], want[0]) == [] and got[1:] == want[1:]
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == sorted(p.name for p in made.iterdir())
    if name in SHORT:
        r = FIXTURES[name]["short"]
        _hiso(capsys, "export", full, "--out", tmp_path / "e3", "--round", r)
        tensors = _export_files(tmp_path / "e3", full)[0]
        assert differences(tensors, load(HERE / name / "short" / "model.pt")["model"]) == []
