"""The paper's metrics of a run, plain functions of a run Dataset (`prefix="particle_"` for the
particles or tokens of the same file), and the β = ∞ reference they are compared with.

- `max_alignment`: max over save times of the alignment with E, ∫|Q_E x|² dρ_t
  (spherepde.analysis.diagnostics), and the first save time where it is reached;
- `f_phase_onset`: the first time after that maximum at which the alignment with F exceeds the
  alignment with E (zero of the difference, linear between save times); NaN if never by t_end;
- `u_curve_minimum`: min over save times of W₂(ρ_t, Π#ρ₀) and its time (the bottom of the
  U-curve: concentration on Π#ρ₀, then departure from it);
- `zero_temperature_reference`: those diagnostics of the exact β = ∞ solution for orthogonal B
  (the push-forward by x ↦ e^{tM}x/|e^{tM}x|).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg

from ..geometry.mesh import HealpixMesh
from .diagnostics import MeasureDiagnostics

__all__ = ["max_alignment", "f_phase_onset", "onset_of", "u_curve_minimum", "value_at", "series", "regular_snapshots",
           "principal_axis", "cell_quadrature_measure", "zero_temperature_push", "zero_temperature_reference",
           "ONSET_TOL"]

ONSET_TOL = 1e-9  # F must exceed E by more than round-off


def regular_snapshots(ds):
    """The regular snapshots of a run Dataset (drops the state at a guard failure)."""
    if "snapshot_kind" in ds.variables:
        keep = np.asarray(ds["snapshot_kind"].values) == 0
        if not keep.all():
            ds = ds.isel(time=np.nonzero(keep)[0])
    return ds


def series(ds, name, prefix=""):
    """(times, values) of the (time,) variable prefix + name over the regular snapshots, as floats."""
    ds = regular_snapshots(ds)
    return np.asarray(ds["time"].values, dtype=float), np.asarray(ds[prefix + name].values, dtype=float)


def first_extremum(ds, name, prefix, nanarg):
    """(the extremum over save times of a series, the first time it is reached); nanarg is
    np.nanargmax or np.nanargmin. NaNs if the series has no finite value."""
    t, s = series(ds, name, prefix)
    if not np.any(np.isfinite(s)):
        return math.nan, math.nan
    k = int(nanarg(s))
    return float(s[k]), float(t[k])


def max_alignment(ds, prefix=""):
    """(max over save times of the alignment with E, the first time it is reached).

    ds: a run Dataset (`spherepde.open_run`); prefix="particle_" for the particles of the same file.
    """
    return first_extremum(ds, "alignment_E", prefix, np.nanargmax)


def f_phase_onset(ds, prefix="", tol=ONSET_TOL):
    """First time after the maximum of the alignment with E at which the alignment with F exceeds
    it: the zero of d = F − E, linear between the save times around the first save with d > tol
    (the save time itself when d > tol already at the maximum). NaN if it does not happen."""
    t, e = series(ds, "alignment_E", prefix)
    _, f = series(ds, "alignment_F", prefix)
    return onset_of(t, e, f, tol)


def onset_of(t, e, f, tol=ONSET_TOL):
    """f_phase_onset on arrays: save times t, alignments e with E and f with F."""
    t, e, f = (np.asarray(a, dtype=float) for a in (t, e, f))
    if not np.any(np.isfinite(e)):
        return math.nan
    k0 = int(np.nanargmax(e))
    d = f - e
    for k in range(k0, t.size):
        if d[k] > tol:
            if k == k0:
                return float(t[k])
            t0, t1, d0, d1 = t[k - 1], t[k], d[k - 1], d[k]
            return float(min(max(t0 + (t1 - t0) * (-d0) / (d1 - d0), t0), t1))
    return math.nan


def u_curve_minimum(ds, prefix=""):
    """(min over save times of W₂(ρ_t, Π#ρ₀), the first time it is reached)."""
    return first_extremum(ds, "w2_to_projection", prefix, np.nanargmin)


def value_at(ds, name, t_query, prefix=""):
    """A diagnostic at time t_query (linear between save times; NaN outside the run)."""
    t, v = series(ds, name, prefix)
    if not (t[0] <= t_query <= t[-1]):
        return math.nan
    return float(np.interp(t_query, t, v))


def principal_axis(points, weights):
    """(unit axis, eigenvalue) of the largest eigenvalue of the second moment ∫ x xᵀ dρ: where a
    measure concentrates up to the sign (eigenvalue 1 exactly when ρ lives on ±axis). The sign is
    chosen with the largest component positive."""
    x = np.asarray(points, dtype=float)
    w = np.asarray(weights, dtype=float)
    w = w / w.sum()
    moment = (x * w[:, None]).T @ x
    vals, vecs = np.linalg.eigh(moment)
    axis = vecs[:, -1]
    if axis[np.argmax(np.abs(axis))] < 0:
        axis = -axis
    return axis, float(vals[-1])


def cell_quadrature_measure(law, nside):
    """(points, weights) of ρ₀ = law on the exact-area cell quadrature (order 2) of HEALPix(nside)."""
    mesh = HealpixMesh(nside)
    pts, qw = mesh.cell_quadrature(2)
    return pts.reshape(-1, 3), (law.cell_averages(mesh)[:, None] * qw[None, :] * mesh.area).ravel()


def zero_temperature_push(model, x0, t):
    """The β = ∞ flow map for orthogonal B: x ↦ e^{tM}x/|e^{tM}x| applied to the rows of x0."""
    y = x0 @ scipy.linalg.expm(float(t) * model.M).T
    return y / np.linalg.norm(y, axis=1, keepdims=True)


def zero_temperature_reference(model, law, times, nside=32):
    """The β = ∞ solution from ρ₀ = law, exactly: the push-forward by x ↦ e^{tM}x/|e^{tM}x| (valid
    when B is orthogonal, so that the time change ds/dt = |e^{sM}x|/|Bᵀe^{sM}x| is 1; None
    otherwise). Returns {alignment_E, alignment_F, w2_to_projection} over times, computed by the
    same diagnostics as the runs on the exact-area cell quadrature of HEALPix(nside)."""
    B = np.asarray(model.B)
    if not np.allclose(B @ B.T, np.eye(3), atol=1e-12):
        return None
    x0, w0 = cell_quadrature_measure(law, nside)
    diag = MeasureDiagnostics(model, x0, w0)
    out = {k: [] for k in ("alignment_E", "alignment_F", "w2_to_projection")}
    for t in times:
        values = diag(zero_temperature_push(model, x0, t), w0, lyapunov_value=0.0)
        for k in out:
            out[k].append(values[k])
    return {k: np.array(v) for k, v in out.items()}
