"""A few point sources added exactly to a sum already done: the split sums of the atoms.

The softmax mean and log-partition of a measure ρ = ρ_rest + Σ_k μ_k δ_{y_k} at a target x, from
those of ρ_rest (m_rest, L_rest = ln Z_rest) and the points, exactly:

    l_k = ln μ_k + β⟨Bᵀx, y_k⟩,      L = ln(e^{L_rest} + Σ_k e^{l_k}),
    m   = e^{L_rest − L} m_rest + Σ_k e^{l_k − L} y_k,      v = P_x(V m).

Every weight is e^{(·) − max}, so nothing overflows at any β (L_rest = −inf: ρ_rest = 0). The
Eulerian solver with atoms and extrapolated fluxes keeps (m_rest, L_rest) of the mesh density
in its extrapolation history and adds the atoms here at every stage (spherepde.solvers.eulerian): the
atoms move and the softmax weights between them change fast at large β, the background slowly.
Cost O(T·K) for T targets and K points.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .kernels import project_velocity

__all__ = ["add_point_sources", "point_log_partition"]


@njit(cache=True)
def _point_levels_top(x0, x1, x2, BT, beta, points, log_masses, top):
    """(a = βBᵀx, max(top, max_k l_k)) with l_k = ln μ_k + ⟨a, y_k⟩."""
    a0 = beta * (BT[0, 0] * x0 + BT[0, 1] * x1 + BT[0, 2] * x2)
    a1 = beta * (BT[1, 0] * x0 + BT[1, 1] * x1 + BT[1, 2] * x2)
    a2 = beta * (BT[2, 0] * x0 + BT[2, 1] * x1 + BT[2, 2] * x2)
    for k in range(points.shape[0]):
        level = log_masses[k] + a0 * points[k, 0] + a1 * points[k, 1] + a2 * points[k, 2]
        if level > top:
            top = level
    return a0, a1, a2, top


@njit(cache=True, parallel=True)
def add_point_sources(targets, BT, beta, V, rest, points, log_masses, velocity, mean, logz):
    """Module formula at T targets (T, 3). BT = Bᵀ (3, 3); rest (T, 4): m_rest in columns 0-2,
    L_rest in column 3; points (K, 3) unit vectors, log_masses (K,) = ln μ_k. Writes velocity
    (T, 3) = P_x(V m), mean (T, 3) = m and logz (T,) = L. No mass at all: m = 0, L = −inf."""
    for i in prange(targets.shape[0]):
        x0, x1, x2 = targets[i, 0], targets[i, 1], targets[i, 2]
        a0, a1, a2, top = _point_levels_top(x0, x1, x2, BT, beta, points, log_masses, rest[i, 3])
        if top == -np.inf:
            mean[i, 0] = mean[i, 1] = mean[i, 2] = 0.0
            logz[i] = -np.inf
            velocity[i, 0] = velocity[i, 1] = velocity[i, 2] = 0.0
            continue
        s = math.exp(rest[i, 3] - top)
        m0, m1, m2 = s * rest[i, 0], s * rest[i, 1], s * rest[i, 2]
        for k in range(points.shape[0]):
            w = math.exp(log_masses[k] + a0 * points[k, 0] + a1 * points[k, 1] + a2 * points[k, 2] - top)
            s += w
            m0 += w * points[k, 0]
            m1 += w * points[k, 1]
            m2 += w * points[k, 2]
        mean[i, 0], mean[i, 1], mean[i, 2] = m0 / s, m1 / s, m2 / s
        logz[i] = top + math.log(s)
        project_velocity(V, mean[i, 0], mean[i, 1], mean[i, 2], x0, x1, x2, velocity[i])


@njit(cache=True, parallel=True)
def point_log_partition(targets, BT, beta, points, log_masses, out):
    """out[i] = ln Σ_k μ_k e^{β⟨Bᵀx_i, y_k⟩} at T targets (T, 3), the points' partition function
    (log-sum-exp, no overflow); −inf without points. The split sums pass it to the mesh part's
    harmonic sums, whose error budget is relative to the whole measure (field.attention_field)."""
    for i in prange(targets.shape[0]):
        x0, x1, x2 = targets[i, 0], targets[i, 1], targets[i, 2]
        a0, a1, a2, top = _point_levels_top(x0, x1, x2, BT, beta, points, log_masses, -np.inf)
        if top == -np.inf:
            out[i] = -np.inf
            continue
        s = 0.0
        for k in range(points.shape[0]):
            s += math.exp(log_masses[k] + a0 * points[k, 0] + a1 * points[k, 1] + a2 * points[k, 2] - top)
        out[i] = top + math.log(s)
