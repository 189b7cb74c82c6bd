"""Snapshots: a replica's whole state as raw bytes, what a client that missed too many rounds
gets instead of their records (kind 4 of the table in :mod:`hiso.core.messages`)."""

from __future__ import annotations

import torch

from .wire import MessageError


def _state_tensors(state) -> list[torch.Tensor]:
    """What a snapshot carries: the trainable tensors, then each stage's state in the replica's
    slot order (H for HiSo, the server momentum's buffer, a method's own stage, the step
    normalisation's float64 (v, w)), in protocol order."""
    out = list(state.params)
    for slot in getattr(state, "slots", {}).values():
        if slot is not None:
            out += list(slot) if isinstance(slot, (list, tuple)) else [slot]
    return out


def state_size(state) -> int:
    """Bytes of :func:`encode_state` for this replica (its trainable tensors and H)."""
    return sum(t.numel() * t.element_size() for t in _state_tensors(state))


def encode_state(state) -> bytes:
    """The replica's trainable tensors (raw, protocol order), then H: what a snapshot carries.
    For LoRA that is the adapter only (the frozen base is not trainable)."""
    return b"".join(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for t in _state_tensors(state))


def load_state(state, payload: bytes, round: int) -> None:
    """Replace the replica's tensors (and H) by a snapshot's, bit for bit, and set its round.
    Everything is checked (size, finiteness) before the first tensor is written."""
    tensors = _state_tensors(state)
    want = state_size(state)
    if len(payload) != want:
        raise MessageError(f"snapshot of {len(payload)} bytes, but this client's model and H take {want} bytes "
                           f"(another model?)")
    parts, off = [], 0
    for t in tensors:
        nb = t.numel() * t.element_size()
        v = torch.frombuffer(bytearray(payload[off:off + nb]), dtype=torch.uint8).view(t.dtype).reshape(t.shape) \
            if nb else torch.empty(t.shape, dtype=t.dtype)
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise MessageError(f"snapshot for round {round}: non-finite values")
        parts.append(v)
        off += nb
    with torch.no_grad():
        for t, v in zip(tensors, parts):
            t.copy_(v)
    state.round = round
