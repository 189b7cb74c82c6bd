"""Whole-file writes that a crash or a full disk cannot leave half done.

Every file hiso writes whole goes through :func:`write_atomic` (text or bytes) or
:func:`save_atomic` (a ``torch.save`` object): the content is written to ``NAME.tmp`` (``STEM.tmp`` for
torch's, :func:`torch_tmp`) in the same directory, flushed and fsynced, then renamed over ``NAME`` (``os.replace``, atomic on POSIX) and
the directory fsynced, so a SIGKILL at any byte leaves the old file or the new one (and at worst a
stale ``NAME.tmp``, which the next write replaces). A write that fails (``ENOSPC``) removes its
temporary file and leaves ``NAME`` as it was. Append-only logs (``history.bin``, ``metrics.jsonl``)
are not rewritten: their readers drop a torn last record instead.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # what a full disk (or a quota or size limit) raises


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a write refused for want of space (a full disk, quota or file size limit)."""
    return isinstance(e, OSError) and e.errno in FULL


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in directory ``path`` durable (a no-op where it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_with(path: str | Path, fill: Callable, mode: int | None, sync: bool = True) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with open(fd, "wb") as f:
            fill(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # (an older tmp file of another mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)


def write_atomic(path: str | Path, data: str | bytes, mode: int | None = None, sync: bool = True) -> None:
    """Replace ``path`` by ``data`` whole (a crash leaves the old file or the new one); ``mode``:
    its permissions from the start (a secret is never readable by others, even as ``.tmp``).
    ``sync=False``: no fsync (whole against a killed process, not against a power loss), for a
    file rewritten every round whose loss costs a replay, not a result (a Flower node's state)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    _replace_with(path, lambda f: f.write(raw), mode, sync)


def torch_tmp(path: str | Path) -> Path:
    """Where :func:`save_atomic` writes ``path`` first: ``STEM.tmp`` beside it (torch names the
    archive inside a file after its stem, so this gives the bytes ``torch.save(obj, path)`` does)."""
    path = Path(path)
    return path.with_name(path.stem + ".tmp")


def save_atomic(path: str | Path, obj) -> None:
    """``torch.save(obj, path)``, atomically (see :func:`write_atomic`), byte for byte the file
    ``torch.save(obj, path)`` writes."""
    import torch
    path, tmp = Path(path), torch_tmp(path)
    try:
        torch.save(obj, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
