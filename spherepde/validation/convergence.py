"""Mesh-convergence cells of the validation reports: a quantity on nside N, 2N, 4N, the
differences between successive meshes and the observed order log₂(|d₁|/|d₂|).

The order is certified only when the two differences have the same sign (a sequence that
converges monotonically at its asymptotic rate); otherwise the cell says *not monotone*.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["order", "order_text", "number_text", "convergence_cells", "by_law_and_beta", "METRICS"]


def order(a, b, c):
    """Observed order log₂(|b − a| / |c − b|) of a sequence at h, h/2, h/4; NaN if undefined or
    if the differences change sign (not a convergent sequence yet)."""
    d1, d2 = b - a, c - b
    if not (np.isfinite(d1) and np.isfinite(d2)) or d2 == 0 or d1 == 0 or (d1 > 0) != (d2 > 0):
        return math.nan
    return math.log2(abs(d1) / abs(d2))


def order_text(values):
    """The order cell of a table row: the observed order, 'not monotone', or — (< 3 values)."""
    if len(values) < 3:
        return "—"
    value = order(*values[-3:])
    if np.isfinite(value):
        return f"{value:.1f}"
    return "not monotone" if all(np.isfinite(values[-3:])) else "—"


def number_text(x, digits=4):
    """x to `digits` decimals; — for None or NaN (e.g. an F-onset that did not happen)."""
    return "—" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def convergence_cells(values):
    """Cells 'v16 / v32 / v64', 'differences', 'order' of {nside: value}."""
    ns = sorted(values)
    vals = [values[n] for n in ns]
    diffs = [b - a for a, b in zip(vals, vals[1:])]
    diff_text = ", ".join(f"{d:+.2e}" if np.isfinite(d) else "—" for d in diffs)
    return (" / ".join(number_text(v) for v in vals), diff_text or "—", order_text(vals))


def by_law_and_beta(cases):
    """{(law, β): {nside: Case}} of cases with an Eulerian mesh."""
    out = {}
    for c in cases:
        out.setdefault((c.law, c.beta), {})[c.nside] = c
    return out


# the paper's three questions, picked from a Case's metrics of one solver
METRICS = (("F-onset", lambda m: m["onset"]), ("max alignment with E", lambda m: m["max_E"][0]),
           ("min W₂(ρ_t, Π#ρ₀)", lambda m: m["w2_min"][0]))
