"""The server's log: for each round, its seeds, aggregated scalars and participants.

The log plus the initial model determine every later model exactly, so it is also the
on-disk description of a fine-tuned model (``history.bin``, a few KB per thousand rounds).

File layout (little-endian): ``b"HSOH"``, u8 version, u16 tau, u16 P, then per record
u32 round, u16 n, n x u32 participants, tau*P x u64 seeds, tau*P x f32 scalars.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"HSOH"
VERSION = 1
_HEAD = struct.Struct("<4sBHH")
_REC = struct.Struct("<IH")


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


class HistoryWriter:
    """Appends records to a history file as rounds finish, so a crash loses nothing logged."""

    def __init__(self, path: str | Path, tau: int, P: int):
        self.tau, self.P = tau, P
        self._f: BinaryIO = open(path, "wb")
        self._f.write(_HEAD.pack(MAGIC, VERSION, tau, P))
        self._f.flush()

    def write(self, rec: RoundRecord) -> None:
        if rec.seeds.shape != (self.tau, self.P):
            raise ValueError(f"record shape {rec.seeds.shape} != {(self.tau, self.P)}")
        parts = np.asarray(rec.participants, dtype="<u4")
        self._f.write(_REC.pack(rec.round, len(parts)) + parts.tobytes()
                      + rec.seeds.astype("<u8").tobytes() + rec.scalars.astype("<f4").tobytes())
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "HistoryWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_history(path: str | Path) -> tuple[int, int, list[RoundRecord]]:
    """Read a history file: (tau, P, records). Raises ValueError on a damaged file."""
    data = Path(path).read_bytes()
    if len(data) < _HEAD.size:
        raise ValueError(f"{path}: too short to be a hiso history file")
    magic, version, tau, P = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"{path}: not a hiso history file (version {VERSION})")
    n = tau * P
    records, off = [], _HEAD.size
    while off < len(data):
        if off + _REC.size > len(data):
            raise ValueError(f"{path}: truncated record header at byte {off}")
        rnd, m = _REC.unpack_from(data, off)
        off += _REC.size
        need = 4 * m + 12 * n
        if off + need > len(data):
            raise ValueError(f"{path}: truncated record for round {rnd}")
        parts = np.frombuffer(data, "<u4", m, off); off += 4 * m
        seeds = np.frombuffer(data, "<u8", n, off).reshape(tau, P); off += 8 * n
        scal = np.frombuffer(data, "<f4", n, off).reshape(tau, P); off += 4 * n
        if rnd != len(records):
            raise ValueError(f"{path}: expected round {len(records)}, found {rnd}")
        records.append(RoundRecord(rnd, seeds.copy(), scal.copy(), tuple(int(c) for c in parts)))
    return tau, P, records


