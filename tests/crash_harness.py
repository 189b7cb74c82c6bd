"""Kill a `hiso run` at its n-th write, in process, leaving exactly what SIGKILL would leave.

Every file opened for writing under the run directory is wrapped: each ``write``,
``truncate``, ``os.replace`` and ``os.unlink`` there is an *event*, and so is a ``torch.save`` to
a path there (torch writes it from C++: killed there, the file is cut at a random byte). At event ``at`` the wrapper
writes a random prefix of that write's bytes (flushing what Python buffered, or not), copies the
directory as the OS holds it to ``snap`` (a process killed there leaves this), and raises
:class:`Killed`, which no ``except Exception`` catches. ``full=True`` instead makes that write and
every later one fail with ``ENOSPC``, as a disk that filled. Used by tests/test_crash.py and
bench/crash_trials.py.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import random
import shutil
from pathlib import Path


class Killed(BaseException):
    """The simulated SIGKILL."""


class _File:
    def __init__(self, crash: "Crash", f):
        self._crash, self._f = crash, f

    def write(self, data):
        self._crash.event(self._f, data)
        return self._f.write(data)

    def truncate(self, *a):
        self._crash.event(self._f, None)
        return self._f.truncate(*a)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


class Crash:
    """Count the write events under ``root``; at event ``at`` (None: never) die, or fail with a
    full disk (``full``). ``events``: how many were seen."""

    def __init__(self, root, at: int | None, snap=None, seed: int = 0, full: bool = False):
        self.root, self.at, self.snap, self.full = str(Path(root).resolve()), at, snap, full
        self.rng, self.events, self.dead = random.Random(seed), 0, False

    def _ours(self, file) -> bool:
        try:
            name = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.path.abspath(file)
        except (OSError, TypeError):
            return False
        return str(name).startswith(self.root + os.sep)

    def event(self, f=None, data=None) -> None:
        if self.dead:
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(f, "name", None))
            return
        n, self.events = self.events, self.events + 1
        if n != self.at:
            return
        self.dead = True
        if f is not None and data:
            cut = data[:self.rng.randrange(len(data))]
            if cut:
                f.write(cut)
            if self.full or self.rng.random() < 0.5:
                try:
                    f.flush()
                except (OSError, ValueError):
                    pass
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(f, "name", None))
        shutil.copytree(self.root, self.snap)
        raise Killed

    def __enter__(self) -> "Crash":
        import torch
        self._saved = builtins.open, io.open, os.replace, os.unlink, torch.save
        real_open, real_replace, real_unlink, real_save = builtins.open, os.replace, os.unlink, torch.save

        def save(obj, f, *a, **k):
            if not isinstance(f, (str, os.PathLike)) or not self._ours(f) or self.dead:
                return real_save(obj, f, *a, **k)
            if self.events == self.at and not self.full:  # killed while torch writes it: cut short
                real_save(obj, f, *a, **k)
                os.truncate(f, self.rng.randrange(os.path.getsize(f)))
            self.event()
            return real_save(obj, f, *a, **k)

        def open_(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            writes = any(c in mode for c in "wax+")
            return _File(self, f) if writes and self._ours(file) else f

        def replace(src, dst, *a, **k):
            if self._ours(dst):
                self.event()
            return real_replace(src, dst, *a, **k)

        def unlink(path, *a, **k):
            if self._ours(path):
                self.event()
            return real_unlink(path, *a, **k)

        builtins.open = io.open = open_
        os.replace, os.unlink, torch.save = replace, unlink, save
        return self

    def __exit__(self, *exc) -> None:
        import torch
        builtins.open, io.open, os.replace, os.unlink, torch.save = self._saved
