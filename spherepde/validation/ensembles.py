"""Token ensembles: a metric of n i.i.d. tokens over seeds, as a mean and its 95 % interval.

The F-onset of n tokens is a random variable: the sample's offset from the symmetric state
(∝ 1/√n) is what grows into the F-phase, so one seed gives one draw. Over k seeds the report
gives the mean and the half-width t_{0.975, k−1}·s/√k of its 95 % confidence interval (Student
t, s the sample standard deviation), and for the F-onset how many seeds had one by t_end: the
mean is over those, and a seed without onset is reported, not averaged in as t_end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "interval", "group_by", "interval_text", "onset_text"]


@dataclass(frozen=True)
class Interval:
    """mean ± half_width (95 %) over count values; half_width NaN for a single value."""

    mean: float
    half_width: float
    count: int
    std: float

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width


def interval(values) -> Interval:
    """Mean and 95 % Student-t confidence half-width of the finite values (count 0: NaN)."""
    from scipy import stats

    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    k = v.size
    if k == 0:
        return Interval(math.nan, math.nan, 0, math.nan)
    if k == 1:
        return Interval(float(v[0]), math.nan, 1, math.nan)
    s = float(np.std(v, ddof=1))
    return Interval(float(v.mean()), float(stats.t.ppf(0.975, k - 1) * s / math.sqrt(k)), k, s)


def group_by(items, key):
    """{key(item): [items]} in first-seen order."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def interval_text(iv: Interval, digits=3) -> str:
    if iv.count == 0:
        return "—"
    if iv.count == 1:
        return f"{iv.mean:.{digits}f} (1 seed)"
    return f"{iv.mean:.{digits}f} ± {iv.half_width:.{digits}f}"


def onset_text(onsets, digits=2) -> str:
    """'mean ± half-width (k of m)' over the seeds with an onset; 'none (0 of m)'."""
    m = len(onsets)
    iv = interval(onsets)
    if iv.count == 0:
        return f"none (0 of {m})"
    return f"{interval_text(iv, digits)} ({iv.count} of {m})"
