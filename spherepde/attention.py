"""The attention velocity field of a density on S² and its surface divergence.

For a measure ρ = Σ_j μ_j δ_{y_j} (cell masses μ_j = f_j·A at the cell centroids y_j: a
second-order quadrature of the density) and a target point x:

    weights  ω_j ∝ μ_j e^{β⟨Bᵀx, y_j⟩}           (softmax, normalised to Σ ω_j = 1)
    m_β(x) = Σ_j ω_j y_j                          (softmax mean)
    C_x    = Σ_j ω_j y_j y_jᵀ − m mᵀ              (softmax covariance)
    v(x)   = P_x(V m_β(x)),  P_x = I − x xᵀ
    div_S v(x) = β tr(P_x V C_x Bᵀ) − 2⟨x, V m_β(x)⟩

The divergence follows from div_S P_x(u) = tr(P_x ∇u) − 2⟨x, u⟩ with ∇m_β = β C_x Bᵀ
(DESIGN.md §2). Exponents are shifted by their maximum over the sources with positive mass,
max_j (β⟨Bᵀx, y_j⟩ + log μ_j), so the largest term is exactly 1: no overflow and no 0/0 for any β.

At β = ∞ the field is local: v(x) = P_x(M x)/|Bᵀx| with M = VBᵀ and
div_S v = (tr M − 3xᵀMx)/|Bᵀx| − ⟨P_x(BBᵀx), P_x(Mx)⟩/|Bᵀx|³.

Memory is O(N + targets); no N × targets array is formed. ``attention_field`` is the single entry
point of the summation, so a faster algorithm can replace the direct sum behind it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

__all__ = ["attention_field", "softmax_direct", "zero_temperature_field", "AttentionField"]


@njit(cache=True, parallel=True)
def softmax_direct(targets, BT, beta, sources, log_mass, V, want_div, velocity, divergence, mean):
    """Direct O(N·T) softmax sums, fused with the velocity and divergence of each target.

    targets (T, 3) unit vectors; BT = Bᵀ (3, 3); sources (N, 3); log_mass (N,) (−inf for empty
    cells, skipped); V (3, 3). Writes velocity (T, 3), mean (T, 3) and, if want_div,
    divergence (T,) (per unit time).
    """
    ntarget = targets.shape[0]
    nsource = sources.shape[0]
    for i in prange(ntarget):
        x0 = targets[i, 0]
        x1 = targets[i, 1]
        x2 = targets[i, 2]
        a0 = beta * (BT[0, 0] * x0 + BT[0, 1] * x1 + BT[0, 2] * x2)
        a1 = beta * (BT[1, 0] * x0 + BT[1, 1] * x1 + BT[1, 2] * x2)
        a2 = beta * (BT[2, 0] * x0 + BT[2, 1] * x1 + BT[2, 2] * x2)
        shift = -np.inf
        for j in range(nsource):
            s = a0 * sources[j, 0] + a1 * sources[j, 1] + a2 * sources[j, 2] + log_mass[j]
            if s > shift:
                shift = s
        z = 0.0
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        c00 = 0.0
        c01 = 0.0
        c02 = 0.0
        c11 = 0.0
        c12 = 0.0
        c22 = 0.0
        for j in range(nsource):
            y0 = sources[j, 0]
            y1 = sources[j, 1]
            y2 = sources[j, 2]
            e = math.exp(a0 * y0 + a1 * y1 + a2 * y2 + log_mass[j] - shift)
            z += e
            s0 += e * y0
            s1 += e * y1
            s2 += e * y2
            if want_div:
                c00 += e * y0 * y0
                c01 += e * y0 * y1
                c02 += e * y0 * y2
                c11 += e * y1 * y1
                c12 += e * y1 * y2
                c22 += e * y2 * y2
        m0 = s0 / z
        m1 = s1 / z
        m2 = s2 / z
        mean[i, 0] = m0
        mean[i, 1] = m1
        mean[i, 2] = m2
        u0 = V[0, 0] * m0 + V[0, 1] * m1 + V[0, 2] * m2
        u1 = V[1, 0] * m0 + V[1, 1] * m1 + V[1, 2] * m2
        u2 = V[2, 0] * m0 + V[2, 1] * m1 + V[2, 2] * m2
        xu = x0 * u0 + x1 * u1 + x2 * u2
        velocity[i, 0] = u0 - xu * x0
        velocity[i, 1] = u1 - xu * x1
        velocity[i, 2] = u2 - xu * x2
        if want_div:
            C = np.empty((3, 3))
            C[0, 0] = c00 / z - m0 * m0
            C[0, 1] = c01 / z - m0 * m1
            C[0, 2] = c02 / z - m0 * m2
            C[1, 1] = c11 / z - m1 * m1
            C[1, 2] = c12 / z - m1 * m2
            C[2, 2] = c22 / z - m2 * m2
            C[1, 0] = C[0, 1]
            C[2, 0] = C[0, 2]
            C[2, 1] = C[1, 2]
            # tr(P_x V C Bᵀ) = tr(V C Bᵀ) − xᵀ V C Bᵀ x, with K = V C Bᵀ
            tr = 0.0
            xKx = 0.0
            x = (x0, x1, x2)
            for r in range(3):
                for c in range(3):
                    k = 0.0
                    for s in range(3):
                        vc = 0.0
                        for t in range(3):
                            vc += V[r, t] * C[t, s]
                        k += vc * BT[s, c]
                    if r == c:
                        tr += k
                    xKx += x[r] * k * x[c]
            divergence[i] = beta * (tr - xKx) - 2.0 * xu


@njit(cache=True, parallel=True)
def zero_temperature_field(targets, B, M, want_div, velocity, divergence):
    """β = ∞: v = P_x(Mx)/|Bᵀx| and its surface divergence (see module docstring)."""
    ntarget = targets.shape[0]
    trM = M[0, 0] + M[1, 1] + M[2, 2]
    for i in prange(ntarget):
        x = targets[i]
        bx = np.zeros(3)
        mx = np.zeros(3)
        for r in range(3):
            for c in range(3):
                bx[r] += B[c, r] * x[c]  # (Bᵀx)_r
                mx[r] += M[r, c] * x[c]
        nb = math.sqrt(bx[0] ** 2 + bx[1] ** 2 + bx[2] ** 2)
        xmx = x[0] * mx[0] + x[1] * mx[1] + x[2] * mx[2]
        pmx = mx - xmx * x
        for r in range(3):
            velocity[i, r] = pmx[r] / nb
        if want_div:
            bbx = B @ bx
            xbbx = x[0] * bbx[0] + x[1] * bbx[1] + x[2] * bbx[2]
            pbbx = bbx - xbbx * x
            cross = pbbx[0] * pmx[0] + pbbx[1] * pmx[1] + pbbx[2] * pmx[2]
            divergence[i] = (trM - 3.0 * xmx) / nb - cross / nb**3


def attention_field(model, sources, masses, targets, want_div=False, out=None):
    """Velocity v (T, 3), divergence div_S v (T,) (or None) and softmax mean m_β (T, 3).

    sources (N, 3) with masses (N,) ≥ 0 (need not be normalised); targets (T, 3) unit vectors.
    The one entry point of the summation. At β = ∞ the masses are unused and mean is None.
    """
    targets = np.ascontiguousarray(targets, dtype=float)
    ntarget = targets.shape[0]
    if out is None:
        out = (np.empty((ntarget, 3)), np.empty(ntarget), np.empty((ntarget, 3)))
    velocity, divergence, mean = out
    if model.zero_temperature:
        zero_temperature_field(targets, model.B, model.M, want_div, velocity, divergence)
        return velocity, (divergence if want_div else None), None
    masses = np.asarray(masses, dtype=float)
    if not np.any(masses > 0):
        raise ValueError("the density has no positive mass")
    with np.errstate(divide="ignore"):
        log_mass = np.log(np.maximum(masses, 0.0))
    softmax_direct(targets, np.ascontiguousarray(model.B.T), model.beta,
                   np.ascontiguousarray(sources, dtype=float), log_mass, model.V, want_div,
                   velocity, divergence, mean)
    return velocity, (divergence if want_div else None), mean


class AttentionField:
    """The attention field of cell densities on a mesh, evaluated at fixed target points.

    Sources are the cell centroids with masses f_c·A; work arrays are allocated once.
    """

    def __init__(self, model, mesh, targets):
        self.model = model
        self.mesh = mesh
        self.targets = np.ascontiguousarray(targets, dtype=float)
        n = self.targets.shape[0]
        self._out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)))

    def __call__(self, f, want_div=False):
        return attention_field(self.model, self.mesh.centroids, f * self.mesh.area, self.targets,
                               want_div=want_div, out=self._out)
