"""Numba kernels of the finite-volume transport step.

All kernels are module-level, compiled once (cache=True), take plain arrays and write into
preallocated outputs. Units: densities per steradian, velocities in radians per unit time,
"edge fluxes" un[e, k] = w_k (v·n)(x_k) in steradians per unit time (arc-length weight × normal
velocity), so that the volume flux through edge e is Σ_k un[e, k] and the density flux is
Σ_k un[e, k] f̃_k with f̃_k the upwind edge value.

Sign convention: edge e has cells (p, q) = edge_cells[e] with p < q; positive un flows from p to
q. cell_edges[c] lists the four edges of cell c and cell_edge_sign[c] is +1 where c is the p side.
Each edge flux is computed once; the divergence gathers it with opposite signs into both cells,
so Σ_c area·(df/dt)_c = 0 up to round-off.
"""

from __future__ import annotations

import math

from numba import njit, prange

__all__ = [
    "edge_normal_flux",
    "cell_flow_rates",
    "limited_gradients",
    "upwind_edge_fluxes",
    "muscl_edge_fluxes",
    "log_limited_gradients",
    "log_muscl_edge_fluxes",
    "flux_divergence",
    "graph_laplacian",
    "uniformization",
    "uniformization_serial",
]


@njit(cache=True, parallel=True)
def edge_normal_flux(velocity, normals, weights, out):
    """un[e, k] = weights[e, k] · ⟨velocity[e, k], normals[e, k]⟩.

    The normal is tangent to the sphere, so the radial part of an ambient velocity drops out:
    this equals the flux of the tangent projection P_x v.
    """
    nedges, nq = weights.shape
    for e in prange(nedges):
        for k in range(nq):
            out[e, k] = weights[e, k] * (
                velocity[e, k, 0] * normals[e, k, 0]
                + velocity[e, k, 1] * normals[e, k, 1]
                + velocity[e, k, 2] * normals[e, k, 2]
            )


@njit(cache=True, parallel=True)
def cell_flow_rates(un, cell_edges, cell_edge_sign, inv_area, outflow, divergence):
    """Per cell: outflow rate Σ_out un⁺/A (1/time) and discrete divergence Σ ±un/A (1/time).

    dt · outflow[c] is the outflow Courant number of cell c.
    """
    ncell = cell_edges.shape[0]
    nq = un.shape[1]
    for c in prange(ncell):
        out_sum = 0.0
        net = 0.0
        for j in range(4):
            e = cell_edges[c, j]
            s = cell_edge_sign[c, j]
            for k in range(nq):
                flow = s * un[e, k]
                net += flow
                if flow > 0.0:
                    out_sum += flow
        outflow[c] = out_sum * inv_area
        divergence[c] = net * inv_area


@njit(cache=True, parallel=True)
def limited_gradients(
    f, neighbours, lsq_coef, cell_edges, edge_points, centroids, bounded, grad
):
    """Least-squares gradient of f at each centroid, scaled by a limiter φ ∈ [0, 1].

    g = Σ_j lsq_coef[c, j] (f_j − f_c) (tangent, 1/radian). Edge values f̃ = f_c + φ g·(x_k − c).
    Limiter at every edge quadrature point of the cell:
      - always |φ g·(x_k − c)| ≤ f_c, so 0 ≤ f̃ ≤ 2 f_c (positivity of the update for an outflow
        Courant number ≤ 1/2);
      - where bounded[c] (the flow is not compressive there), Barth–Jespersen: f̃ within
        [min, max] of f over the cell and its neighbours. Compressive cells keep only the
        positivity bound: a genuine compression raises the maximum, and clipping it would
        flatten the concentrating peaks this solver exists to resolve.
    """
    ncell = f.shape[0]
    nnbr = neighbours.shape[1]
    nq = edge_points.shape[1]
    for c in prange(ncell):
        fc = f[c]
        gx = 0.0
        gy = 0.0
        gz = 0.0
        fmin = fc
        fmax = fc
        for j in range(nnbr):
            fj = f[neighbours[c, j]]
            d = fj - fc
            gx += lsq_coef[c, j, 0] * d
            gy += lsq_coef[c, j, 1] * d
            gz += lsq_coef[c, j, 2] * d
            if fj < fmin:
                fmin = fj
            if fj > fmax:
                fmax = fj
        phi = 1.0
        cx = centroids[c, 0]
        cy = centroids[c, 1]
        cz = centroids[c, 2]
        for j in range(4):
            e = cell_edges[c, j]
            for k in range(nq):
                delta = (
                    gx * (edge_points[e, k, 0] - cx)
                    + gy * (edge_points[e, k, 1] - cy)
                    + gz * (edge_points[e, k, 2] - cz)
                )
                mag = abs(delta)
                if mag > fc:
                    phi = min(phi, fc / mag)
                if bounded[c]:
                    if delta > 0.0 and fc + delta > fmax:
                        phi = min(phi, (fmax - fc) / delta)
                    elif delta < 0.0 and fc + delta < fmin:
                        phi = min(phi, (fmin - fc) / delta)
        if phi < 0.0:
            phi = 0.0
        grad[c, 0] = phi * gx
        grad[c, 1] = phi * gy
        grad[c, 2] = phi * gz


