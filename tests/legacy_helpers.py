"""The legacy run fixtures (tests/fixtures/legacy) and what the tests of them share.

The fixtures were made on one machine. Replaying their logs is exact on any CPU; computing new
rounds is not (a forward's last bits depend on the CPU's kernels), so the checks that compute
rounds compare with :func:`reference`, the same rounds computed here, and with the fixtures'
bytes only where :func:`forward_digest` shows this machine computes the fixtures' rounds as
the machine that made them did.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import torch

from hiso import compat
from hiso.cli import main
from hiso.core.history import parse_history

HERE = Path(__file__).parent / "fixtures" / "legacy"
MANIFEST = json.loads((HERE / "fixtures.json").read_text())
FIXTURES = MANIFEST["fixtures"]
SHORT = [n for n, f in FIXTURES.items() if "short" in f["parts"]]
STOPPED = [n for n, f in FIXTURES.items() if "stopped" in f["parts"]]
LOGGED = [n for n in FIXTURES if n in SHORT or n in STOPPED]  # the others are full-model baselines
BASELINES = [n for n in FIXTURES if n not in LOGGED]

DP_CHANGED = {"train_loss", "bytes_up", "dp_participations_max", "dp_epsilon"}  # what a DP run reports otherwise since issue 41
DP_CHANGED_SUMMARY = {"privacy", "communication_per_client", "final_train_loss", "train_loss"}
WALL = {"wall_s", "client_s"}  # metrics keys a resumed run may change (measured time)
WALL_SUMMARY = {"wall_s_train", "wall_s_total", "s_per_round", "peak_rss_mb", "peak_rss_mb_run", "client",
                "checkpoints"}  # summary keys that are measurements, or the resume's own bookkeeping
CLIENT_COUNTED = ("answers", "forwards_per_round", "backwards_per_round", "resident_bytes")
# a client's resident bytes count every fold stage's state since 2026-11-28 (they counted H and the
# momentum buffer only): what the fixtures' summaries did not count, per fixture
STAGE_BYTES_UNCOUNTED = {"decomfl-stepnorm": 16}  # the step-norm stage's (v, w): two float64


def hiso(*args) -> str:
    """``hiso ARGS`` in-process; its output, or AssertionError with it on a non-zero exit."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    assert code == 0, f"hiso {' '.join(map(str, args))}: exit {code}\n{out.getvalue()}"
    return out.getvalue()


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def differences(got, want, where: str = "") -> list[str]:
    """Where ``got`` and ``want`` (nested dicts of tensors and plain values) differ; tensors must
    have the same dtype, shape and bits (NaN and -0.0 included)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: {type(got).__name__}, not a dict"]
        out = [f"{where}/{k}: missing" for k in want.keys() - got.keys()]
        out += [f"{where}/{k}: not in the saved state" for k in got.keys() - want.keys()]
        for k in want.keys() & got.keys():
            out += differences(got[k], want[k], f"{where}/{k}")
        return out
    if torch.is_tensor(want):
        if not torch.is_tensor(got) or (got.dtype, got.shape) != (want.dtype, want.shape):
            return [f"{where}: {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}, "
                    f"saved {want.dtype} {tuple(want.shape)}"]
        bits = [t.detach().cpu().reshape(-1).contiguous().view(torch.uint8) for t in (got, want)]
        return [] if torch.equal(*bits) else [f"{where}: other values"]
    return [] if got == want else [f"{where}: {got!r}, saved {want!r}"]


def rows(d: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in WALL}
            for line in (d / "metrics.jsonl").read_text().splitlines()]


def summary(d: Path) -> dict:
    s = json.loads((d / "summary.json").read_text())
    counted = {k: s["client"][k] for k in CLIENT_COUNTED} if "client" in s else None
    return {**{k: v for k, v in s.items() if k not in WALL_SUMMARY}, "client": counted}


def resumed_from(d: Path) -> int | None:
    """The round the resume of ``d`` started from (None: it replayed the log from x_0)."""
    return (json.loads((d / "summary.json").read_text()).get("checkpoints") or {}).get("resumed_from")


def assert_same_run(d: Path, want: Path, config_but=(), legacy: bool = False) -> None:
    """``d`` ended as the run ``want``: history.bin and model.pt byte for byte, metrics and summary
    but measured times, and every setting of want's config.json (settings added since may join
    it). ``legacy``: ``want`` was made by the legacy code (what it reported otherwise is left out)."""
    assert (d / "history.bin").read_bytes() == (want / "history.bin").read_bytes()
    assert differences(load(d / "model.pt"), load(want / "model.pt")) == []
    # the bytes too (torch.save writes the same file for the same dict; a torch upgrade could
    # change that while the check above still holds)
    assert (d / "model.pt").read_bytes() == (want / "model.pt").read_bytes()
    got_rows, want_rows, got_summary, want_summary = rows(d), rows(want), summary(d), summary(want)
    if legacy and json.loads((want / "config.json").read_text()).get("dp_clip") is not None:
        # under DP no training loss leaves a client since these runs were made (issue 41): rounds
        # run today carry none (and their uplinks its bytes less); the model and log are the same
        got_rows, want_rows = ([{k: v for k, v in r.items() if k not in DP_CHANGED} for r in x]
                               for x in (got_rows, want_rows))
        got_summary, want_summary = ({k: v for k, v in x.items() if k not in DP_CHANGED_SUMMARY}
                                     for x in (got_summary, want_summary))
    assert got_rows == want_rows
    if legacy and want_summary.get("client"):
        uncounted = STAGE_BYTES_UNCOUNTED.get(want.parent.name, 0)
        want_summary["client"] = {**want_summary["client"],
                                  "resident_bytes": want_summary["client"]["resident_bytes"] + uncounted}
    assert got_summary == want_summary
    # read as today's (hiso.compat.migrate: schema 3 keeps HiSo's options in method_opts, flat before)
    # (and schema 5 keeps the task's options in task_opts: compared flat, as the hash counts them)
    got, wanted = (compat.flat_task_options(compat.migrate(json.loads((p / "config.json").read_text()))[0])
                   for p in (d, want))
    keys = wanted.keys() - set(config_but)
    assert {k: got.get(k, "(missing)") for k in keys} == {k: wanted[k] for k in keys}
    assert not (d / "checkpoint.pt").exists()


def _part_log(name: str, rounds: int) -> bytes:
    """Fixture ``name``'s log to round ``rounds``: that of its part that ended there (the log is
    append-only, so it starts full's)."""
    f = FIXTURES[name]
    for part, key in (("short", "short"), ("stopped", "stop_after")):
        if part in f["parts"] and f[key] == rounds:
            return (HERE / name / part / "history.bin").read_bytes()
    raise ValueError(f"{name}: no part ends after round {rounds}")


