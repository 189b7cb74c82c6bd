"""Runs made before the methods-as-plugins refactor (issue 40), resumed to new rounds by the code
of today, start where the code that wrote them did and end as the uninterrupted run.

The new rounds' forwards are computed here, and a forward's last bits depend on the CPU (its
vector kernels, its BLAS), so "the uninterrupted run" is the fixture's run with the same rounds
computed here (legacy_helpers.reference: its log replayed to the resume's starting round, then
run on); the fixture's own bytes are compared with where this machine computes the fixture's
whole run from x_0 bit for bit (its forward digest, fixtures.json's ``forward_digests``), and
that comparison is skipped elsewhere. The replay-only checks (rebuild, export, a torn log
replayed) are in test_legacy_runs.py and run everywhere.
"""

import shutil

import pytest

from legacy_helpers import (FIXTURES, HERE, MANIFEST, SHORT, STOPPED, assert_same_run, cut, forward_digest, hiso,
                            reference, resumed_from)


@pytest.fixture(autouse=True)
def _legacy_task_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # runs of --task legacy_task:TinyMLP


def _continued(name, tmp):
    """short, continued with --resume --rounds ROUNDS."""
    shutil.copytree(HERE / name / "short", d := tmp / "short")
    hiso("run", "--resume", d, "--rounds", FIXTURES[name]["rounds"], "--quiet")
    return d


def _stopped(name, tmp):
    """stopped, resumed from its checkpoint."""
    shutil.copytree(HERE / name / "stopped", d := tmp / "stopped")
    hiso("run", "--resume", d, "--quiet")
    return d


def _killed(name, tmp):
    """What a kill leaves of full after round SHORT (a torn record and metrics line behind, no
    model.pt or summary), resumed: the legacy log replayed from x_0, then run on."""
    d = cut(name, FIXTURES[name]["short"], tmp / "full", torn=True)
    hiso("run", "--resume", d, "--quiet")
    return d


RESUMES = {"continued": (_continued, "short"), "stopped": (_stopped, "stop_after"), "killed": (_killed, "short")}
_done: dict = {}


def _resumed(kind: str, name: str, tmp_factory):
    """The resume ``kind`` of fixture ``name`` (made once a session) and its reference: the run
    with the same rounds computed here, from the same round."""
    if (kind, name) not in _done:
        make, start = RESUMES[kind]
        _done[kind, name] = make(name, tmp_factory.mktemp(f"{kind}-{name}"))
    return _done[kind, name], reference(name, FIXTURES[name][RESUMES[kind][1]], tmp_factory)


@pytest.mark.parametrize("name", SHORT)
def test_a_finished_run_continued_to_more_rounds_is_the_longer_run(tmp_path_factory, name):
    """short, continued with --resume --rounds ROUNDS, is full with its last rounds computed here;
    it starts from short's model.pt where the code that wrote it did, and keeps short's rows."""
    d, want = _resumed("continued", name, tmp_path_factory)
    assert_same_run(d, want)
    assert (d / "metrics.jsonl").read_text().startswith((HERE / name / "short" / "metrics.jsonl").read_text())
    assert resumed_from(d) == FIXTURES[name]["extended_from"]


@pytest.mark.parametrize("name", STOPPED)
def test_a_stopped_run_resumes_to_the_uninterrupted_run(tmp_path_factory, name):
    """stopped resumes from its checkpoint.pt where the code that wrote it did, and ends as full
    with its last round computed here."""
    d, want = _resumed("stopped", name, tmp_path_factory)
    assert_same_run(d, want, config_but={"checkpoint_every"})
    assert resumed_from(d) == FIXTURES[name]["resumed_from"]


@pytest.mark.parametrize("name", SHORT)
def test_a_killed_run_replays_its_log_and_resumes_to_the_uninterrupted_run(tmp_path_factory, name):
    """full cut after round SHORT by a kill resumes to full with its last rounds computed here."""
    d, want = _resumed("killed", name, tmp_path_factory)
    assert_same_run(d, want)
    assert resumed_from(d) is None


@pytest.mark.parametrize("kind, name", [(k, n) for k in RESUMES for n in (STOPPED if k == "stopped" else SHORT)])
def test_the_resume_is_the_legacy_run_where_this_cpu_computes_its_forwards(tmp_path_factory, kind, name):
    """Where this machine computes the fixture's run from x_0 bit for bit (its forward digest is
    the fixture's), the resume ends as the legacy full run itself, byte for byte."""
    here, made = forward_digest(name, tmp_path_factory), MANIFEST["forward_digests"][name]
    if here != made:
        pytest.skip(f"forward digest {here} here, {made} where the fixtures were made: this CPU computes "
                    f"{name}'s forwards otherwise, so its new rounds cannot be the fixture's bytes")
    d, _ = _resumed(kind, name, tmp_path_factory)
    assert_same_run(d, HERE / name / "full", config_but={"checkpoint_every"} if kind == "stopped" else (),
                    legacy=True)
