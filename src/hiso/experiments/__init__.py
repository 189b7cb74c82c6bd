"""Experiments over many runs: ``hiso compare`` (plan, run, select, tabulate)."""
