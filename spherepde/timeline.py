"""Snapshot times of a run."""

from __future__ import annotations

import math

__all__ = ["save_times", "progress_bar"]


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


def progress_bar(t_end: float):
    """A tqdm bar on simulation time (update with bar.update(dt))."""
    from tqdm import tqdm

    return tqdm(total=t_end, unit="t", bar_format="{l_bar}{bar}| t={n:.3f}/{total:.3f} [{elapsed}<{remaining}]")
