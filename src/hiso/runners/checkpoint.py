"""Checkpoints of a running server's state, so that ``--resume`` replays only the rounds after one.

A resumed run rebuilds the server's model and H by replaying the log from x_0 (see
:mod:`hiso.runners.rundir`). That costs one update per logged round: negligible for small
models, but for an LLM with all parameters trainable it is one direction-combination of d
values per round, so a run resumed at round 2,000 spent minutes replaying before its first new
round (bench/gpu.md). ``DIR/checkpoint.pt`` cuts that to the rounds since the last checkpoint.

What it holds: the server replica's :meth:`~hiso.core.state.ModelState.state_dict` (model or
adapter, H, momentum, step normalisation) at a round c whose history record and metrics row are
both written, tied to its run by the fingerprint of the algorithm configuration
(:func:`hiso.core.join.config_fingerprint`, the one peers compare when they join) and the
SHA-256 of ``history.bin``'s first bytes, up to record c, and to itself by the SHA-256 of the
state it holds (:func:`state_digest`). A resume uses it only when all three still match (the log
it keeps holding at least c records; the state as it was written, not edited); otherwise it
replays from x_0 as before and says why. A checkpoint written before the state's digest was
kept has none and is used as before. The state is the one the run held, saved bit for bit, so a run continued from it equals
the uninterrupted run exactly (``tests/test_checkpoint.py``); it changes no result, which is why
``checkpoint_every`` may differ between the start of a run and its resumption.

When: every ``checkpoint_every`` rounds (an integer) or that much training time (``"5m"``,
``"300s"``, ``"1h"``; the default is ``"5m"``, so runs of a few minutes never write one), after
the round's metrics row; ``0`` never. Written atomically (a temporary file, fsync, rename): a
crash leaves the old checkpoint or the new one. Removed when the run ends: ``model.pt`` then
holds the final state, and ``summary.json`` (``checkpoints.model_pt``) the same ties for it, so a
finished run continued to more rounds (``--rounds N``) starts from its ``model.pt``, made its
checkpoint before that summary goes (:func:`keep_final`). Its cost (writes, seconds, bytes) is in ``summary.json``'s
``checkpoints``; the seconds are not in ``wall_s``.

Where it is not used (the log is replayed from x_0 as before): ``--mode faithful`` (each
client's replica is rebuilt at the round it last took part in, which needs every round's state),
a server that could have sent a snapshot before round c (the byte count of a snapshot is made
from the state of its round), a run with faults whose last logged round is c (its late answers
in flight are recomputed at round c - 1), and FedKSeed (its own log format).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from ..config import parse_every
from ..core.join import config_fingerprint
from ..atomic import save_atomic, torch_tmp
from .runfiles import on_cpu

FILE = "checkpoint.pt"
FORMAT = 1


def _history_digest(path: Path, size: int | None = None) -> tuple[int, str] | None:
    """(bytes, SHA-256) of ``path``'s first ``size`` bytes (all of it if None); None if shorter."""
    data = path.read_bytes()
    if size is not None:
        if len(data) < size:
            return None
        data = data[:size]
    return len(data), hashlib.sha256(data).hexdigest()


def state_digest(state) -> str:
    """SHA-256 of a saved state (dicts of tensors and plain values): each tensor's name, dtype,
    shape and bytes in key order, so any edit of a value, a key or a dtype changes it."""
    h = hashlib.sha256()

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(f"D{len(obj)}".encode())
            for k in sorted(obj, key=str):
                h.update(f"K{k!r}".encode())
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            h.update(f"L{len(obj)}".encode())
            for v in obj:
                walk(v)
        else:
            h.update(f"V{type(obj).__name__}:{obj!r}".encode())
    walk(state)
    return h.hexdigest()


class CheckpointUnusable(ValueError):
    """A runner cannot resume from a checkpoint (raised before it changed anything)."""


def start_from(state, server, start: dict | None, records: int, faithful: bool = False,
               unreliable: bool = False) -> int:
    """A runner's resume: load ``start`` (a checkpoint's state at round c, or None) into the
    server's replica ``state`` and return c, the first record the replica must apply (0: all).
    Raises :class:`CheckpointUnusable`, having loaded nothing, where the replay cannot use it."""
    if start is None:
        return 0
    why = refusal(server, start["round"], records, faithful, unreliable)
    if why is not None:
        raise CheckpointUnusable(why)
    state.load_state_dict(start)
    return state.round


def refusal(server, c: int, records: int, faithful: bool = False, unreliable: bool = False) -> str | None:
    """Why a resume of ``records`` logged rounds cannot start from the state at round ``c`` (None:
    it can): the replay of rounds before c needs their states (see the module docstring)."""
    if faithful:
        return "faithful mode rebuilds each client's replica at the round it last took part in"
    if server.snapshot_after is not None and server.snapshot_after < c:
        return (f"the server sends a snapshot to a client {server.snapshot_after + 1} rounds behind, and a "
                f"snapshot's bytes are made from its round's state")
    if unreliable and c >= records:
        return "the late answers in flight at the cut are computed at the state before the checkpoint's round"
    return None


