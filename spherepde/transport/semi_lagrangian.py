"""Semi-Lagrangian transport of g = log f along characteristics: accurate relative to f where f is tiny.

Along a path x(s) of the velocity v, d/ds g(x(s), s) = −div_S v(x(s), s) (docs/theory.md, formulas), so

    g(x, t + Δt) = g(X, t) − ∫_t^{t+Δt} div_S v(x(s), s) ds,

X the departure point at t of the path that arrives at x at t + Δt. The values live at the cell
centroids; g at a departure point comes from a local quadratic fit in the tangent plane over the
cell that holds it and its 8 neighbours (`QuadraticInterpolant`): exact for quadratic g, so for
the Gaussian-like and exponential profiles of the tails, whose log f is smooth where f is not.
Paths: the classical Runge–Kutta rule of order 4 backward in time, in R³ on the field extended
by v(x/|x|) (tangent, so |x| is conserved and the final normalisation only removes round-off);
the path's midpoint by the rule's dense output of order 3; the divergence integral by Simpson's
rule on the path. Six field evaluations per step. No CFL condition: Δt is limited only by
how fast the field changes.

The field is a callable (s, points (n, 3)) → (v (n, 3) tangent, div_S v (n,)), in radians and
1/time. Measured against the exact β = ∞ solution: validation/reports/tails/tails.md.
"""

from __future__ import annotations

import healpy as hp
import numpy as np
from numba import njit, prange

__all__ = ["QuadraticInterpolant", "quadratic_interpolate", "advance_log_density", "unit_rows"]

STENCIL = 9  # the cell and its 8 neighbours (7 for the 24 cells with a missing corner neighbour)


@njit(cache=True, parallel=True)
def quadratic_interpolate(values, stencil, fits, e1, e2, centroids, cells, points, limited, out):
    """out[n] = the quadratic fit of values over the stencil of cells[n], at points[n]; limited:
    clipped to the range of the stencil's values (quasi-monotone, Bermejo & Staniforth 1992).

    fits[c] (6, 9) maps the stencil's values to the coefficients of 1, u, v, u², uv, v², with
    (u, v) the gnomonic coordinates of a point in the tangent plane at centroid c (frame e1, e2);
    a missing neighbour (stencil −1) has a zero column.
    """
    for n in prange(points.shape[0]):
        c = cells[n]
        px, py, pz = points[n, 0], points[n, 1], points[n, 2]
        d = px * centroids[c, 0] + py * centroids[c, 1] + pz * centroids[c, 2]
        u = (px * e1[c, 0] + py * e1[c, 1] + pz * e1[c, 2]) / d
        v = (px * e2[c, 0] + py * e2[c, 1] + pz * e2[c, 2]) / d
        basis = (1.0, u, v, u * u, u * v, v * v)
        total = 0.0
        low, high = np.inf, -np.inf
        for j in range(stencil.shape[1]):
            s = stencil[c, j]
            if s < 0:
                continue
            weight = 0.0
            for k in range(6):
                weight += basis[k] * fits[c, k, j]
            total += weight * values[s]
            low, high = min(low, values[s]), max(high, values[s])
        # limited: no value outside the stencil's range, so a steep g (beside an atom, at a cut)
        # is never extrapolated into a spurious peak; it costs the exactness for quadratics
        out[n] = min(max(total, low), high) if limited else total


def _frames(centroids):
    """A tangent frame (e1, e2) at each centroid."""
    ref = np.where(np.abs(centroids[:, 2:3]) < 0.9, np.array([[0.0, 0.0, 1.0]]), np.array([[1.0, 0.0, 0.0]]))
    e1 = np.cross(ref, centroids)
    e1 /= np.linalg.norm(e1, axis=1, keepdims=True)
    return e1, np.cross(centroids, e1)


