"""The server's log: for each round, its aggregated scalars, attempt and participants.

The log plus the initial model determine every later model exactly, so it is also the
on-disk description of a fine-tuned model (``history.bin``: for P = 5, tau = 1 and float32
scalars about 30 bytes a round).

File layout, version 3 (little-endian; varint = unsigned LEB128): ``b"HSOH"``, u8 version,
u16 tau, u16 P, u8 scalar dtype (0 float32, 1 float16, 2 bfloat16, 3 int8, 4 int4, 5 int2, 6 sign), u64 run seed, u8 length
and the direction family's name (ASCII); then per record varint round, varint attempt, varint
n, n varint participants, tau*P scalars in the scalar dtype (one block, :mod:`hiso.core.scalars`) and u32 CRC-32 of the record's
bytes before it. A record's seeds are not stored: they derive from the run seed, the round
and its attempt (:mod:`hiso.core.seeds`). Versions 1 and 2 (hiso before protocol v2: u32
round, u16 n, u32 participants, tau*P u64 seeds, tau*P f32 scalars; version 2 with the CRC)
are still read, so their runs still rebuild; they cannot be continued.

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
VERSION = 3
READABLE = (1, 2, 3)  # versions read_history accepts (1: no checksums; 1 and 2: seeds stored)
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "int4": 4, "int2": 5, "sign": 6}
_HEAD = struct.Struct("<4sBHH")
_HEAD3 = struct.Struct("<BQB")  # scalar dtype, run seed, family name length (then the name)
_REC = struct.Struct("<IH")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class RoundRecord:
    """Round ``round``: seeds (tau, P) uint64, aggregated scalars (tau, P) float32, participants
    and the round's attempt (how often it was planned before: its seeds depend on it)."""

    round: int
    seeds: np.ndarray
    scalars: np.ndarray
    participants: tuple[int, ...] = ()
    attempt: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", np.asarray(self.seeds, dtype=np.uint64))
        object.__setattr__(self, "scalars", np.asarray(self.scalars, dtype=np.float32))
        if self.seeds.ndim != 2 or self.seeds.shape != self.scalars.shape:
            raise ValueError(f"seeds {self.seeds.shape} and scalars {self.scalars.shape} must be equal (tau, P) arrays")


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def encode_record(rec: RoundRecord, scalar_dtype: str = "float32") -> bytes:
    """One record's bytes in the current version, checksum included."""
    from .scalars import encode_scalars
    body = (_varint(rec.round) + _varint(rec.attempt) + _varint(len(rec.participants))
            + b"".join(_varint(int(c)) for c in rec.participants) + encode_scalars(rec.scalars, scalar_dtype))
    return body + _CRC.pack(zlib.crc32(body))


def encode_header(tau: int, P: int, seed: int, scalar_dtype: str, directions: str) -> bytes:
    name = directions.encode("ascii")
    if len(name) > 255:
        raise ValueError("direction family name longer than 255 bytes")
    return _HEAD.pack(MAGIC, VERSION, tau, P) + _HEAD3.pack(DTYPE_CODES[scalar_dtype], seed, len(name)) + name