def cut(name: str, rounds: int, to: Path, torn: bool = False) -> Path:
    """What a kill leaves of fixture ``name``'s full run after round ``rounds`` (the log and
    metrics to that round, no model.pt or summary), in ``to``; ``torn``: with a torn record and a
    torn metrics line behind (the next round's, cut short). Round 0: no log, nothing kept."""
    full = HERE / name / "full"
    shutil.copytree(full, to)
    for f in ("model.pt", "summary.json") + (("history.bin", "metrics.jsonl") if rounds == 0 else ()):
        (to / f).unlink()
    if rounds:
        log, kept = (full / "history.bin").read_bytes(), _part_log(name, rounds)
        assert log.startswith(kept) and len(log) > len(kept) + 5
        (to / "history.bin").write_bytes(log[:len(kept) + (5 if torn else 0)])
        lines = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
        (to / "metrics.jsonl").write_text("".join(lines[:rounds + 1]) + (lines[rounds + 1][:20] if torn else ""))
    return to


_made: dict[tuple[str, int], Path] = {}


def reference(name: str, rounds: int, tmp_factory) -> Path:
    """Fixture ``name``'s full run with the rounds after ``rounds`` computed here: its log replayed
    to round ``rounds`` (exact on any CPU), then run on uninterrupted (made once a session);
    round 0: the whole run computed here."""
    if (name, rounds) not in _made:
        d = cut(name, rounds, tmp_factory.mktemp(f"{name}-from-{rounds}") / "run")
        hiso("run", "--resume", d, "--quiet")
        _made[name, rounds] = d
    return _made[name, rounds]


def run_digest(d: Path) -> str:
    """sha256 (16 hex digits) of what run ``d``'s forwards decided: its log (the scalars) and the
    losses and metrics of metrics.jsonl (measured times left out, and under DP what the legacy
    code reported otherwise)."""
    dp = json.loads((d / "config.json").read_text()).get("dp_clip") is not None
    kept = [{k: v for k, v in r.items() if not (dp and k in DP_CHANGED)} for r in rows(d)]
    h = hashlib.sha256((d / "history.bin").read_bytes())
    h.update(json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()[:16]


def forward_digest(name: str, tmp_factory) -> str:
    """:func:`run_digest` of fixture ``name``'s run as this machine computes it from x_0. Equal to
    fixtures.json's ``forward_digests`` (that of the fixture's full run, made where the fixtures
    were): this machine computes the fixture's forwards as that one did."""
    return run_digest(reference(name, 0, tmp_factory))


def dumped_flat(cfg) -> dict:
    """``cfg.model_dump()`` as a config.json before schema 5 held it: every task option a flat key
    (its default where the task does not read it), no ``task_opts``."""
    values = cfg.model_dump()
    task = values.pop("task_opts")
    return {**values, **compat.TASK_FLAT_OPTIONS, **task}


def flat_config_hash(raw: dict) -> str:
    """The configuration hash hiso computed from a config.json with every option flat (as before
    schema 3): its schema and task_info, an empty method_opts and a later field at its default left out."""
    from hiso.config import RunConfig
    flat = {k: v for k, v in raw.items() if k not in ("schema", "task_info") and not (k == "method_opts" and v == {})}
    for name in compat.HASH_LATER_FIELDS:
        default = compat.FLAT_DEFAULTS[name] if name in compat.FLAT_DEFAULTS else \
            compat.TASK_FLAT_OPTIONS[name] if name in compat.TASK_FLAT_OPTIONS else \
            RunConfig.model_fields[name].get_default(call_default_factory=True)
        if name in flat and flat[name] == default:
            flat.pop(name)
    for name, counts in compat.HASH_ONLY_WHERE.items():
        if not counts(flat):
            flat.pop(name, None)
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
