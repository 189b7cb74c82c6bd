"""Returning to the system the memory a process has freed (glibc keeps freed heap pages resident,
and they count in its peak as if still in use)."""

from __future__ import annotations

import ctypes
import gc
from functools import cache


@cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to return
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def return_freed(collect: bool = False) -> None:
    """Give back the whole free pages of glibc's heaps (``malloc_trim(0)``), after a garbage
    collection if ``collect``; a no-op without glibc."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
