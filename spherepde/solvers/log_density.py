"""The log-density solver: the mean field as g = log f at the cell centroids plus atoms, moved
semi-Lagrangian along the characteristics of the attention field of the whole measure.

State: g (npix,) at the centroids of a HealpixMesh, with f dA + Σ m_k δ_{x_k} the measure; the
cell averages F = ⟨e^ĝ⟩_cell (ĝ the local quadratic fit, spherepde.transport.semi_lagrangian) are
what the sums, the run file and the atoms see. One step of size Δt from t to t + Δt:

1. A, the field (v, div_S v) of the state at t (sources: the centroids with masses F·A and the atoms);
2. a predictor of first order: g* = g(x − Δt v_A(x)) − Δt div v_A(x), x* = x_k + Δt v_A(x_k);
3. B, the field of the predicted state at t + Δt;
4. the corrector, of second order in Δt: g and the atoms move in the field linear in time from
   A (at t) to B (at t + Δt): g by advance_log_density (RK4 paths backward, Simpson on div v),
   the atoms by RK4 forward;
5. atoms are created and merged on the new F (spherepde.solvers.atoms, the divergence of B at
   the centroids); a cell whose average they lower keeps g + log(F_new/F);
6. the measure is rescaled by the factor that restores its initial mass (g += log factor,
   m_k *= factor): the semi-Lagrangian transport is not conservative, the rescale makes the
   mass exact to round-off and, as a common factor of every source, leaves the softmax field
   unchanged. The factor of each step is recorded (mass_defect, the relative mass the
   transport lost or gained since the last snapshot): the transport's conservation error.

Why: g is smooth where f spans decades (f = e^{linear} near the tails, a quadratic near a
resolved peak), so the quadratic fit carries f to relative accuracy where finite volumes in f
smear it by decades (docs/numerics.md, "Tails relative to f"). No CFL condition: Δt is set by
how fast the field changes, and the run is converged in Δt like any time step.

Status: a measured candidate, not used by `spherepde run`. It is cheap, but its bulk is off:
the interpolation does not conserve mass while clusters collapse, and the interpolation error
grows like h³/Δt, so the clusters' offset at t = 5 (β = 30) comes out 13–19 % low at nside 16
(docs/numerics.md, "Tails relative to f"; validation/reports/tails/coupling.md).
"""

from __future__ import annotations

import math
import time as _time

import numpy as np

from ..models.checks import check_model
from ..models.schedule import schedule_of
from ..summation import DEFAULT_TOL
from ..summation.field import attention_field, mesh_sources
from ..transport.semi_lagrangian import PolynomialInterpolant, advance_log_density, unit_rows
from .atoms import Atoms

__all__ = ["LogDensitySolver"]