@njit(cache=True, parallel=True)
def upwind_edge_fluxes(f, un, edge_cells, flux):
    """First-order upwind: flux[e] = Σ_k un[e,k] · (f_p if un[e,k] > 0 else f_q)."""
    nedges, nq = un.shape
    for e in prange(nedges):
        fp = f[edge_cells[e, 0]]
        fq = f[edge_cells[e, 1]]
        total = 0.0
        for k in range(nq):
            u = un[e, k]
            total += u * (fp if u > 0.0 else fq)
        flux[e] = total


@njit(cache=True, parallel=True)
def muscl_edge_fluxes(f, grad, un, edge_cells, edge_points, centroids, flux):
    """Second order: flux[e] = Σ_k un[e,k] f̃_k, f̃_k = f_up + g_up·(x_k − c_up) from the upwind cell."""
    nedges, nq = un.shape
    for e in prange(nedges):
        total = 0.0
        for k in range(nq):
            u = un[e, k]
            c = edge_cells[e, 0] if u > 0.0 else edge_cells[e, 1]
            value = (
                f[c]
                + grad[c, 0] * (edge_points[e, k, 0] - centroids[c, 0])
                + grad[c, 1] * (edge_points[e, k, 1] - centroids[c, 1])
                + grad[c, 2] * (edge_points[e, k, 2] - centroids[c, 2])
            )
            total += u * value
        flux[e] = total


@njit(cache=True)
def _log_average(gx, gy, gz, cx, cy, cz, qpoints, qweights, c):
    """log Σ_q w_q exp(g·(x_q − centroid)) over the cell quadrature of cell c."""
    total = 0.0
    for q in range(qweights.shape[0]):
        total += qweights[q] * math.exp(gx * (qpoints[c, q, 0] - cx) + gy * (qpoints[c, q, 1] - cy)
                                        + gz * (qpoints[c, q, 2] - cz))
    return math.log(total)


@njit(cache=True, parallel=True)
def log_limited_gradients(f, neighbours, lsq_coef, cell_edges, edge_points, centroids, qpoints, qweights,
                          bounded, log_ratio, grad, log_shift):
    """The reconstruction of f in g = log f: f̃(x) = exp(s_c + φ ∇g·(x − c)) in cell c.

    ∇g: least-squares gradient of log f over the neighbours with f > 0 (1/radian). Limiter φ ∈ [0, 1]
    at every edge quadrature point: where bounded[c] (not compressive), Barth–Jespersen in g (edge
    values of g within [min, max] of log f over the cell and its neighbours); always
    f̃ ≤ e^{log_ratio} f_c (positivity of the update for an outflow Courant number ≤ e^{−log_ratio}). s_c makes the reconstruction's
    cell average f_c exactly (cell quadrature qpoints (ncell, m, 3), qweights (m,), sum 1):
    s_c = log f_c − log Σ_q w_q exp(φ ∇g·(x_q − c)). So an exponential profile f = e^{a·x} is
    reconstructed to second order relative to f, where a reconstruction of f itself is not.
    Cells with f_c ≤ 0 get no gradient and log_shift = −inf (their edge value is f_c).
    """
    ncell = f.shape[0]
    nnbr = neighbours.shape[1]
    nq = edge_points.shape[1]
    for c in prange(ncell):
        fc = f[c]
        if not fc > 0.0:
            grad[c, 0] = 0.0
            grad[c, 1] = 0.0
            grad[c, 2] = 0.0
            log_shift[c] = -math.inf
            continue
        gc = math.log(fc)
        gx = 0.0
        gy = 0.0
        gz = 0.0
        gmin = gc
        gmax = gc
        for j in range(nnbr):
            fj = f[neighbours[c, j]]
            if not fj > 0.0:
                continue
            gj = math.log(fj)
            d = gj - gc
            gx += lsq_coef[c, j, 0] * d
            gy += lsq_coef[c, j, 1] * d
            gz += lsq_coef[c, j, 2] * d
            if gj < gmin:
                gmin = gj
            if gj > gmax:
                gmax = gj
        phi = 1.0
        cx = centroids[c, 0]
        cy = centroids[c, 1]
        cz = centroids[c, 2]
        top = 0.0  # the largest edge offset φ∇g·(x_k − c)
        for j in range(4):
            e = cell_edges[c, j]
            for k in range(nq):
                delta = (gx * (edge_points[e, k, 0] - cx) + gy * (edge_points[e, k, 1] - cy)
                         + gz * (edge_points[e, k, 2] - cz))
                if delta > log_ratio:
                    phi = min(phi, log_ratio / delta)
                if bounded[c]:
                    if delta > 0.0 and gc + delta > gmax:
                        phi = min(phi, (gmax - gc) / delta)
                    elif delta < 0.0 and gc + delta < gmin:
                        phi = min(phi, (gmin - gc) / delta)
                if delta > top:
                    top = delta
        if phi < 0.0:
            phi = 0.0
        shift = _log_average(phi * gx, phi * gy, phi * gz, cx, cy, cz, qpoints, qweights, c)
        # the cell-average correction may lift the largest edge value above the bound: halve φ until not
        for _ in range(60):
            if phi * top - shift <= log_ratio:
                break
            phi *= 0.5
            shift = _log_average(phi * gx, phi * gy, phi * gz, cx, cy, cz, qpoints, qweights, c)
        grad[c, 0] = phi * gx
        grad[c, 1] = phi * gy
        grad[c, 2] = phi * gz
        log_shift[c] = gc - shift


