"""A client's cost in a run: its computation per round and its peak memory, so that methods
can be compared at equal client work (``summary.json`` ``client``, ``hiso compare``'s columns).

* **Work per client-round** (one sampled client answering one round): the forwards (model
  evaluations on a minibatch, one per point evaluated) and backpropagations its local update
  ran, counted where they happen (:class:`hiso.core.work.Work`), and the seconds it computed,
  timed by the runner around the client's local work (fast mode: the local update and the
  encoding of its answer; faithful mode and FedKSeed's faithful clients: also decoding the
  downlink and catching up). Each metrics row carries the run's totals so far (``client_answers``,
  ``client_forwards``, ``client_backwards``, ``client_s``: a resumed run goes on from its last
  kept row); ``summary.json`` the means over every answer computed (lost ones included).
* **Peak client memory** = resident + transient. *Resident*: the bytes of what a client keeps
  between rounds, counted from its tensors (the whole model's parameters and buffers, frozen
  ones included; HiSo's H; FedKSeed's copy of x_0). *Transient*: the peak of the tensors
  allocated during one answer above those alive when it starts (activations, shifted copies,
  gradients, directions, the allocator's buffers the answer leaves cached), measured once per
  run on an extra answer before round 1 (its model is left unchanged; it is not timed or
  counted): on CUDA from torch's allocator statistics, on a CPU from the allocation events of
  torch's profiler (``profile_memory``). Neither counts the client's data or the Python and
  torch runtime (a few hundred MB of a process's resident memory; the table's "peak memory"
  column is that process-wide figure).

Under DP (``timed=False``) the seconds and the transient peak are withheld: a client's compute
time and memory depend on its data (a language batch is padded to its longest prompt), and the
run's log is what central DP's epsilon claims to cover. The rows then carry no ``client_s`` and
``summary.json`` null seconds and transient peak; the counts (data-independent) stay.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..core.work import Work
from ..heap import return_freed


def _stored(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a tensor is stored in: a quantized weight's codes and scales (a torchao
    tensor subclass, a bitsandbytes 4-bit parameter's quantization state) or the tensor itself."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        return [x for name in t.__tensor_flatten__()[0] for x in _stored(getattr(t, name))]
    state = getattr(t, "quant_state", None)
    extra = [x for x in vars(state).values() if isinstance(x, torch.Tensor)] if state is not None else []
    return [t, *extra]


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (each storage once: views and tied tensors share one)."""
    seen, total = set(), 0
    for t in (x for tensor in tensors for x in _stored(tensor)):
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def model_bytes(model: torch.nn.Module, extra: Iterable[torch.Tensor] = ()) -> int:
    """Resident bytes of a replica: ``model``'s parameters and buffers, plus ``extra`` tensors (H, x_0)."""
    return tensors_bytes([*model.parameters(), *model.buffers(), *extra])


def replica_bytes(state) -> int:
    """Resident bytes of a :class:`~hiso.core.state.ModelState`: its model and every stage's state
    (H, a momentum buffer, a method's own, e.g. conmezo's m)."""
    slots = [t for slot in getattr(state, "slots", {}).values()
             for t in (slot if isinstance(slot, (list, tuple)) else [slot]) if isinstance(t, torch.Tensor)]
    return model_bytes(state.model, slots)


@contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ side logs its start and stop there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def transient_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> tuple[int | None, str]:
    """Run ``fn()`` and return the peak bytes of tensors allocated on ``device`` during it,
    above those alive when it started, and how they were measured (None: not measurable here)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base), "cuda allocator"
    if device.type != "cpu":
        fn()
        return None, f"not measured on {device.type}"
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
    # only the allocation events: without record functions the profiler keeps no event per op
    # (a quantized base's many small ops made those buffers the process's peak)
    torch.autograd._enable_record_function(False)
    try:
        fn()
    finally:
        torch.autograd._enable_record_function(True)
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    try:
        results = getattr(prof.profiler, "kineto_results", None)
        if results is None:
            return None, "torch profiler without allocation events"
        events = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(results.events())
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    finally:
        del prof
        results = None
        return_freed(collect=True)  # the profiler's events: glibc kept them resident after
    cur = peak = 0
    for _, _, n in sorted(events):
        cur += n
        peak = max(peak, cur)
    return peak, "torch profiler (CPU allocations)"


@dataclass
class ClientCost:
    """The per-client figures a runner gathers (see the module docstring)."""

    answers: int = 0
    forwards: int = 0
    backwards: int = 0
    seconds: float = 0.0
    resident_bytes: int | None = None
    transient_bytes: int | None = None
    memory_how: str = "not measured"
    timed: bool = True  # False under DP: seconds and transient memory withheld (see the module docstring)

    def add(self, work: Work, seconds: float) -> None:
        self.answers += 1
        self.forwards += work.forwards
        self.backwards += work.backwards
        self.seconds += seconds

    ROW = ("client_answers", "client_forwards", "client_backwards", "client_s")

    def row(self) -> dict:
        """The run's totals so far, for a metrics row (a resumed run starts from its last kept row)."""
        row = dict(zip(self.ROW, (self.answers, self.forwards, self.backwards, self.seconds)))
        if not self.timed:
            del row["client_s"]
        return row

    def resume_from(self, row: dict) -> None:
        """Continue the totals of a kept metrics row (rows of runs before these columns: from 0)."""
        self.answers, self.forwards, self.backwards, self.seconds = (
            int(row.get("client_answers", 0)), int(row.get("client_forwards", 0)),
            int(row.get("client_backwards", 0)), float(row.get("client_s", 0.0)))

    def measure(self, answer: Callable[[], object], resident_bytes: int, device) -> None:
        """Resident bytes, and the transient peak of one (untimed, uncounted) ``answer()``."""
        self.resident_bytes = int(resident_bytes)
        if not self.timed:
            self.memory_how = "transient peak withheld under DP (it depends on a client's data)"
            return
        self.transient_bytes, self.memory_how = transient_peak(answer, device)

    def summary(self) -> dict:
        """``summary.json``'s ``client``: means per client-round, and the client's peak memory."""
        n = self.answers
        peak = (None if self.resident_bytes is None or self.transient_bytes is None
                else self.resident_bytes + self.transient_bytes)
        return {"answers": n,
                "forwards_per_round": self.forwards / n if n else None,
                "backwards_per_round": self.backwards / n if n else None,
                "s_per_round": self.seconds / n if n and self.timed else None,
                "resident_bytes": self.resident_bytes, "transient_peak_bytes": self.transient_bytes,
                "peak_bytes": peak, "memory_measured_by": self.memory_how}


class Timer:
    """``with Timer() as t: ...``, then ``t.s``: the seconds inside."""

    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