class LogDensitySolver:
    """Semi-Lagrangian log-density solver (module docstring) for an AttentionModel, a
    MultiHeadModel, a Schedule or a callable t ↦ (B, V, β) (the model of each step's start).

    dt: the time step (snapshot times are hit exactly: a step is cut short to land on them);
    atoms: None (no atoms) or a dict of Atoms options; summation, tolerance: the attention sums
    (spherepde.summation.attention_field)."""

    def __init__(self, mesh, model, dt: float = 0.05, atoms: dict | None = None, summation: str = "auto",
                 tolerance: float = DEFAULT_TOL):
        if not (dt > 0 and math.isfinite(dt)):
            raise ValueError(f"dt: must be a positive number, got {dt!r}")
        self.schedule = schedule_of(model)
        for head in self.schedule.heads or ():
            check_model(head.B, head.V, head.beta)
            if head.zero_temperature:
                raise ValueError("the log-density solver needs a finite beta (at beta = inf the field is local)")
        self.mesh = mesh
        self.dt = float(dt)
        self.summation = summation
        self.tolerance = tolerance
        self.interpolant = PolynomialInterpolant(mesh)
        self.atoms = None if atoms is None else Atoms(mesh, **atoms)
        self.evaluations = 0  # attention sums over all the cells (a measure of cost)
        self.mass0 = None  # the initial mass, set by snapshots

    # ------------------------------------------------------------------ the measure
    def cell_averages(self, g):
        return self.interpolant.cell_averages_of_exp(g)

    def _points(self):
        if self.atoms is None or self.atoms.count == 0:
            return np.empty((0, 3)), np.empty(0)
        return self.atoms.points()

    def field_of(self, t, F, x, m):
        """points ↦ (v, div_S v) of the measure F dA + Σ m_k δ_{x_k} with the model at t."""
        model = self.schedule.model_at(t)
        sources, masses = mesh_sources(self.mesh, F, x, m)

        def field(points):
            self.evaluations += len(points) / self.mesh.npix
            v, div = 0.0, 0.0
            for head in model.heads:
                vh, dh, _ = attention_field(head, sources, masses, points, want_div=True, method=self.summation,
                                            tol=self.tolerance)
                v, div = v + vh, div + dh
            return v, div
        return field

    # ------------------------------------------------------------------ one step
    def step(self, t, g, dt):
        """g at t + dt (a new array); the atoms move, are created and merged in place. Returns
        (g, F, div_S v at the centroids of the predicted state, the mass factor of the rescale)."""
        mesh, centroids = self.mesh, self.interpolant.centroids
        x, m = self._points()
        n = len(x)
        F = self.cell_averages(g)
        A = self.field_of(t, F, x, m)
        vA, dA = A(np.concatenate([centroids, x]))
        departure = unit_rows(centroids - dt * vA[:mesh.npix])
        g_pred = self.interpolant(g, departure) - dt * dA[:mesh.npix]
        x_pred = unit_rows(x + dt * vA[mesh.npix:]) if n else x
        B = self.field_of(t + dt, self.cell_averages(g_pred), x_pred, m)

        def linear(s, points):
            theta = min(max((s - t) / dt, 0.0), 1.0)
            if theta == 0.0:
                return A(points)
            if theta == 1.0:
                return B(points)
            (va, da), (vb, db) = A(points), B(points)
            return (1 - theta) * va + theta * vb, (1 - theta) * da + theta * db

        divergence = {}

        def recording(s, points):  # keeps div v of B at the centroids (the first call, s = t + dt)
            v, div = linear(s, points)
            if s == t + dt and points is centroids:
                divergence["B"] = div
            return v, div

        g_new = advance_log_density(self.interpolant, g, recording, t, dt)
        if n:  # the atoms: RK4 forward in the same field
            k1 = vA[mesh.npix:]
            k2 = linear(t + 0.5 * dt, unit_rows(x + 0.5 * dt * k1))[0]
            k3 = linear(t + 0.5 * dt, unit_rows(x + 0.5 * dt * k2))[0]
            k4 = B(unit_rows(x + dt * k3))[0]
            self.atoms.set_points(unit_rows(x + dt * (k1 + 2 * k2 + 2 * k3 + k4) / 6.0))
        F_new = self.cell_averages(g_new)
        if self.atoms is not None:
            before = F_new.copy()
            self.atoms.create(t + dt, F_new, divergence["B"], F, dt)
            self.atoms.merge()
            lowered = F_new < before
            if lowered.any():  # a centroid value enters its neighbours' fits: average again
                g_new[lowered] += np.log(np.maximum(F_new[lowered], np.finfo(float).tiny) / before[lowered])
                F_new = self.cell_averages(g_new)
        mass = mesh.integrate(F_new) + (0.0 if self.atoms is None else self.atoms.total_mass)
        factor = self.mass0 / mass
        g_new += math.log(factor)
        F_new *= factor
        if self.atoms is not None:
            self.atoms.masses *= factor
        return g_new, F_new, divergence["B"], factor

    # ------------------------------------------------------------------ runs
    def snapshots(self, g0, times):
        """Integrate g from g0 (log f at the centroids at times[0] = 0) through the increasing
        times, yielding (k, t, g, F, record) at each; record: time, mass (mesh + atoms), min f,
        mass_defect (relative mass the transport changed since the last snapshot), evaluations,
        wall seconds."""
        g = np.array(g0, dtype=float)
        if self.atoms is not None:
            self.atoms.restore(np.full((self.atoms.capacity, 3), np.nan), np.zeros(self.atoms.capacity),
                               np.full(self.atoms.capacity, np.nan))
        start = _time.perf_counter()
        t = float(times[0])
        F = self.cell_averages(g)
        self.mass0 = self.mesh.integrate(F)  # the mass every step restores
        defect = 0.0
        for k, target in enumerate(times):
            while t < target - 1e-12 * max(1.0, abs(target)):
                dt = min(self.dt, target - t)
                if target - (t + dt) < 1e-9 * self.dt:
                    dt = target - t
                g, F, _, factor = self.step(t, g, dt)
                defect += 1.0 / factor - 1.0
                t = target if dt == target - t else t + dt
            mass = self.mesh.integrate(F) + (0.0 if self.atoms is None else self.atoms.total_mass)
            yield k, t, g, F, {"time": t, "mass": mass, "min_f": float(F.min()), "mass_defect": defect,
                               "evaluations": self.evaluations, "wall": _time.perf_counter() - start}
            defect = 0.0
