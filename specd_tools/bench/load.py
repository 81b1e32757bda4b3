"""The machine's load around a benchmark run: numbers measured on a busy machine are slow and
noisy (a rerun can flip a verdict), so `specd bench` and `specd bench serve` print
`busy_warning` beside their numbers when the load was over the usable cores."""

from __future__ import annotations

import os

from coordinator.cluster.config import usable_cpus

__all__ = ["busy_warning", "load_average"]


def load_average() -> float | None:
    """This machine's 1-minute load average (`os.getloadavg`), or None where there is none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_warning(*loads: float | None, cpus: int | None = None) -> str | None:
    """One line when the highest of ``loads`` (1-minute load averages, e.g. at a run's start
    and end; None: unknown) exceeds ``cpus`` (default: `coordinator.cluster.config.usable_cpus`),
    e.g. ``machine busy: load 3.4 on 2 cores; read ratios, not absolute numbers``; else None."""
    known = [load for load in loads if load is not None]
    if cpus is None:
        cpus = usable_cpus()
    if not known or max(known) <= cpus:
        return None
    return (f"machine busy: load {max(known):.1f} on {cpus} cores; read ratios, not absolute "
            f"numbers")
