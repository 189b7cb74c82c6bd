"""How the report names methods and metrics and shows numbers: display names, metric labels, units."""

from __future__ import annotations

import math

from ..tasks.registry import higher_is_better

METRIC_LABEL = {"eval_acc": "eval accuracy", "eval_loss": "eval loss", "gap": "optimality gap",
                "val_acc": "validation accuracy", "val_loss": "validation loss"}


def display_name(name: str) -> str:
    """A method's name in tables and plots (its registry entry's); a variant's name as it is."""
    from ..methods.registry import method_info
    try:
        return method_info(name).display
    except (ValueError, ImportError):
        return name


def metric_label(metric: str) -> str:
    return METRIC_LABEL.get(metric, metric)


def is_percent(metric: str) -> bool:
    """Shown in %: the accuracy-like metrics (by name)."""
    return higher_is_better(metric)


def human_bytes(n: float | None) -> str:
    """Decimal units, 3 significant digits: 512 B, 1.23 KB, 45.6 MB, 7.89 GB."""
    if n is None or not math.isfinite(n):
        return "—"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 999.5 or unit == "TB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_seconds(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "—"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _fmt_rounds(r: float) -> str:
    return f"{r:,.0f}" if float(r).is_integer() else f"{r:,.1f}"


def _fmt_threshold(t: float, metric: str) -> str:
    return f"{t * 100:.2f}%" if is_percent(metric) else f"{t:.4g}"
