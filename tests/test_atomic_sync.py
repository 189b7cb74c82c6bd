"""The atomic writers make a write durable, not only whole (hiso.atomic): the temporary file is
fsynced before the rename and its directory after, for write_atomic and save_atomic alike. The
crash test replaces fsync with a no-op (a killed process loses nothing the OS holds), so the
calls are recorded here."""

import os
from pathlib import Path

import pytest
import torch

from hiso.atomic import save_atomic, torch_tmp, write_atomic


@pytest.fixture
def calls(monkeypatch):
    """[("fsync", path the descriptor names), ("replace", src, dst)] in the order they happen."""
    out, fsync, replace = [], os.fsync, os.replace

    def rec_fsync(fd):
        out.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def rec_replace(src, dst):
        out.append(("replace", str(src), str(dst)))
        return replace(src, dst)
    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "replace", rec_replace)
    return out


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor")
@pytest.mark.parametrize("how", ["text", "torch"])
def test_the_file_is_fsynced_before_the_rename_and_its_directory_after(tmp_path, calls, how):
    path = tmp_path / ("a.json" if how == "text" else "m.pt")
    if how == "text":
        write_atomic(path, "{}")
        tmp = path.with_name(path.name + ".tmp")
    else:
        save_atomic(path, {"x": torch.zeros(2)})
        tmp = torch_tmp(path)
    assert calls == [("fsync", str(tmp)), ("replace", str(tmp), str(path)), ("fsync", str(tmp_path))]


def test_sync_false_skips_both(tmp_path, calls):
    write_atomic(tmp_path / "s", b"x", sync=False)
    assert [c[0] for c in calls] == ["replace"]