@njit(cache=True, parallel=True)
def log_muscl_edge_fluxes(f, grad, log_shift, un, edge_cells, edge_points, centroids, flux):
    """flux[e] = Σ_k un[e,k] f̃_k, f̃_k = exp(s_up + g_up·(x_k − c_up)) from the upwind cell
    (log_limited_gradients), f_up itself where f_up ≤ 0."""
    nedges, nq = un.shape
    for e in prange(nedges):
        total = 0.0
        for k in range(nq):
            u = un[e, k]
            c = edge_cells[e, 0] if u > 0.0 else edge_cells[e, 1]
            if f[c] > 0.0:
                value = math.exp(log_shift[c]
                                 + grad[c, 0] * (edge_points[e, k, 0] - centroids[c, 0])
                                 + grad[c, 1] * (edge_points[e, k, 1] - centroids[c, 1])
                                 + grad[c, 2] * (edge_points[e, k, 2] - centroids[c, 2]))
            else:
                value = f[c]
            total += u * value
        flux[e] = total


@njit(cache=True, parallel=True)
def flux_divergence(flux, cell_edges, cell_edge_sign, inv_area, out):
    """out[c] = −(1/A) Σ_j sign[c, j] flux[cell_edges[c, j]]  (= df/dt, density per time)."""
    ncell = cell_edges.shape[0]
    for c in prange(ncell):
        total = 0.0
        for j in range(4):
            total += cell_edge_sign[c, j] * flux[cell_edges[c, j]]
        out[c] = -inv_area * total


# ------------------------------------------------------------------ diffusion (spherepde.transport.diffusion)
@njit(cache=True, parallel=True)
def graph_laplacian(f, neighbours, rates, out):
    """out[c] = Σ_j rates[c, j] (f[neighbours[c, j]] − f[c]): the mesh Laplace–Beltrami operator
    (rates symmetric: rates[c, j] = rates[d, i] when d = neighbours[c, j], c = neighbours[d, i])."""
    ncell, nnbr = rates.shape
    for c in prange(ncell):
        fc = f[c]
        total = 0.0
        for j in range(nnbr):
            total += rates[c, j] * (f[neighbours[c, j]] - fc)
        out[c] = total


@njit(cache=True, parallel=True)
def uniformization(f, neighbours, rates, diagonal, inv_rate, poisson, out, work_a, work_b):
    """out = Σ_k poisson[k] P^k f with P = I + L/Λ (uniformisation of exp(μL), μ = Λ·amount).

    (P g)[c] = diagonal[c] g[c] + inv_rate Σ_j rates[c, j] g[neighbours[c, j]] with diagonal[c] =
    1 − Σ_j rates[c, j]/Λ ≥ 0 and inv_rate = 1/Λ: every term is ≥ 0 for g ≥ 0, so the result is
    non-negative, and Σ_c (P g)[c] = Σ_c g[c] (rates symmetric) keeps the mass. work_a, work_b:
    scratch arrays of f's size; f is not modified.
    """
    ncell, nnbr = rates.shape
    p0 = poisson[0]
    for c in prange(ncell):
        work_a[c] = f[c]
        out[c] = p0 * f[c]
    src = work_a
    dst = work_b
    for k in range(1, poisson.shape[0]):
        pk = poisson[k]
        for c in prange(ncell):
            total = 0.0
            for j in range(nnbr):
                total += rates[c, j] * src[neighbours[c, j]]
            value = diagonal[c] * src[c] + inv_rate * total
            dst[c] = value
            out[c] += pk * value
        src, dst = dst, src


@njit(cache=True)
def uniformization_serial(f, neighbours, rates, diagonal, inv_rate, poisson, out, work_a, work_b):
    """uniformization (same arguments, same result to the bit) without threads: a parallel region
    per product costs more than the product on small meshes, and far more on a busy machine, where
    every region waits for time slices."""
    ncell, nnbr = rates.shape
    p0 = poisson[0]
    for c in range(ncell):
        work_a[c] = f[c]
        out[c] = p0 * f[c]
    src = work_a
    dst = work_b
    for k in range(1, poisson.shape[0]):
        pk = poisson[k]
        for c in range(ncell):
            total = 0.0
            for j in range(nnbr):
                total += rates[c, j] * src[neighbours[c, j]]
            value = diagonal[c] * src[c] + inv_rate * total
            dst[c] = value
            out[c] += pk * value
        src, dst = dst, src
