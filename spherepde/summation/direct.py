"""The direct O(N·T) attention sums, and the local field at β = ∞.

For a measure ρ = Σ_j μ_j δ_{y_j} and a target x (unit vectors; masses in any unit, only their
ratios enter) softmax_blocked sums, over every source,

    weights  ω_j ∝ μ_j e^{β⟨Bᵀx, y_j⟩},  m_β(x) = Σ_j ω_j y_j,  C_x = Σ_j ω_j y_j y_jᵀ − m mᵀ

with the shared kernels of spherepde.summation.kernels (base 2, centred exponents and moments,
sampled or exact shift: see there), fused with v(x) = P_x(V m_β(x)) and div_S v (per unit time).
Exact to rounding; memory O(N + T), no N × T array.

Blocking: targets go in blocks of TARGET_BLOCK (the parallel loop), sources in blocks of
SOURCE_BLOCK (4 arrays × 8192 × 8 B = 256 KiB, resident in the 1 MiB L2 while the target block
sweeps over them; L2 bandwidth is ample for one pair per ~3 cycles, and smaller blocks only add
per-block reduction overhead: measured 512 / 2048 / 8192 / unblocked = 0.48 / 0.43 / 0.41 / 0.41
ns per pair at nside 32 and 8192 / unblocked = 0.41 / 0.42 at nside 64, where the sources exceed
L2).

softmax_direct_reference is the original scalar kernel (libm exp, natural base, uncentred), kept
as the reference of the tests and for exponents beyond the range of the fast exp2.

At β = ∞ the field is local (zero_temperature_field): v(x) = P_x(M x)/|Bᵀx| with M = VBᵀ and
div_S v = (tr M − 3xᵀMx)/|Bᵀx| − ⟨P_x(BBᵀx), P_x(Mx)⟩/|Bᵀx|³.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .fastmath import LOG2E
from .kernels import (
    SHIFT_SLACK,
    add_near_field,
    block_max,
    block_moments1,
    block_moments2,
    finish_target,
    kernel_direction,
    store_log_partition,
)

__all__ = ["softmax_blocked", "softmax_direct_reference", "zero_temperature_field", "TARGET_BLOCK",
           "SOURCE_BLOCK"]

TARGET_BLOCK = 64  # targets per parallel work item
SOURCE_BLOCK = 8192  # sources per block (256 KiB of source data: stays in L2 for the target block)


@njit(cache=True, parallel=True)
def softmax_blocked(targets, BT, beta, soa, sample, rmax, V, want_div, velocity, divergence, mean,
                    near_cells, near_delta, log2_factor, logz, ln_top):
    """Direct O(N·T) softmax sums, vectorised and blocked, fused with velocity and divergence.

    targets (T, 3) unit vectors; BT = Bᵀ (3, 3); soa, sample, rmax from source_arrays (positive
    masses only; exponents must stay below 2⁵⁰ in size, see attention_field); V (3, 3). Writes
    velocity (T, 3), mean (T, 3) and, if want_div, divergence (T,), like softmax_direct_reference.
    near_cells (T, K), near_delta (T, K, 10), log2_factor (cells,): near-field corrections
    (add_near_field; K = 0 for none). logz (T,): log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} with
    the near-field corrections (kernels.store_log_partition; ln_top = ln max μ), or length 0 for
    none.
    """
    ntarget = targets.shape[0]
    nsource = soa.shape[1]
    ys0, ys1, ys2, lws = soa[0], soa[1], soa[2], soa[3]  # rows: 1-d contiguous (soa[0, s0:s1]
    # would be typed non-contiguous, which keeps the loops from vectorising)
    nmom = 10 if want_div else 4
    scale = beta * LOG2E
    for b in prange((ntarget + TARGET_BLOCK - 1) // TARGET_BLOCK):
        i0 = b * TARGET_BLOCK
        nt = min(TARGET_BLOCK, ntarget - i0)
        a = np.empty((nt, 3))
        h = np.zeros((nt, 3))  # â = a/|a| (0 if a = 0)
        anorm = np.empty(nt)  # |a| = ⟨a, â⟩: the centring constant of the exponents
        shift = np.empty(nt)
        exact = np.zeros(nt, dtype=np.bool_)
        mom = np.zeros((nt, nmom))
        any_exact = False
        for t in range(nt):
            a0, a1, a2, norm, h[t, 0], h[t, 1], h[t, 2] = kernel_direction(
                BT, scale, targets[i0 + t, 0], targets[i0 + t, 1], targets[i0 + t, 2])
            a[t, 0] = a0
            a[t, 1] = a1
            a[t, 2] = a2
            anorm[t] = norm
            # the exponents λ_j + ⟨a, y_j − â⟩ are ≤ |a| r_max − ⟨a, â⟩ (λ ≤ 0), and their maximum
            # is ≥ that of the sample. Shifting by the sample maximum costs an absolute rounding
            # error ε·(max − shift) in the exponents: allow it only up to SHIFT_SLACK
            upper = norm * rmax - (a0 * h[t, 0] + a1 * h[t, 1] + a2 * h[t, 2])
            lower = block_max(a0, a1, a2, h[t, 0], h[t, 1], h[t, 2], sample[0], sample[1],
                               sample[2], sample[3])
            shift[t] = lower
            if upper - lower > SHIFT_SLACK:
                exact[t] = True
                any_exact = True
        if any_exact:  # the true maximum, for the targets whose sampled one is not close enough
            for s0 in range(0, nsource, SOURCE_BLOCK):
                s1 = min(s0 + SOURCE_BLOCK, nsource)
                for t in range(nt):
                    if exact[t]:
                        shift[t] = max(shift[t], block_max(
                            a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2],
                            ys0[s0:s1], ys1[s0:s1], ys2[s0:s1], lws[s0:s1]))
        for s0 in range(0, nsource, SOURCE_BLOCK):
            s1 = min(s0 + SOURCE_BLOCK, nsource)
            y0 = ys0[s0:s1]
            y1 = ys1[s0:s1]
            y2 = ys2[s0:s1]
            lw = lws[s0:s1]
            for t in range(nt):
                if want_div:
                    r2 = block_moments2(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2],
                                         -shift[t], y0, y1, y2, lw)
                    for k in range(10):
                        mom[t, k] += r2[k]
                else:
                    r1 = block_moments1(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2],
                                         -shift[t], y0, y1, y2, lw)
                    for k in range(4):
                        mom[t, k] += r1[k]
        for t in range(nt):
            i = i0 + t
            top = add_near_field(i, mom[t], nmom, shift[t], near_cells, near_delta, log2_factor)
            finish_target(i, targets[i, 0], targets[i, 1], targets[i, 2], h[t, 0], h[t, 1],
                           h[t, 2], mom[t], BT, beta, V, want_div, velocity, divergence, mean)
            store_log_partition(i, logz, mom[t, 0], top + anorm[t], ln_top)


@njit(cache=True, parallel=True)
def softmax_direct_reference(targets, BT, beta, sources, log_mass, V, want_div, velocity, divergence, mean,
                             logz):
    """Direct O(N·T) softmax sums, fused with the velocity and divergence of each target.

    The original scalar kernel (libm exp per pair), kept as the reference of softmax_blocked.

    targets (T, 3) unit vectors; BT = Bᵀ (3, 3); sources (N, 3); log_mass (N,) (−inf for empty
    cells, skipped); V (3, 3). Writes velocity (T, 3), mean (T, 3) and, if want_div,
    divergence (T,) (per unit time); logz (T,) (or length 0: not written) receives
    log Z = ln z + shift, natural base, the masses exp(log_mass) as given.
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
        # no centring here (â = 0): the moments are the raw Σ e y and Σ e y yᵀ
        finish_target(i, x0, x1, x2, 0.0, 0.0, 0.0, (z, s0, s1, s2, c00, c01, c02, c11, c12, c22),
                       BT, beta, V, want_div, velocity, divergence, mean)
        if logz.size:
            logz[i] = math.log(z) + shift


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