class HistoryWriter:
    """Appends records to a history file as rounds finish, so a crash loses nothing logged.

    ``keep=None`` (or 0) starts a new file. ``keep=n`` continues an existing one (a resumed run):
    its first ``n`` records are kept and everything after them (later rounds, a torn record)
    is cut off; its header must match (a file of an older version, whose seeds were drawn,
    not derived, is refused). Each record is flushed and, with ``fsync`` (default), on disk
    before :meth:`write` returns. A record whose seeds are not the run's derived ones or
    whose scalars are not values of the scalar dtype is refused (the log must rebuild the run).
    """

    def __init__(self, path: str | Path, tau: int, P: int, *, keep: int | None = None, fsync: bool = True,
                 seed: int = 0, scalar_dtype: str = "float32", directions: str = "philox-rademacher"):
        self.tau, self.P, self.fsync = tau, P, fsync
        self.seed, self.dtype, self.directions = seed, scalar_dtype, directions
        head = encode_header(tau, P, seed, scalar_dtype, directions)
        path = Path(path)
        if not keep:  # a new file (nothing kept: a header a kill cut short is written again whole)
            self._f: BinaryIO = open(path, "wb")
            self._f.write(head)
            self._sync()
            return
        log = parse_history(path)
        if log.version != VERSION:
            raise ValueError(f"{path}: history version {log.version} was written by hiso before protocol v2 (seeds "
                             f"drawn, not derived): `hiso rebuild` still reads it, but the run cannot be continued")
        if (log.tau, log.P) != (tau, P):
            raise ValueError(f"{path}: history has (tau, P) = {(log.tau, log.P)}, expected {(tau, P)}")
        if (log.seed, log.scalar_dtype, log.directions) != (seed, scalar_dtype, directions):
            raise ValueError(f"{path}: history is of run seed {log.seed}, {log.scalar_dtype} scalars, directions "
                             f"{log.directions!r}; expected {seed}, {scalar_dtype}, {directions!r}")
        if keep > len(log.records):
            raise ValueError(f"{path}: holds {len(log.records)} rounds, cannot keep {keep}")
        self._f = open(path, "r+b")
        self._f.truncate(log.ends[keep])
        self._f.seek(log.ends[keep])
        self._sync()

    def _sync(self) -> None:
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def write(self, rec: RoundRecord) -> None:
        from .seeds import round_seeds
        if rec.scalars.shape != (self.tau, self.P):
            raise ValueError(f"record shape {rec.scalars.shape} != {(self.tau, self.P)}")
        if not np.array_equal(rec.seeds, round_seeds(self.seed, rec.round, rec.attempt, self.tau, self.P)):
            raise ValueError(f"record {rec.round}: its seeds are not the run's derived seeds (run seed {self.seed})")
        data = encode_record(rec, self.dtype)
        from .scalars import quantize
        if not np.array_equal(quantize(rec.scalars, self.dtype), rec.scalars):
            raise ValueError(f"record {rec.round}: scalars are not {self.dtype} values (not what was sent)")
        self._f.write(data)
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
    (``ends[0]`` the header's end); ``torn`` the bytes of a dropped torn last record (0: none).
    ``seed``, ``scalar_dtype`` and ``directions`` are the header's (None before version 3)."""

    tau: int
    P: int
    version: int
    records: list[RoundRecord]
    ends: list[int]
    torn: int
    seed: int | None = None
    scalar_dtype: str | None = None
    directions: str | None = None


class _Short(Exception):
    pass


def _get_varint(data: bytes, off: int) -> tuple[int, int]:
    v = shift = 0
    for i in range(10):
        if off + i >= len(data):
            raise _Short
        b = data[off + i]
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, off + i + 1
        shift += 7
    raise ValueError(f"number longer than 10 bytes at byte {off}")


def _parse_v3(path, data: bytes, tau: int, P: int) -> HistoryLog:
    from .scalars import block_size, decode_scalars
    from .seeds import seeds_of
    off = _HEAD.size
    if len(data) < off + _HEAD3.size:
        raise ValueError(f"{path}: truncated header")
    code, seed, ln = _HEAD3.unpack_from(data, off)
    off += _HEAD3.size
    names = {v: k for k, v in DTYPE_CODES.items()}
    if code not in names or len(data) < off + ln:
        raise ValueError(f"{path}: damaged header (scalar dtype code {code})")
    try:
        dtype, family = names[code], data[off:off + ln].decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: damaged header (direction family name not ASCII)") from None
    off += ln
    n, nb = tau * P, block_size(tau * P, dtype)
    rows, ends = [], [off]
    while off < len(data):
        start = off
        try:
            rnd, off = _get_varint(data, off)
            att, off = _get_varint(data, off)
            m, off = _get_varint(data, off)
            parts = []
            for _ in range(m):
                c, off = _get_varint(data, off)
                parts.append(c)
            end = off + nb + _CRC.size
            if end > len(data):
                raise _Short
        except _Short:
            break  # a record cut short: the torn tail of a crash
        if _CRC.unpack_from(data, end - _CRC.size)[0] != zlib.crc32(data[start:end - _CRC.size]):
            if end == len(data):
                break
            raise ValueError(f"{path}: record {len(rows)} (bytes {start}-{end}) fails its checksum: the file is "
                             f"damaged before its end")
        if rnd != len(rows):
            raise ValueError(f"{path}: expected round {len(rows)}, found {rnd}")
        rows.append((rnd, att, tuple(parts), decode_scalars(data, off, n, dtype).reshape(tau, P)))
        off = end
        ends.append(end)
    seeds = seeds_of(seed, [r[0] for r in rows], [r[1] for r in rows], tau, P) if rows else []
    records = [RoundRecord(r, seeds[i], g, parts, att) for i, (r, att, parts, g) in enumerate(rows)]
    return HistoryLog(tau, P, VERSION, records, ends, len(data) - ends[-1], seed, dtype, family)


# what a reader can do about a damaged log: said after what is wrong with it
DAMAGED_HINT = ("the run's log is damaged: restore history.bin from a copy of the run; without it the rounds "
                "cannot be rebuilt, evaluated or resumed (a finished run's model.pt still holds its final model)")


def parse_history(path: str | Path) -> HistoryLog:
    """Read a history file, torn last record dropped (see the module's docstring); ValueError,
    naming what is wrong and what to do, on a damaged one."""
    data = Path(path).read_bytes()
    try:
        return _parse(path, data)
    except ValueError as e:
        raise ValueError(f"{e}; {DAMAGED_HINT}") from None


def _parse(path, data: bytes) -> HistoryLog:
    if len(data) < _HEAD.size:
        raise ValueError(f"{path}: too short to be a hiso history file")
    magic, version, tau, P = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version not in READABLE:
        raise ValueError(f"{path}: not a hiso history file (versions {', '.join(map(str, READABLE))})")
    if version == 3:
        return _parse_v3(path, data, tau, P)
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
