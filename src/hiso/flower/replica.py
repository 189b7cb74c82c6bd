"""A client's replica (x_r, H_r, r) that outlives the short-lived ClientApp process.

Flower starts a fresh ClientApp process for every message, and ``Context.state`` can only
carry records, which Flower copies into and out of that process each time (the whole model,
twice a round). Instead each node keeps its replica in a memory-mapped file under its state
directory: opening it is an ``mmap`` (no read of the model), replaying a round writes the
updated values in place (no rewrite of the file), and while the machine stays up the pages
stay in the kernel's page cache, shared by every ClientApp process of that node. A node
restarted on the same disk finds its replica at the round it last reached.

Layout of ``DIR/<key>/p<partition>/``:

* ``replica.bin``: the trainable tensors in protocol order, then each stage's state (H for HiSo,
  a momentum buffer, a method's own), each 64-byte aligned;
* ``meta.json``: ``{"round", "dirty", "key", "layout"}``, replaced atomically.

``dirty`` is set before the replica is touched and cleared, with the new round, once the
message has been handled. A replica found dirty (the process died mid-update, so the values
may be torn) or written by another run (``key``) is reset to x_0 at round 0: the server then
learns the client's round and sends the whole history. A replica never desyncs silently.
For a tmpfs directory (``/dev/shm``) nothing is written to disk at all, at the price of
catching up from x_0 after a reboot.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..core.state import ModelState
from ..atomic import write_atomic

ALIGN = 64
# fields that do not change the trajectory: a longer run or other logging reuses the replica
_NOT_TRAJECTORY = {"rounds", "eval_every", "threads", "mode", "eval_max", "checkpoint_every"}


def run_key(cfg_json: str, run_id: int | str) -> str:
    """Identity of a trajectory: the configuration the server sent (JSON text, so that both
    sides hash the same bytes whatever their hiso version) plus the Flower run."""
    fields = {k: v for k, v in json.loads(cfg_json).items() if k not in _NOT_TRAJECTORY}
    blob = json.dumps(fields, sort_keys=True) + f"|run={run_id}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_PREFIX = {"h": "h", "momentum": "m"}  # the names replicas made before any other stage kept


def _tensors(state: ModelState) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of everything the replica keeps: the trainable tensors, then each stage's
    state in slot order (H, the momentum buffer, a method's own stage, ...)."""
    tensors = [(n, p) for n, p in state.named]
    for slot, value in state.slots.items():
        prefix = _PREFIX.get(slot, slot)
        if isinstance(value, (list, tuple)):
            tensors += [(f"{prefix}:{n}", t) for (n, _), t in zip(state.named, value)]
        elif isinstance(value, torch.Tensor):
            tensors.append((prefix, value))
    return tensors


def _layout(state: ModelState) -> list[dict]:
    tensors = _tensors(state)
    out, off = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append({"name": name, "offset": off, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                    "nbytes": nbytes})
        off += -(-nbytes // ALIGN) * ALIGN
    return out


class Replica:
    """A :class:`ModelState` whose tensors live in a shared file mapping.

    ``Replica.open(...)`` maps the node's file (creating it at x_0 the first time); use
    ``state`` as any ModelState inside ``with replica.updating():``.
    """

    def __init__(self, path: Path, state: ModelState, key: str, mm: np.memmap, reset_reason: str | None):
        self.path, self.state, self.key, self._mm = path, state, key, mm
        self.reset_reason = reset_reason  # why an existing replica was discarded (None: reused or new)

    @classmethod
    def open(cls, root: str | Path, key: str, partition: int, state: ModelState) -> "Replica":
        """Back ``state`` (freshly built at x_0, round 0) by the node's file for ``key``."""
        path = Path(root) / key / f"p{partition}"
        path.mkdir(parents=True, exist_ok=True)
        layout = _layout(state)
        size = max(sum(-(-e["nbytes"] // ALIGN) * ALIGN for e in layout), ALIGN)
        meta_p, data_p = path / "meta.json", path / "replica.bin"
        reason, meta = None, None
        if meta_p.exists() and data_p.exists():
            try:
                meta = json.loads(meta_p.read_text())
            except ValueError:
                reason = "unreadable meta.json"
            if meta is not None:
                if meta.get("key") != key or meta.get("layout") != layout:
                    reason = "replica of another run or model"
                elif meta.get("dirty"):
                    reason = "interrupted while updating (torn values)"
                elif data_p.stat().st_size != size:
                    reason = "replica file has the wrong size"
        fresh = meta is None or reason is not None
        if fresh:
            with open(data_p, "wb") as f:
                f.truncate(size)
        mm = np.memmap(data_p, dtype=np.uint8, mode="r+", shape=(size,))
        tensors = [t for _, t in _tensors(state)]
        views = []
        for e, t in zip(layout, tensors):
            raw = torch.from_numpy(mm[e["offset"]:e["offset"] + e["nbytes"]])
            v = raw.view(t.dtype).view(t.shape)
            if fresh:
                v.copy_(t.detach())
            views.append(v)
        n = len(state.params)
        with torch.no_grad():
            for p, v in zip(state.params, views[:n]):
                p.data = v
        for slot, value in state.slots.items():  # each stage's state now lives in the mapping too
            if isinstance(value, (list, tuple)):
                state.slots[slot], n = views[n:n + len(value)], n + len(value)
            elif isinstance(value, torch.Tensor):
                state.slots[slot], n = views[n], n + 1
        rep = cls(path, state, key, mm, reason)
        if fresh:
            state.round = 0
            rep._write_meta(dirty=False, layout=layout)
        else:
            state.round = int(meta["round"])
        rep._layout = layout
        return rep

    def _write_meta(self, dirty: bool, layout: list | None = None) -> None:
        layout = layout if layout is not None else self._layout
        write_atomic(self.path / "meta.json", json.dumps({"round": self.state.round, "dirty": dirty, "key": self.key,
                                                          "layout": layout}),
                     sync=os.environ.get("HISO_REPLICA_SYNC") == "1")  # (as the values' flush, commit())

    def begin(self) -> None:
        self._write_meta(dirty=True)

    def commit(self) -> None:
        self._mm.flush() if os.environ.get("HISO_REPLICA_SYNC") == "1" else None
        self._write_meta(dirty=False)

    def close(self) -> None:
        del self._mm
