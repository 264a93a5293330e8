"""Snapshot times of a run."""

from __future__ import annotations

import math

__all__ = ["save_times", "progress_bar", "segments", "with_breaks", "BREAK_RTOL"]

# a switch time closer than this (relative to max(1, |t|)) to the end of an interval is that end:
# the solvers then take no round-off sliver of a step before or after it
BREAK_RTOL = 1e-9


def save_times(t_end: float, save_every: float) -> list[float]:
    """0, save_every, 2·save_every, …, t_end: t_end always included, no round-off sliver before it.
    Raises ValueError unless t_end > 0 and 0 < save_every ≤ t_end (finite)."""
    if not (math.isfinite(t_end) and t_end > 0):
        raise ValueError(f"t_end must be a positive number, got {t_end!r}")
    if not (math.isfinite(save_every) and 0 < save_every <= t_end):
        raise ValueError(f"save_every must be in (0, t_end], got {save_every!r}")
    n = int(math.floor(t_end / save_every + 1e-9))
    times = [k * save_every for k in range(n + 1)]
    if t_end - times[-1] > 1e-9 * t_end:
        times.append(t_end)
    else:
        times[-1] = t_end  # absorb the round-off of n·save_every
    return times


def segments(t0: float, t1: float, breaks=()) -> list[tuple[float, float]]:
    """[t0, t1] cut at the break times strictly inside it (switch times of a Schedule), as
    consecutive (start, end) pairs: a solver that advances to each end exactly lands a step on
    every break. Breaks within BREAK_RTOL of t0 or t1 are taken as t0 or t1. No breaks: [(t0, t1)]."""
    tol = BREAK_RTOL * max(1.0, abs(t0), abs(t1))
    inner = sorted(b for b in breaks if t0 + tol < b < t1 - tol)
    ends = [t0, *inner, t1]
    return list(zip(ends[:-1], ends[1:]))


def with_breaks(times, breaks) -> list[float]:
    """The snapshot times with the break times (switch times) in (times[0], times[-1]) added; a
    break within BREAK_RTOL·t_end of a snapshot time replaces it (so the snapshot is exactly at the
    switch)."""
    times = [float(t) for t in times]
    tol = BREAK_RTOL * max(1.0, abs(times[-1]))
    for b in breaks:
        b = float(b)
        if not times[0] < b < times[-1] + tol:
            continue
        k = min(range(len(times)), key=lambda i: abs(times[i] - b))
        if abs(times[k] - b) <= tol:
            if k > 0 and k < len(times) - 1:
                times[k] = b
        else:
            times.append(b)
    return sorted(times)


def progress_bar(t_end: float):
    """A tqdm bar on simulation time (update with bar.update(dt))."""
    from tqdm import tqdm

    return tqdm(total=t_end, unit="t", bar_format="{l_bar}{bar}| t={n:.3f}/{total:.3f} [{elapsed}<{remaining}]")
