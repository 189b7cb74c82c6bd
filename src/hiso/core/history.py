"""The server's log: for each round, its seeds, aggregated scalars and participants.

The log plus the initial model determine every later model exactly, so it is also the
on-disk description of a fine-tuned model (``history.bin``, a few KB per thousand rounds).

File layout (little-endian): ``b"HSOH"``, u8 version, u16 tau, u16 P, then per record
u32 round, u16 n, n x u32 participants, tau*P x u64 seeds, tau*P x f32 scalars and (version 2)
u32 CRC-32 of the record's bytes before it.

The file is append-only: :class:`HistoryWriter` writes each record whole, flushes it and
fsyncs it before the round counts as done. A crash can only leave a *torn* last record (cut
short, or failing its checksum when it is the file's last): readers drop it. Any other damage
(a record in the middle failing its checksum, a round out of sequence) is an error. A torn
record whose length field was itself damaged cannot be told from one cut short: a damaged
length in the middle of a file that points past its end reads as a torn tail. Version 1 files
(no checksums) are still read; a record cut short in them is an error.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"HSOH"
VERSION = 2
READABLE = (1, 2)  # versions read_history accepts (version 1: no checksums)
_HEAD = struct.Struct("<4sBHH")
_REC = struct.Struct("<IH")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class RoundRecord:
    """Round ``round``: seeds (tau, P) uint64, aggregated scalars (tau, P) float32, participants."""

    round: int
    seeds: np.ndarray
    scalars: np.ndarray
    participants: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", np.asarray(self.seeds, dtype=np.uint64))
        object.__setattr__(self, "scalars", np.asarray(self.scalars, dtype=np.float32))
        if self.seeds.ndim != 2 or self.seeds.shape != self.scalars.shape:
            raise ValueError(f"seeds {self.seeds.shape} and scalars {self.scalars.shape} must be equal (tau, P) arrays")


def encode_record(rec: RoundRecord) -> bytes:
    """One record's bytes in the current version, checksum included."""
    parts = np.asarray(rec.participants, dtype="<u4")
    body = (_REC.pack(rec.round, len(parts)) + parts.tobytes()
            + rec.seeds.astype("<u8").tobytes() + rec.scalars.astype("<f4").tobytes())
    return body + _CRC.pack(zlib.crc32(body))


class HistoryWriter:
    """Appends records to a history file as rounds finish, so a crash loses nothing logged.

    ``keep=None`` starts a new file. ``keep=n`` continues an existing one (a resumed run):
    its first ``n`` records are kept and everything after them (later rounds, a torn record)
    is cut off; a version 1 file is rewritten in the current version first (atomically). Each
    record is flushed and, with ``fsync`` (default), on disk before :meth:`write` returns.
    """

    def __init__(self, path: str | Path, tau: int, P: int, *, keep: int | None = None, fsync: bool = True):
        self.tau, self.P, self.fsync = tau, P, fsync
        path = Path(path)
        if keep is None or (keep == 0 and (not path.exists() or path.stat().st_size < _HEAD.size)):
            self._f: BinaryIO = open(path, "wb")
            self._f.write(_HEAD.pack(MAGIC, VERSION, tau, P))
            self._sync()
            return
        log = parse_history(path)
        if (log.tau, log.P) != (tau, P):
            raise ValueError(f"{path}: history has (tau, P) = {(log.tau, log.P)}, expected {(tau, P)}")
        if keep > len(log.records):
            raise ValueError(f"{path}: holds {len(log.records)} rounds, cannot keep {keep}")
        if log.version != VERSION:  # rewrite the kept rounds in the current version, then swap
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, VERSION, tau, P) + b"".join(encode_record(r) for r in log.records[:keep]))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._f = open(path, "r+b")
            self._f.seek(0, os.SEEK_END)
            return
        self._f = open(path, "r+b")
        self._f.truncate(log.ends[keep])
        self._f.seek(log.ends[keep])
        self._sync()

    def _sync(self) -> None:
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def write(self, rec: RoundRecord) -> None:
        if rec.seeds.shape != (self.tau, self.P):
            raise ValueError(f"record shape {rec.seeds.shape} != {(self.tau, self.P)}")
        self._f.write(encode_record(rec))
        self._sync()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "HistoryWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class HistoryLog:
    """A parsed history file: ``ends[i]`` is the byte offset after the first i records
    (``ends[0]`` the header's end); ``torn`` the bytes of a dropped torn last record (0: none)."""

    tau: int
    P: int
    version: int
    records: list[RoundRecord]
    ends: list[int]
    torn: int


def parse_history(path: str | Path) -> HistoryLog:
    """Read a history file, torn last record dropped (see the module's docstring)."""
    data = Path(path).read_bytes()
    if len(data) < _HEAD.size:
        raise ValueError(f"{path}: too short to be a hiso history file")
    magic, version, tau, P = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version not in READABLE:
        raise ValueError(f"{path}: not a hiso history file (versions {', '.join(map(str, READABLE))})")
    n, crc = tau * P, version >= 2
    records, ends, off = [], [_HEAD.size], _HEAD.size
    while off < len(data):
        start = off
        if off + _REC.size > len(data):
            if crc:
                break
            raise ValueError(f"{path}: truncated record header at byte {off}")
        rnd, m = _REC.unpack_from(data, off)
        end = off + _REC.size + 4 * m + 12 * n + (_CRC.size if crc else 0)
        if end > len(data):
            if crc:
                break
            raise ValueError(f"{path}: truncated record for round {rnd}")
        if crc and _CRC.unpack_from(data, end - _CRC.size)[0] != zlib.crc32(data[start:end - _CRC.size]):
            if end == len(data):  # the last record: a write cut short by a crash
                break
            raise ValueError(f"{path}: record {len(records)} (bytes {start}-{end}) fails its checksum: the file is "
                             f"damaged before its end")
        off += _REC.size
        parts = np.frombuffer(data, "<u4", m, off); off += 4 * m
        seeds = np.frombuffer(data, "<u8", n, off).reshape(tau, P); off += 8 * n
        scal = np.frombuffer(data, "<f4", n, off).reshape(tau, P); off = end
        if rnd != len(records):
            raise ValueError(f"{path}: expected round {len(records)}, found {rnd}")
        records.append(RoundRecord(rnd, seeds.copy(), scal.copy(), tuple(int(c) for c in parts)))
        ends.append(end)
    return HistoryLog(tau, P, version, records, ends, len(data) - ends[-1])


def read_history(path: str | Path) -> tuple[int, int, list[RoundRecord]]:
    """Read a history file: (tau, P, records), a torn last record dropped. Raises ValueError
    on a damaged file."""
    log = parse_history(path)
    return log.tau, log.P, log.records
