"""A process's peak resident memory, reset and read (Linux; None or False elsewhere)."""

from __future__ import annotations


def reset_peak_rss() -> bool:
    """Start the peak (VmHWM) over from the current resident size; False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb(field: str = "VmHWM") -> float | None:
    """The peak resident memory since the last reset, in MiB (``field``: another line of
    /proc/self/status, e.g. VmRSS for the current size); None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