class QuadraticInterpolant:
    """Values at the cell centroids of a HealpixMesh, interpolated at any points of S² by local
    quadratic least squares (module docstring); the fits are computed once per mesh. limited:
    every interpolated value (and every value of cell_averages_of_exp's fits) is clipped to the
    range of its stencil (quadratic_interpolate)."""

    def __init__(self, mesh, limited: bool = False):
        self.mesh = mesh
        self.limited = bool(limited)
        npix = mesh.npix
        self.centroids = np.ascontiguousarray(mesh.centroids)
        self.e1, self.e2 = _frames(self.centroids)
        neighbours = hp.get_all_neighbours(mesh.nside, np.arange(npix), nest=True).T
        self.stencil = np.ascontiguousarray(np.concatenate([np.arange(npix)[:, None], neighbours], axis=1),
                                            dtype=np.int64)
        points = self.centroids[np.maximum(self.stencil, 0)]  # (npix, 9, 3)
        c = self.centroids[:, None, :]
        d = np.sum(points * c, axis=2)
        u = np.sum(points * self.e1[:, None, :], axis=2) / d
        v = np.sum(points * self.e2[:, None, :], axis=2) / d
        design = np.stack([np.ones_like(u), u, v, u * u, u * v, v * v], axis=2)
        design[self.stencil < 0] = 0.0
        self.fits = np.ascontiguousarray(np.linalg.pinv(design))  # (npix, 6, 9)
        self._order = None  # the cell quadrature of cell_averages_of_exp, built on first use

    def cell_averages_of_exp(self, g, order: int = 3):
        """Cell averages of e^{ĝ}, ĝ each cell's own quadratic fit of the centroid values g, by the
        cell's exact-area quadrature (spherepde.geometry.mesh.cell_quadrature): the cell averages
        of f = e^{g} that a finite-volume scheme holds, accurate relative to f where g is smooth."""
        if self._order != order:
            points, self._qweights = self.mesh.cell_quadrature(order)  # (npix, m, 3), (m,)
            c = self.centroids[:, None, :]
            d = np.sum(points * c, axis=2)
            u = np.sum(points * self.e1[:, None, :], axis=2) / d
            v = np.sum(points * self.e2[:, None, :], axis=2) / d
            basis = np.stack([np.ones_like(u), u, v, u * u, u * v, v * v], axis=2)  # (npix, m, 6)
            self._at_quadrature = np.einsum("cmk,ckj->cmj", basis, self.fits)  # (npix, m, 9)
            self._order = order
        g = np.asarray(g, dtype=float)
        local = np.where(self.stencil >= 0, g[np.maximum(self.stencil, 0)], 0.0)
        values = np.einsum("cmj,cj->cm", self._at_quadrature, local)
        if self.limited:
            inside = np.where(self.stencil >= 0, g[np.maximum(self.stencil, 0)], g[:, None])
            values = np.clip(values, inside.min(axis=1)[:, None], inside.max(axis=1)[:, None])
        return np.exp(values) @ self._qweights

    def cells_of(self, points):
        return hp.vec2pix(self.mesh.nside, points[:, 0], points[:, 1], points[:, 2], nest=True).astype(np.int64)

    def __call__(self, values, points, out=None):
        points = np.ascontiguousarray(points, dtype=float)
        out = np.empty(points.shape[0]) if out is None else out
        quadratic_interpolate(np.ascontiguousarray(values, dtype=float), self.stencil, self.fits, self.e1, self.e2,
                              self.centroids, self.cells_of(points), points, self.limited, out)
        return out


def advance_log_density(interpolant, g, field, t, dt):
    """g at the centroids at t + dt from g at t (module docstring). field(s, points) → (v, div)."""
    x = interpolant.centroids
    h = -dt  # backward in time, from the arrival at t + dt
    k1, div1 = field(t + dt, x)
    k2 = field(t + 0.5 * dt, unit_rows(x + 0.5 * h * k1))[0]
    k3 = field(t + 0.5 * dt, unit_rows(x + 0.5 * h * k2))[0]
    k4 = field(t, unit_rows(x + h * k3))[0]
    departure = unit_rows(x + h * (k1 + 2.0 * k2 + 2.0 * k3 + k4) / 6.0)
    # dense output at θ = 1/2: weights 5/24, 1/6, 1/6, −1/24
    middle = unit_rows(x + h * (5.0 * k1 + 4.0 * k2 + 4.0 * k3 - k4) / 24.0)
    _, divm = field(t + 0.5 * dt, middle)
    _, div0 = field(t, departure)
    integral = dt * (div0 + 4.0 * divm + div1) / 6.0  # Simpson on the path
    return interpolant(g, departure) - integral


def unit_rows(x):
    """The rows of x (n, 3) normalised to unit length."""
    return x / np.linalg.norm(x, axis=1, keepdims=True)
