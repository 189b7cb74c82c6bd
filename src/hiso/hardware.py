"""The hardware facts hiso's choices depend on, asked in one place and overridable.

hiso asks four facts: ``amx`` (the CPU has bfloat16 matrix units: ``--autocast auto`` takes bf16
for full-parameter language runs there), ``cuda`` (torch sees a CUDA device: ``--device cuda``,
bf16 on a GPU), ``triton`` (the fused CUDA direction kernels can be imported) and ``avx512`` (torch
runs its AVX-512 kernels; reported only: it is torch's choice, made once at import and switched by
torch's own ``ATEN_CPU_CAPABILITY=avx2|default``).

``$HISO_HARDWARE`` overrides the first three for a process and every process it starts, as
``name=0|1`` pairs separated by commas (``HISO_HARDWARE=amx=1`` runs as a host with AMX would,
``amx=0,cuda=0`` as one with neither). A fact can be reported absent anywhere, but ``cuda`` and
``triton`` only present where they are: claiming a GPU that is not there would fail later and
less clearly. The value is read at every call, so a test may change it with ``monkeypatch.setenv``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

ENV = "HISO_HARDWARE"
FACTS = ("amx", "avx512", "cuda", "triton")
OVERRIDABLE = ("amx", "cuda", "triton")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((l for l in text.splitlines() if l.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def _detected(name: str) -> bool:
    if name == "amx":
        return "amx_bf16" in _cpu_flags()
    import torch

    if name == "avx512":
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if name == "cuda":
        return torch.cuda.is_available()
    return importlib.util.find_spec("triton") is not None  # triton


def overrides(value: str | None = None) -> dict[str, bool]:
    """``$HISO_HARDWARE`` (or ``value``) as {fact: reported}; a malformed entry is a ValueError."""
    value = os.environ.get(ENV, "") if value is None else value
    out: dict[str, bool] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        name, eq, flag = item.partition("=")
        name = name.strip()
        if name == "avx512":
            raise ValueError(f"{ENV}: avx512 is torch's choice, made at import: set ATEN_CPU_CAPABILITY=avx2 "
                             "(or =default) instead")
        if not eq or name not in OVERRIDABLE or flag.strip() not in ("0", "1"):
            raise ValueError(f"{ENV}: {item!r} is not NAME=0 or NAME=1 with NAME one of {', '.join(OVERRIDABLE)}")
        out[name] = flag.strip() == "1"
    return out


def has(name: str) -> bool:
    """Whether fact ``name`` holds here, as ``$HISO_HARDWARE`` reports it where it says."""
    if name not in FACTS:
        raise ValueError(f"unknown hardware fact {name!r} (one of {', '.join(FACTS)})")
    said = overrides().get(name)
    if said is None:
        return _detected(name)
    if said and name in ("cuda", "triton") and not _detected(name):
        raise ValueError(f"{ENV}: {name}=1 claims what this machine lacks (torch sees no CUDA device, or "
                         "Triton is not installed); only amx can be reported present anywhere")
    return said


def bf16_matmul_units(device: str = "cpu") -> bool:
    """Whether bfloat16 forwards are likely faster than float32 on ``device`` (CUDA bf16 or CPU
    AMX): a CPU run on a machine that also has a GPU asks the CPU."""
    if str(device).startswith("cuda"):
        import torch

        return has("cuda") and torch.cuda.is_bf16_supported()
    return has("amx")


def summary() -> str:
    """One line: each fact as this process sees it, and the override if one is set."""
    facts = " ".join(f"{n}={'yes' if has(n) else 'no'}" for n in FACTS)
    said = os.environ.get(ENV)
    chosen = os.environ.get("ATEN_CPU_CAPABILITY")
    return facts + (f" ({ENV}={said})" if said else "") + (f" (ATEN_CPU_CAPABILITY={chosen})" if chosen else "")


if __name__ == "__main__":  # python -m hiso.hardware: what a run on this machine would see
    print(summary())
