"""Semi-Lagrangian transport of g = log f along characteristics: accurate relative to f where f is tiny.

Along a path x(s) of the velocity v, d/ds g(x(s), s) = −div_S v(x(s), s) (docs/theory.md, formulas), so

    g(x, t + Δt) = g(X, t) − ∫_t^{t+Δt} div_S v(x(s), s) ds,

X the departure point at t of the path that arrives at x at t + Δt. The values live at the cell
centroids; g at a departure point comes from a local polynomial fit in the tangent plane over the
cell that holds it and its neighbours (`PolynomialInterpolant`; degree 2 over 9 cells by default,
degree 3 over 25): exact for polynomial g of that degree, so for the Gaussian-like and exponential
profiles of the tails, whose log f is smooth where f is not.
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

__all__ = ["PolynomialInterpolant", "polynomial_interpolate", "monomials", "advance_log_density", "trace_back", "compose_paths", "unit_rows",
           "PATH_SCHEMES"]


@njit(cache=True, parallel=True)
def polynomial_interpolate(values, stencil, fits, basis, cells, limited, out):
    """out[n] = the polynomial fit of values over the stencil of cells[n], at the point whose
    monomials (1, u, v, u², uv, v², …, `monomials`) are basis[n]; limited: clipped to the range of
    the stencil's values (quasi-monotone, Bermejo & Staniforth 1992).

    fits[c] (terms, width) maps the stencil's values to the coefficients of the monomials in the
    gnomonic coordinates (u, v) of the tangent plane at centroid c; a missing stencil entry (−1)
    has a zero column.
    """
    for n in prange(basis.shape[0]):
        c = cells[n]
        total = 0.0
        low, high = np.inf, -np.inf
        for j in range(stencil.shape[1]):
            s = stencil[c, j]
            if s < 0:
                continue
            weight = 0.0
            for k in range(basis.shape[1]):
                weight += basis[n, k] * fits[c, k, j]
            total += weight * values[s]
            low, high = min(low, values[s]), max(high, values[s])
        # limited: no value outside the stencil's range, so a steep g (beside an atom, at a cut)
        # is never extrapolated into a spurious peak; it costs the exactness for polynomials
        out[n] = min(max(total, low), high) if limited else total


def monomials(u, v, degree):
    """(…, terms) array of the monomials u^(p−i) v^i, p = 0 … degree, i = 0 … p, in that order
    (1, u, v, u², uv, v², u³, …): (degree + 1)(degree + 2)/2 terms."""
    return np.stack([u ** (p - i) * v ** i for p in range(degree + 1) for i in range(p + 1)], axis=-1)


def _frames(centroids):
    """A tangent frame (e1, e2) at each centroid."""
    ref = np.where(np.abs(centroids[:, 2:3]) < 0.9, np.array([[0.0, 0.0, 1.0]]), np.array([[1.0, 0.0, 0.0]]))
    e1 = np.cross(ref, centroids)
    e1 /= np.linalg.norm(e1, axis=1, keepdims=True)
    return e1, np.cross(centroids, e1)


def _stencils(nside, rings):
    """(npix, width) NESTED cells: each cell, then its neighbours out to `rings` rings (−1 pads
    the rows of cells with fewer, next to the 8 vertices where 3 base faces meet)."""
    npix = hp.nside2npix(nside)
    rows = np.arange(npix)[:, None]
    if rings == 1:  # healpy's order (SW, W, NW, N, NE, E, SE, S), −1 where a corner neighbour is missing
        neighbours = hp.get_all_neighbours(nside, np.arange(npix), nest=True).T
        return np.ascontiguousarray(np.concatenate([rows, neighbours], axis=1), dtype=np.int64)
    for _ in range(rings):
        ring = hp.get_all_neighbours(nside, np.maximum(rows, 0).ravel(), nest=True).T.reshape(npix, -1)
        ring[np.repeat(rows < 0, 8, axis=1)] = -1
        rows = np.concatenate([rows, ring], axis=1)
    unique = [np.concatenate([[c], np.setdiff1d(np.unique(row[row >= 0]), [c])]) for c, row in enumerate(rows)]
    width = max(len(u) for u in unique)
    out = np.full((npix, width), -1, dtype=np.int64)
    for c, u in enumerate(unique):
        out[c, :len(u)] = u
    return out


class PolynomialInterpolant:
    """Values at the cell centroids of a HealpixMesh, interpolated at any points of S² by local
    polynomial least squares (module docstring): degree 2 over the cell and its 8 neighbours,
    degree 3 over two rings of neighbours (25 cells); the fits are computed once per mesh.
    limited: every interpolated value (and every value of cell_averages_of_exp's fits) is
    clipped to the range of its stencil (polynomial_interpolate)."""

    def __init__(self, mesh, degree: int = 2, limited: bool = False):
        if degree not in (2, 3):
            raise ValueError(f"degree must be 2 or 3, got {degree!r}")
        self.mesh, self.degree = mesh, int(degree)
        self.limited = bool(limited)
        self.centroids = np.ascontiguousarray(mesh.centroids)
        self.e1, self.e2 = _frames(self.centroids)
        self.stencil = _stencils(mesh.nside, degree - 1)
        points = self.centroids[np.maximum(self.stencil, 0)]  # (npix, width, 3)
        design = self._monomials_at(points, np.arange(mesh.npix)[:, None])
        design[self.stencil < 0] = 0.0
        self.fits = np.ascontiguousarray(np.linalg.pinv(design))  # (npix, terms, width)
        self._order = None  # the cell quadrature of cell_averages_of_exp, built on first use
        self._vertices = None  # the cell corners of the limited slopes, built on first use

    def _monomials_at(self, points, cells):
        """The monomials of the gnomonic coordinates of points (…, 3) in the tangent planes of
        cells (broadcast against points' leading axes)."""
        c = self.centroids[cells]
        d = np.sum(points * c, axis=-1)
        u = np.sum(points * self.e1[cells], axis=-1) / d
        v = np.sum(points * self.e2[cells], axis=-1) / d
        return monomials(u, v, self.degree)

    def cell_averages_of_exp(self, g, order: int = 3):
        """Cell averages of e^{ĝ}, ĝ each cell's own polynomial fit of the centroid values g, by the
        cell's exact-area quadrature (spherepde.geometry.mesh.cell_quadrature): the cell averages
        of f = e^{g} that a finite-volume scheme holds, accurate relative to f where g is smooth."""
        if self._order != order:
            points, self._qweights = self.mesh.cell_quadrature(order)  # (npix, m, 3), (m,)
            basis = self._monomials_at(points, np.arange(self.mesh.npix)[:, None])  # (npix, m, terms)
            self._at_quadrature = np.einsum("cmk,ckj->cmj", basis, self.fits)  # (npix, m, width)
            self._order = order
        g = np.asarray(g, dtype=float)
        local = np.where(self.stencil >= 0, g[np.maximum(self.stencil, 0)], 0.0)
        values = np.einsum("cmj,cj->cm", self._at_quadrature, local)
        if self.limited:
            inside = np.where(self.stencil >= 0, g[np.maximum(self.stencil, 0)], g[:, None])
            values = np.clip(values, inside.min(axis=1)[:, None], inside.max(axis=1)[:, None])
        return np.exp(values) @ self._qweights

    def slopes(self, values, limited: bool = True, cells=None):
        """(npix, 3) tangent gradient at each centroid of the cell's own fit of the centroid values:
        ∇ĝ(y_c) = ĝ_u e₁ + ĝ_v e₂ (the gnomonic coordinates are arc lengths to first order), in
        units of values per radian. limited (Barth & Jespersen 1989): scaled by α ∈ [0, 1] so that
        the linear profile v_c + ⟨∇ĝ, y − y_c⟩ stays at the cell's four vertices within the range
        of the stencil's values; linear data is left unlimited (each vertex lies between centroids).
        A stencil with a non-finite value gives a zero slope. cells: compute these rows only (the
        others are 0)."""
        values = np.asarray(values, dtype=float)
        rows = np.arange(self.mesh.npix) if cells is None else np.asarray(cells, dtype=np.int64)
        stencil = self.stencil[rows]
        local = np.where(stencil >= 0, values[np.maximum(stencil, 0)], values[rows, None])
        coefficients = np.einsum("ckj,cj->ck", self.fits[rows, 1:3, :], np.where(stencil >= 0, local, 0.0))
        slopes = coefficients[:, :1] * self.e1[rows] + coefficients[:, 1:2] * self.e2[rows]
        finite = np.isfinite(local).all(axis=1)
        slopes[~finite] = 0.0
        if limited:
            if self._vertices is None:  # (npix, 4, 3) cell corners, computed once
                corners = hp.boundaries(self.mesh.nside, np.arange(self.mesh.npix), step=1, nest=True)
                self._vertices = np.ascontiguousarray(np.transpose(corners, (0, 2, 1)))
            rise = np.einsum("cvk,ck->cv", self._vertices[rows] - self.centroids[rows, None, :], slopes)
            with np.errstate(invalid="ignore", divide="ignore"):
                up = (local.max(axis=1) - values[rows])[:, None] / rise
                down = (local.min(axis=1) - values[rows])[:, None] / rise
                alpha = np.where(rise > 0, up, np.where(rise < 0, down, np.inf)).min(axis=1)
            alpha = np.where(finite, np.clip(alpha, 0.0, 1.0), 0.0)
            slopes *= alpha[:, None]
        if cells is None:
            return slopes
        out = np.zeros((self.mesh.npix, 3))
        out[rows] = slopes
        return out

    def cells_of(self, points):
        return hp.vec2pix(self.mesh.nside, points[:, 0], points[:, 1], points[:, 2], nest=True).astype(np.int64)

    def __call__(self, values, points, out=None):
        """The fit of values (npix,) at points (n, 3); values (npix, k): k fields at once, the
        points' cells and monomials found once (out (n, k))."""
        points = np.ascontiguousarray(points, dtype=float)
        values = np.asarray(values, dtype=float)
        out = np.empty((points.shape[0], *values.shape[1:])) if out is None else out
        cells = self.cells_of(points)
        basis = np.ascontiguousarray(self._monomials_at(points, cells))
        if values.ndim == 1:
            polynomial_interpolate(np.ascontiguousarray(values), self.stencil, self.fits, basis, cells,
                                   self.limited, out)
            return out
        column = np.empty(points.shape[0])
        for k in range(values.shape[1]):
            polynomial_interpolate(np.ascontiguousarray(values[:, k]), self.stencil, self.fits, basis, cells,
                                   self.limited, column)
            out[:, k] = column
        return out


def advance_log_density(interpolant, g, field, t, dt, substeps=1, scheme: str = "rk4", velocity=None):
    """g at the centroids at t + dt from g at t (module docstring). field(s, points) → (v, div).
    substeps: the path back from each centroid in that many steps of dt/substeps, or through the
    step boundaries given (trace_back; the divergence integral summed along it), g interpolated
    once at its end, so a finer path adds no interpolation error. velocity: as in trace_back."""
    departure, integral = trace_back(interpolant.centroids, field, t, dt, substeps, scheme, velocity)
    return interpolant(g, departure) - integral


PATH_SCHEMES = ("rk4", "heun")  # trace_back's integrators of the paths


def trace_back(x, field, t, dt, substeps=1, scheme: str = "rk4", velocity=None, tolerance=None,
               halvings: int = 1):
    """The paths of the field that arrive at the points x (n, 3) at t + dt, traced back to t in
    `substeps` equal steps, or (an increasing sequence of times from t to t + dt) in the steps
    between them: (departure points at t (n, 3), ∫_t^{t+dt} div_S v ds along each path).
    field(s, points) → (v, div). scheme "rk4": RK4 steps, Simpson on div v (the midpoint by RK4's
    dense output): 6 calls of field per step, three of them between its ends; "heun": the
    trapezoidal rule (Heun's predictor–corrector) for the path and for ∫div v, field at the ends
    of the step only (3 calls): second order, as the field linear in time between recorded
    states already is, at half the calls, and a field between states costs two sums. The field
    at a step's departure points is the next step's first call, made once: 5n + 1 calls for n
    RK4 steps, 2n + 1 by the trapezoidal rule. velocity(s, points) → v: the field's velocity
    alone, for the stages whose div v no rule uses (RK4's second to fourth, Heun's predictor:
    3 of the 5 calls per RK4 step); None: field's. Where it skips div v it is cheaper (the tree's
    sums: 0.87× the time at β = 1000).

    tolerance (rk4 only; units of g per unit time): each RK4 step of length h is redone in two
    halves, on the paths whose step error estimate exceeds tolerance·h, and so on down to
    `halvings` halvings (_rk4_step). The estimate is Simpson's rule minus the trapezoidal rule
    on div v, |h|·(2/3)·|div_mid − (div_0 + div_1)/2|: the trapezoid's error, so an upper bound of
    Simpson's where div v is smooth, and large where a path crosses a switching layer between
    clusters, where the steps of g's paths lose their accuracy (docs/numerics.md). None: fixed
    steps."""
    if scheme not in PATH_SCHEMES:
        raise ValueError(f"scheme must be one of {PATH_SCHEMES}, got {scheme!r}")
    if tolerance is not None and (scheme != "rk4" or not tolerance >= 0.0):
        raise ValueError(f"a step tolerance needs scheme 'rk4' and tolerance >= 0, got {scheme!r}, {tolerance!r}")
    edges = None
    if not isinstance(substeps, (int, np.integer)):
        edges = np.asarray(substeps, dtype=float)
        if edges.ndim != 1 or edges.size < 2 or not (np.diff(edges) > 0).all() \
                or not np.isclose(edges[0], t) or not np.isclose(edges[-1], t + dt):
            raise ValueError(f"step boundaries must increase from {t!r} to {t + dt!r}")
        substeps = edges.size - 1
    if velocity is None:
        def velocity(s, points):
            return field(s, points)[0]
    h = -dt / substeps  # backward in time, from the arrival at t + dt
    integral = 0.0
    arrival = None  # the field at the start of this step (the last one's departure points), once known
    for j in range(substeps):
        # this substep runs from hi back to lo (one step: t + dt, t + dt/2, t exactly)
        k = substeps - j
        if edges is None:
            hi, lo = t + dt * k / substeps, t + dt * (k - 1) / substeps
        else:
            hi, lo = edges[k], edges[k - 1]
            h = lo - hi
        if arrival is None:
            arrival = field(hi, x)
        if scheme == "heun":
            k1, div1 = arrival
            k2 = velocity(lo, unit_rows(x + h * k1))
            departure = unit_rows(x + 0.5 * h * (k1 + k2))
            arrival = field(lo, departure)
            integral = integral - 0.5 * h * (arrival[1] + div1)
            x = departure
            continue
        if edges is None:  # the midpoint as before the tolerance: the same floats, the same fields
            mid = t + dt * (2 * k - 1) / (2 * substeps)
        else:
            mid = 0.5 * (hi + lo)
        x, increment, arrival = _rk4_step(field, velocity, x, arrival, hi, mid, lo, tolerance,
                                          halvings if tolerance is not None else 0)
        integral = integral + increment
    return x, integral


def _rk4_step(field, velocity, x, first, hi, mid, lo, tolerance, halvings):
    """One RK4 step of trace_back from hi back to lo (mid between): (departure points, Simpson's
    ∫ div v from lo to hi along the paths, the field (v, div) at the departure points). first:
    the field at x at hi. With halvings > 0, the paths whose estimate (trace_back) exceeds
    tolerance·|lo − hi| are redone in two steps through mid, each with tolerance and halvings − 1."""
    h = lo - hi
    k1, div1 = first
    k2 = velocity(mid, unit_rows(x + 0.5 * h * k1))
    k3 = velocity(mid, unit_rows(x + 0.5 * h * k2))
    k4 = velocity(lo, unit_rows(x + h * k3))
    departure = unit_rows(x + h * (k1 + 2.0 * k2 + 2.0 * k3 + k4) / 6.0)
    # dense output at θ = 1/2: weights 5/24, 1/6, 1/6, −1/24
    middle = unit_rows(x + h * (5.0 * k1 + 4.0 * k2 + 4.0 * k3 - k4) / 24.0)
    _, divm = field(mid, middle)
    arrival = field(lo, departure)
    div0 = arrival[1]
    increment = -h * (div0 + 4.0 * divm + div1) / 6.0  # Simpson on the path
    if halvings <= 0:
        return departure, increment, arrival
    estimate = abs(h) * (2.0 / 3.0) * np.abs(divm - 0.5 * (div0 + div1))  # Simpson − trapezoid
    redo = np.flatnonzero(estimate > tolerance * abs(h))
    if redo.size:
        v_end, div_end = np.array(arrival[0], dtype=float), np.array(div0, dtype=float)
        halfway, early, at_half = _rk4_step(field, velocity, x[redo], (k1[redo], div1[redo]), hi, 0.5 * (hi + mid),
                                            mid, tolerance, halvings - 1)
        feet, late, at_feet = _rk4_step(field, velocity, halfway, at_half, mid, 0.5 * (mid + lo), lo, tolerance,
                                        halvings - 1)
        departure[redo] = feet
        increment = np.array(increment, dtype=float)
        increment[redo] = early + late
        v_end[redo], div_end[redo] = at_feet
        arrival = v_end, div_end
    return departure, increment, arrival


def compose_paths(interpolant, departure, integral, earlier):
    """The paths from the centroids back to an earlier time through an intermediate one: this
    interval's (departure points at the intermediate time, divergence integral; trace_back)
    composed with `earlier` = (departure points, integral) of the centroids at the intermediate
    time (None: it is the earlier time). The earlier map is interpolated at this interval's
    departure points (each coordinate, then normalised; the integral): smooth where the field
    is, so one interpolation of g at the composed points replaces one per interval."""
    if earlier is None:
        return departure, integral
    feet, integral_before = earlier
    both = interpolant(np.column_stack([feet, integral_before]), departure)  # one cell search for the four
    return unit_rows(both[:, :3]), integral + both[:, 3]


def unit_rows(x):
    """The rows of x (n, 3) normalised to unit length."""
    return x / np.linalg.norm(x, axis=1, keepdims=True)