class Checkpoints:
    """Writes ``DIR/checkpoint.pt`` when one is due (see the module docstring). ``start``: the
    round the run (or its resumption) starts from; ``clock``: seconds, monotonic."""

    def __init__(self, out: str | Path, cfg, start: int = 0, clock=time.monotonic):
        self.path = Path(out) / FILE
        self.every = parse_every(cfg.checkpoint_every)
        self.cfg = cfg
        self.clock = clock
        self.last_round, self.last_t = start, clock()
        self.writes, self.seconds, self.bytes = 0, 0.0, 0
        self.failed: str | None = None

    def due(self, round: int) -> bool:
        if self.every is None or self.failed or round <= self.last_round:
            return False
        kind, n = self.every
        return round - self.last_round >= n if kind == "rounds" else self.clock() - self.last_t >= n

    def maybe_write(self, state, round: int) -> bool:
        """Write ``state`` (a :class:`~hiso.core.state.ModelState` at ``round``) if a checkpoint
        is due; True if one was written. A checkpoint that cannot be written (a full disk, say)
        stops the checkpoints, not the run: it is named in one line on stderr."""
        if not self.due(round) or state.round != round:
            return False
        try:
            self.write(state, round)
        except OSError as e:
            torch_tmp(self.path).unlink(missing_ok=True)
            self.failed = f"{type(e).__name__}: {e}"
            print(f"hiso: {self.path} could not be written at round {round} ({self.failed}); no more checkpoints "
                  f"this run: a resume replays the log from {'an earlier checkpoint' if self.writes else 'round 0'}",
                  file=sys.stderr)
            return False
        return True

    def write(self, state, round: int) -> None:
        t0 = time.perf_counter()
        saved = on_cpu(state.state_dict())
        save_atomic(self.path, {**final_marker(self.path.parent, self.cfg, round, saved), "format": FORMAT,
                                "state": saved})
        self.writes += 1
        self.bytes = self.path.stat().st_size
        self.seconds += time.perf_counter() - t0
        self.last_round, self.last_t = round, self.clock()

    def remove(self) -> None:
        """The run ended: ``model.pt`` holds its final state."""
        for p in (self.path, torch_tmp(self.path)):
            if p.is_file():
                p.unlink()

    def summary(self) -> dict:
        every = None if self.every is None else f"{self.every[1]:g} {self.every[0]}"
        return {"every": every, "writes": self.writes, "seconds": round(self.seconds, 3), "bytes": self.bytes,
                **({"failed": self.failed} if self.failed else {})}


def final_marker(out: str | Path, cfg, round: int, state: dict) -> dict:
    """What ties ``state``, the state at ``round``, to the run in ``out``: its round, the
    configuration's fingerprint, the hash of ``history.bin`` as it is now and the state's own
    digest. A checkpoint carries it, and so does ``summary.json`` (``checkpoints.model_pt``) for
    ``model.pt``, the state a finished run ends with, which a continuation to more rounds starts from."""
    size, digest = _history_digest(Path(out) / "history.bin")
    return {"round": round, "config": config_fingerprint(cfg.zo()).hex(), "history_bytes": size,
            "history_sha256": digest, "state_sha256": state_digest(state)}


def keep_final(out: str | Path, cfg) -> bool:
    """A finished run about to be continued to more rounds (its summary.json is going): its
    ``model.pt``, which that summary ties to the run (``checkpoints.model_pt``), becomes
    ``checkpoint.pt``, so the continuation starts there. True if it was written."""
    out = Path(out)
    if (out / FILE).exists():
        return False
    try:
        meta = json.loads((out / "summary.json").read_text())["checkpoints"]["model_pt"]
        state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    except Exception:  # no summary or model, or ones from before model.pt was described there
        return False
    save_atomic(out / FILE, {**meta, "format": FORMAT, "state": state})
    return True


def _check(path: Path, blob, cfg, records: int) -> str | None:
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or not isinstance(blob.get("state"), dict):
        return f"{path} is not a hiso checkpoint of format {FORMAT}"
    if blob.get("config") != config_fingerprint(cfg.zo()).hex():
        return f"{path} was written by another algorithm configuration"
    c = blob.get("round")
    if not isinstance(c, int) or c < 0 or blob["state"].get("round") != c:
        return f"{path} names no valid round"
    if c > records:
        return f"{path} is at round {c}, past the {records} rounds the log keeps"
    size = blob.get("history_bytes")
    got = _history_digest(path.parent / "history.bin", size) if isinstance(size, int) else None
    if got is None or got[1] != blob.get("history_sha256"):
        return f"{path} was written with another history.bin than the one the run keeps"
    if "state_sha256" in blob and state_digest(blob["state"]) != blob["state_sha256"]:  # (none: written before)
        return f"{path} holds another state than the one it was written with (its SHA-256 differs)"
    return None


def load_start(out: str | Path, cfg, records: int) -> tuple[dict | None, str]:
    """The server state to resume ``out`` from, if its checkpoint belongs to this run and to the
    ``records`` history records it keeps: (state, "") or (None, why not; "" if there is none)."""
    path = Path(out) / FILE
    if not path.is_file():
        return None, ""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file is a reason to replay, not to stop
        first = (str(e).strip().splitlines() or [""])[0]  # (torch's messages run over several lines)
        return None, f"{path} cannot be read ({type(e).__name__}: {first})"
    why = _check(path, blob, cfg, records)
    return (None, why) if why is not None else (blob["state"], "")
