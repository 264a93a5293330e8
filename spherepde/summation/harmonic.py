"""Attention sums at moderate β by spherical harmonics (Funk–Hecke), O((N + T)·L²).

For a target x let κ = β|Bᵀx| and x' = Bᵀx/|Bᵀx|: the kernel is e^{β⟨Bᵀx, y⟩} = e^{κ⟨x', y⟩}, a
zonal function of y, whose Legendre expansion and the addition theorem give

    e^{κ⟨x', y⟩} = Σ_ℓ (2ℓ + 1) i_ℓ(κ) P_ℓ(⟨x', y⟩) = 4π Σ_ℓ i_ℓ(κ) Σ_m Y_ℓm(x') Y_ℓm(y)

(i_ℓ the modified spherical Bessel functions of the first kind, Y_ℓm real orthonormal spherical
harmonics). κ varies with x for a general B; it only enters the target side. So

    Σ_j μ_j g(y_j) e^{β⟨Bᵀx, y_j⟩} = 4π Σ_ℓm i_ℓ(κ) Y_ℓm(x') d_ℓm[g],  d_ℓm[g] = Σ_j μ_j g(y_j) Y_ℓm(y_j)

for the ten moments g = 1, y, y yᵀ: the d_ℓm are the harmonic coefficients of the discrete source
measure (exact sums, no quadrature), one pass over the sources; each target then costs
(L + 1)² × 4 multiply-adds (× 10 with the divergence).

Speed: one point's harmonics come from the Legendre recurrence over ℓ with all orders m at once
(vectorised inner loops; a recurrence over ℓ for one m at a time is latency-bound, ~4× slower),
and groups of 4 points are contracted with 4 moments at a time, 16 sums in registers.

Scaling and accuracy: the target side is multiplied by e^{−κ} and masses by 1/max μ, so no kernel
value exceeds 1. A source's truncation error is at most Σ_{ℓ>L} (2ℓ + 1) i_ℓ(κ) e^{−κ}
(|P_ℓ| ≤ 1), which grows with κ, and Σ_ℓm 4π i_ℓ e^{−κ}|Y_ℓm(x')||d_ℓm| ≤ M̃ = Σ_j μ_j/max μ
(Cauchy–Schwarz on the addition theorem). Every moment then has an absolute error of at most
tail(κ_max)·M̃ from the truncation, plus rounding. Rounding is estimated, not bounded: errors of
long sums grow like random walks, so a coefficient sum over N sources errs by ~4ε√N·rms(μ̃ g Y)
(the ℓ = 0 sum, whose partial sums grow linearly, by ~4εN^{3/2}·mean μ̃), seen by the target
through ‖t‖₂ (resp. t₀) of its weights t = 4π i_ℓ e^{−κ} Y_ℓm(x'); the target's own series errs by
~4(L + 1)ε·Σ|terms| ≤ 4(L + 1)ε Σ_ℓ 4π i_ℓ e^{−κ} √((2ℓ+1)/4π)‖d_ℓ[1]‖₂. The worst-case bounds (Nε, (L + 1)²ε) are 10³–10⁵× pessimistic here and
would send most targets to the direct sum; the tests compare with the direct sum instead. The
relative error of m_β is then about 2·err/Z(x): where
that exceeds the tolerance (a density that is tiny where the kernel of x sits: the sums span e^{2κ}
and the small ones drown in the rounding of the large ones), the target is handed back. In late,
concentrated states this is most targets (rounding, not truncation: a larger L does not help).
Measured at nside 32, β = 30, two vMF peaks: over a 10⁻³ floor the flagged targets' true errors
were ≤ 4e-11 (the estimate is ~3–10× cautious); over a 10⁻⁶ floor they reached 2e-7.

Tilted regional expansions (tilted_pass) serve the targets handed back. They are grouped by
HEALPix pixel R of target space (centre x_R); with s_R = βBᵀx_R and w = βBᵀx − s_R,

    Σ_j μ_j e^{⟨βBᵀx, y_j⟩} g(y_j) = Σ_j (μ_j e^{⟨s_R, y_j⟩}) e^{⟨w, y_j⟩} g(y_j),

and only e^{⟨w, y⟩} is expanded (about ŵ, degree from |w| ≤ βσ_max·(pixel radius) ≤ TILT_MAX_W),
with the coefficients of the tilted masses. The terms then span at most e^{2|w|} of the sum
however empty the region, so the same error budget passes where the global one failed. The
coefficients of all regions come from one matrix product per block of sources (BLAS), for the
tilted masses alone at degree L + 2: the moments' coefficients follow exactly from those by the
sparse maps of moment_maps (g Y_ℓm is a harmonic polynomial of degree ≤ ℓ + 2), 4–10× fewer
multiply-adds than summing each moment. The targets still over budget get a second try in
pixels half as wide (|w| halved: their terms span e^{|w|} less; TILT_LEVELS). What is still over
budget after that is handed to the caller, spherepde.summation.field, which re-sums it by the
tree where that pays (field.FALLBACK_TREE_CAP_FRACTION), else directly. Measured on the
quick-start run refined to nside 128 (spherepde.validation.concentrated_cost): at
t = 6 (density 2e-11 … 150) one evaluation at the 786 432 edge points took 3.8 s with one level
and 4 % of the targets left to the tree, against 30 s with 82 % without the tilted regions.
L is the smallest degree whose tail is below TAIL_FRACTION·tol, L ≈ √(70 κ_max): the cost grows with
κ, so this is the method for moderate β; the tree takes large β.
"""

from __future__ import annotations

import math
import threading

import healpy as hp
import numpy as np
import scipy.sparse
from numba import get_num_threads, njit, prange

from .kernels import (
    SUMS,
    finish_target,
    kernel_direction,
    no_log_partition,
    write_back,
)

__all__ = ["harmonic_degree", "harmonic_softmax", "scaled_bessel", "harmonic_row"]

TAIL_FRACTION = 1e-5  # truncation error per unit mass (relative to the largest kernel value) ≤
# this × tol: the bound 2·tail·M̃/Z then uses ≤ 1e-5·2κ·(max f/f near the peak) of tol
MAX_DEGREE = 400
TILT_MAX_W = 8.0  # tilted regions: |w| ≤ this, so a region's terms span at most e^{2·8} of its sums
TILT_MAX_NSIDE = 16  # finer regions (large β) are left to the tree
TILT_LEVELS = 2  # region levels tried in turn: what one level hands on goes to pixels half as wide
# (|w| halves, so the terms span e^{|w|} less); at nside 128, t = 6 of the quick-start run, the second
# level served all 31 485 targets the first handed on in 1.34 s where the tree took 1.50 s, and the cell
# evaluation that follows reuses its regions


@njit(cache=True)
def scaled_bessel(kappa, shift, out):
    """out[ℓ] = i_ℓ(κ) e^{−shift} for ℓ = 0 … len(out) − 1 (modified spherical Bessel functions of
    the first kind, i_0(κ) = sinh κ/κ), by Miller's backward recurrence
    i_{ℓ−1} = i_{ℓ+1} + (2ℓ + 1)/κ · i_ℓ, normalised by i_0 (stable: i_ℓ is the minimal solution)."""
    n = out.size
    if kappa < 1e-8:  # i_ℓ(κ) = κ^ℓ/(2ℓ+1)!! (1 + O(κ²))
        term = math.exp(-shift)
        for l in range(n):
            out[l] = term
            term *= kappa / (2 * l + 3)
        return
    start = n + 20 + int(kappa)
    inv = 1.0 / kappa
    upper = 0.0
    current = 1e-280
    for l in range(start, 0, -1):
        lower = upper + (2 * l + 1) * inv * current  # i_{l−1}
        upper = current
        current = lower
        if l - 1 < n:
            out[l - 1] = current
        if current > 1e250:  # rescale everything stored so far
            upper *= 1e-250
            current *= 1e-250
            for k in range(l - 1, n):
                out[k] *= 1e-250
    # i_0(κ) e^{−shift} = (e^{κ−shift} − e^{−κ−shift})/(2κ)
    i0 = (math.exp(kappa - shift) - math.exp(-kappa - shift)) / (2.0 * kappa)
    scale = i0 / out[0]
    for l in range(n):
        out[l] *= scale


PAD = 8  # the inner loops of harmonic_row run to a multiple of PAD (no scalar remainders)


@njit(cache=True)
def _legendre_tables(L):
    """Recurrence coefficients of the normalised Q_ℓm = P̄_ℓm / sin^m θ: Q_mm (L+1,), a and b
    (L+1, L+1+PAD) with Q_ℓm = a_ℓm (t Q_{ℓ−1,m} − b_ℓm Q_{ℓ−2,m}) for m < ℓ (row ℓ contiguous;
    zero for m ≥ ℓ, so padded loops compute zeros there)."""
    qmm = np.empty(L + 1)
    qmm[0] = 1.0 / math.sqrt(4.0 * math.pi)
    for m in range(1, L + 1):
        qmm[m] = qmm[m - 1] * math.sqrt((2.0 * m + 1.0) / (2.0 * m))
    a = np.zeros((L + 1, L + 1 + PAD))
    b = np.zeros((L + 1, L + 1 + PAD))
    for l in range(1, L + 1):
        a[l, l - 1] = math.sqrt(2.0 * l + 1.0)  # Q_{ℓ,ℓ−1} = √(2ℓ+1) t Q_{ℓ−1,ℓ−1} (b = 0)
    for m in range(L + 1):
        for l in range(m + 2, L + 1):
            a[l, m] = math.sqrt((4.0 * l * l - 1.0) / (l * l - m * m))
            b[l, m] = math.sqrt(((l - 1.0) ** 2 - m * m) / (4.0 * (l - 1.0) ** 2 - 1.0))
    return qmm, a, b


@njit(cache=True)
def row_length(L):
    """Length of a harmonic_row output: the cos half (L + 1)(L + 2)/2, PAD, the sin half, PAD
    (the padding takes the zeros the padded loops write past a half)."""
    return (L + 1) * (L + 2) + 2 * PAD


def work_arrays(L):
    """(trig, q) work arrays of harmonic_row."""
    return np.zeros((2, L + 1 + PAD)), np.zeros((3, L + 1 + PAD))


@njit(cache=True, fastmath=SUMS)
def harmonic_row(x0, x1, x2, L, qmm, a, b, wl, trig, q, row):
    """Real orthonormal spherical harmonics of the unit vector x at all degrees ≤ L, each
    multiplied by the degree weight wl[ℓ], degree-major in two halves (n = (L + 1)(L + 2)/2 + PAD):
    row[ℓ(ℓ+1)/2 + m] = wl[ℓ] Q_ℓm(z) c_m and row[n + ℓ(ℓ+1)/2 + m] = wl[ℓ] Q_ℓm(z) s_m for
    m = 0 … ℓ (s₀ = 0: those entries are 0), with Q_ℓm = P̄_ℓm/sin^m θ and c_m + i s_m =
    √2 (x₀ + i x₁)^m (c₀ = 1): no division by sin θ, so the poles are regular.

    The Legendre recurrence runs over ℓ with all orders m at once, fused with the writes: the
    inner loop vectorises and no latency chain is on the critical path. It runs to a multiple
    of PAD; the tables are zero-padded, so the extra values are zeros and land where later
    degrees write or in the padding (row: row_length(L) entries, zero-initialised once, so the
    padding stays 0). Work arrays from work_arrays(L)."""
    root2 = math.sqrt(2.0)
    trig[0, 0] = 1.0
    trig[1, 0] = 0.0
    # (x₀ + i x₁)^m in two interleaved chains (odd and even m, steps of w = (x₀ + i x₁)²): half
    # the latency of one chain of complex products
    w_re = x0 * x0 - x1 * x1
    w_im = 2.0 * x0 * x1
    odd_re = x0
    odd_im = x1
    even_re = w_re
    even_im = w_im
    for m in range(1, L + 1, 2):
        trig[0, m] = root2 * odd_re
        trig[1, m] = root2 * odd_im
        if m + 1 <= L:
            trig[0, m + 1] = root2 * even_re
            trig[1, m + 1] = root2 * even_im
        odd_re, odd_im = odd_re * w_re - odd_im * w_im, odd_re * w_im + odd_im * w_re
        even_re, even_im = even_re * w_re - even_im * w_im, even_re * w_im + even_im * w_re
    cos_m = trig[0]
    sin_m = trig[1]
    q2 = q[0]  # Q_{ℓ−2, ·}
    q1 = q[1]  # Q_{ℓ−1, ·}
    q0 = q[2]  # Q_{ℓ, ·}
    for m in range(q.shape[1]):
        q2[m] = 0.0
        q1[m] = 0.0
        q0[m] = 0.0
    half = (L + 1) * (L + 2) // 2 + PAD
    q1[0] = qmm[0]
    row[0] = wl[0] * qmm[0]
    row[half] = 0.0
    for l in range(1, L + 1):
        al = a[l]
        bl = b[l]
        w = wl[l]
        base = l * (l + 1) // 2
        cos_part = row[base:]  # views: indices provably ≥ 0, so the loop vectorises
        sin_part = row[half + base:]
        for m in range((l + PAD - 1) // PAD * PAD):  # m ≥ ℓ − 1: b = 0; m ≥ ℓ: a = 0
            value = al[m] * (x2 * q1[m] - bl[m] * q2[m])
            q0[m] = value
            value *= w
            cos_part[m] = value * cos_m[m]
            sin_part[m] = value * sin_m[m]
        q0[l] = qmm[l]
        cos_part[l] = w * qmm[l] * cos_m[l]
        sin_part[l] = w * qmm[l] * sin_m[l]
        q2, q1, q0 = q1, q0, q2


def tail_target(tol):
    """The truncation target of a summation with relative tolerance tol."""
    return max(TAIL_FRACTION * tol, 1e-20)


def harmonic_degree(kappa_max, tail_target=1e-15):
    """(L, tail): the smallest degree with Σ_{ℓ>L} (2ℓ + 1) i_ℓ(κ_max) e^{−κ_max} ≤ tail_target,
    and that tail (≥ the truncation error per unit mass)."""
    n = MAX_DEGREE + 80
    values = np.empty(n)
    scaled_bessel(float(kappa_max), float(kappa_max), values)
    terms = (2.0 * np.arange(n) + 1.0) * values
    tails = np.cumsum(terms[::-1])[::-1]  # tails[l] = Σ_{ℓ≥l}
    for L in range(MAX_DEGREE + 1):
        if tails[L + 1] <= tail_target:
            return L, float(tails[L + 1])
    return MAX_DEGREE, float(tails[MAX_DEGREE + 1])


GROUP = 4  # points whose harmonics are contracted together (4 × 4 sums held in registers)
BLOCK = 16  # targets per parallel work item (a multiple of GROUP)


@njit(cache=True, fastmath=SUMS)
def _contract4(rows, coef_t, q0, mom, t0):
    """mom[q0 + r, t0 + s] = Σ_k rows[s, k]·coef_t[q0 + r, k] for r, s < 4: four points against four
    moments, k innermost, 16 sums in registers (one load per 4 multiply-adds)."""
    ra = rows[0]
    rb = rows[1]
    rc = rows[2]
    rd = rows[3]
    c0 = coef_t[q0]
    c1 = coef_t[q0 + 1]
    c2 = coef_t[q0 + 2]
    c3 = coef_t[q0 + 3]
    s00 = s01 = s02 = s03 = 0.0
    s10 = s11 = s12 = s13 = 0.0
    s20 = s21 = s22 = s23 = 0.0
    s30 = s31 = s32 = s33 = 0.0
    for k in range(c0.size):
        r0 = ra[k]
        r1 = rb[k]
        r2 = rc[k]
        r3 = rd[k]
        c = c0[k]
        s00 += r0 * c
        s01 += r1 * c
        s02 += r2 * c
        s03 += r3 * c
        c = c1[k]
        s10 += r0 * c
        s11 += r1 * c
        s12 += r2 * c
        s13 += r3 * c
        c = c2[k]
        s20 += r0 * c
        s21 += r1 * c
        s22 += r2 * c
        s23 += r3 * c
        c = c3[k]
        s30 += r0 * c
        s31 += r1 * c
        s32 += r2 * c
        s33 += r3 * c
    mom[q0, t0] = s00
    mom[q0, t0 + 1] = s01
    mom[q0, t0 + 2] = s02
    mom[q0, t0 + 3] = s03
    mom[q0 + 1, t0] = s10
    mom[q0 + 1, t0 + 1] = s11
    mom[q0 + 1, t0 + 2] = s12
    mom[q0 + 1, t0 + 3] = s13
    mom[q0 + 2, t0] = s20
    mom[q0 + 2, t0 + 1] = s21
    mom[q0 + 2, t0 + 2] = s22
    mom[q0 + 2, t0 + 3] = s23
    mom[q0 + 3, t0] = s30
    mom[q0 + 3, t0 + 1] = s31
    mom[q0 + 3, t0 + 2] = s32
    mom[q0 + 3, t0 + 3] = s33


@njit(cache=True, fastmath=SUMS)
def _accumulate4(rows, g, coef_t):
    """coef_t[q, k] += Σ_s g[q, s]·rows[s, k] for four sources s, four moments q at a time
    (k innermost: each row value is loaded once per four moments)."""
    ra = rows[0]
    rb = rows[1]
    rc = rows[2]
    rd = rows[3]
    for q0 in range(0, coef_t.shape[0], 4):
        c0 = coef_t[q0]
        c1 = coef_t[q0 + 1]
        c2 = coef_t[q0 + 2]
        c3 = coef_t[q0 + 3]
        g00, g01, g02, g03 = g[q0, 0], g[q0, 1], g[q0, 2], g[q0, 3]
        g10, g11, g12, g13 = g[q0 + 1, 0], g[q0 + 1, 1], g[q0 + 1, 2], g[q0 + 1, 3]
        g20, g21, g22, g23 = g[q0 + 2, 0], g[q0 + 2, 1], g[q0 + 2, 2], g[q0 + 2, 3]
        g30, g31, g32, g33 = g[q0 + 3, 0], g[q0 + 3, 1], g[q0 + 3, 2], g[q0 + 3, 3]
        for k in range(c0.size):
            r0 = ra[k]
            r1 = rb[k]
            r2 = rc[k]
            r3 = rd[k]
            c0[k] += g00 * r0 + g01 * r1 + g02 * r2 + g03 * r3
            c1[k] += g10 * r0 + g11 * r1 + g12 * r2 + g13 * r3
            c2[k] += g20 * r0 + g21 * r1 + g22 * r2 + g23 * r3
            c3[k] += g30 * r0 + g31 * r1 + g32 * r2 + g33 * r3


@njit(cache=True, parallel=True)
def _coefficients(sources, mu, L, qmm, a, b, parts):
    """parts[p, q, k] = Σ_j μ_j g_q(y_j) Y_k(y_j) over the p-th chunk of the sources, g = 1, y,
    y yᵀ (upper triangle) for the parts' first 4 or 10 rows q (any further rows stay 0); their
    sum over p is d_ℓm[g] (module docstring), k in harmonic_row order."""
    nparts = parts.shape[0]
    nmom = min(parts.shape[1], 10)
    nsource = sources.shape[0]
    ngroups = (nsource + GROUP - 1) // GROUP
    per_part = (ngroups + nparts - 1) // nparts
    for p in prange(nparts):
        coef_t = parts[p]
        coef_t[:, :] = 0.0
        ones = np.ones(L + 1)
        trig = np.zeros((2, L + 1 + PAD))
        q = np.zeros((3, L + 1 + PAD))
        rows = np.zeros((GROUP, row_length(L)))
        g = np.zeros((parts.shape[1], GROUP))
        for grp in range(p * per_part, min(ngroups, (p + 1) * per_part)):
            for s in range(GROUP):
                j = grp * GROUP + s
                if j >= nsource:  # padding: no mass
                    for r in range(nmom):
                        g[r, s] = 0.0
                    continue
                y0 = sources[j, 0]
                y1 = sources[j, 1]
                y2 = sources[j, 2]
                w = mu[j]
                g[0, s] = w
                g[1, s] = w * y0
                g[2, s] = w * y1
                g[3, s] = w * y2
                if nmom == 10:
                    g[4, s] = w * y0 * y0
                    g[5, s] = w * y0 * y1
                    g[6, s] = w * y0 * y2
                    g[7, s] = w * y1 * y1
                    g[8, s] = w * y1 * y2
                    g[9, s] = w * y2 * y2
                harmonic_row(y0, y1, y2, L, qmm, a, b, ones, trig, q, rows[s])
            _accumulate4(rows, g, coef_t)


@njit(cache=True)
def _block_moments(targets, i0, coef_t, L, qmm, a, b, rounding, BT, beta, shift, wl, trig, q, rows, mom,
                   tnorm, t0_weight, series):
    """The moments mom[:, t] of the BLOCK targets i0 + t (past the end: the last target again), in
    groups of GROUP: per target the weighted harmonic row of t = 4π i_ℓ(κ)e^{−κ} Y_ℓm(x'), then
    four points × four moments contracted with coef_t; also the error-budget inputs ‖t‖₂ (tnorm),
    t₀ (t0_weight) and Σ_ℓ w_ℓ·rounding[ℓ] (series). The rest are work arrays (_evaluate)."""
    ntarget = targets.shape[0]
    kappa_prev = -1.0
    norm_prev = 0.0
    series_prev = 0.0
    for grp in range(BLOCK // GROUP):
        for s in range(GROUP):
            t = grp * GROUP + s
            i = min(i0 + t, ntarget - 1)  # padding repeats the last target
            w0, w1, w2, _, _, _, _ = kernel_direction(BT, beta, targets[i, 0], targets[i, 1], targets[i, 2])
            w0 -= shift[0]
            w1 -= shift[1]
            w2 -= shift[2]
            kappa = math.sqrt(w0 * w0 + w1 * w1 + w2 * w2)
            if kappa > 0.0:
                v0, v1, v2 = w0 / kappa, w1 / kappa, w2 / kappa
            else:
                v0, v1, v2 = 0.0, 0.0, 1.0  # κ = 0: any unit vector (only ℓ = 0 contributes)
            # a scaled orthogonal B: one κ for all targets, up to rounding (a relative change
            # of 1e-14 in κ changes the weights' ratios by ~1e-14·ℓ: far below tol)
            if abs(kappa - kappa_prev) > 1e-14 * kappa:
                scaled_bessel(kappa, kappa, wl)
                s2 = 0.0
                series_prev = 0.0
                for l in range(L + 1):
                    wl[l] *= 4.0 * math.pi
                    s2 += wl[l] * wl[l] * (2 * l + 1)
                    series_prev += wl[l] * rounding[l]
                norm_prev = math.sqrt(s2 / (4.0 * math.pi))
                kappa_prev = kappa
            tnorm[t] = norm_prev
            series[t] = series_prev
            t0_weight[t] = wl[0]
            harmonic_row(v0, v1, v2, L, qmm, a, b, wl, trig, q, rows[s])
        for q0 in range(0, coef_t.shape[0], 4):
            _contract4(rows, coef_t, q0, mom, grp * GROUP)


@njit(cache=True, parallel=True)
def _evaluate(targets, coef_t, L, qmm, a, b, err, noise, rounding, tol, BT, beta, shift, V, want_div,
              velocity, divergence, mean, fallback, nthreads, logz, log_offset, added):
    """For each target: t = 4π i_ℓ(κ)e^{−κ} Y_ℓm(x') with w = βBᵀx − shift, x' = w/|w|, κ = |w|
    (shift = 0: the global expansion; else the tilted one of a region, whose coefficients carry
    the factor e^{⟨shift, y⟩}), contracted with the coefficients coef_t (moments × harmonics, 4 or
    12 rows), then finished (velocity, divergence, mean); a target whose error bound
    2·(err + noise₀‖t‖₂ + noise₁t₀ + Σ_ℓ w_ℓ·rounding[ℓ])/Z exceeds tol is marked for re-summing
    (fallback[i] = 1); rounding[ℓ] is the series' rounding per unit weight of degree ℓ
    (_expansion_pass); nthreads: numba.get_num_threads() (sets the number of work chunks).
    logz (T,) or length 0: log Z = ln z + κ + log_offset, z the zeroth moment (its terms carry
    e^{−κ}), log_offset the log of the masses' unit (ln max μ, plus top_R for a tilted region).
    added (T,) or length 0: ln Z_add of point sources the caller adds to these sums exactly
    (harmonic_softmax); the budget is then min(tol·(z + z_add), z/2), z_add = e^{added − κ − log_offset}."""
    nmom = 10 if want_div else 4
    ntarget = targets.shape[0]
    nblocks = (ntarget + BLOCK - 1) // BLOCK
    nchunks = min(nblocks, 8 * nthreads)
    per_chunk = (nblocks + nchunks - 1) // max(nchunks, 1)  # no targets: no chunks
    for chunk in prange(nchunks):
        # work arrays once per chunk, not per block: allocating and zeroing the rows for every
        # 16 targets cost ~8 % of an evaluation (measured at nside 64: 159 → 147 ms)
        wl = np.empty(L + 1)
        trig = np.zeros((2, L + 1 + PAD))
        q = np.zeros((3, L + 1 + PAD))
        rows = np.zeros((GROUP, row_length(L)))
        mom = np.empty((coef_t.shape[0], BLOCK))
        tnorm = np.empty(BLOCK)  # ‖t‖₂
        t0_weight = np.empty(BLOCK)  # t₀ = 4π i_0(κ) e^{−κ} / √(4π)
        series = np.empty(BLOCK)  # Σ_ℓ w_ℓ rounding[ℓ]: the rounding of the target's own series
        momt = np.empty(nmom)
        for blk in range(chunk * per_chunk, min(nblocks, (chunk + 1) * per_chunk)):
            i0 = blk * BLOCK
            _block_moments(targets, i0, coef_t, L, qmm, a, b, rounding, BT, beta, shift, wl, trig, q, rows,
                           mom, tnorm, t0_weight, series)
            for t in range(min(BLOCK, ntarget - i0)):
                i = i0 + t
                for r in range(nmom):
                    momt[r] = mom[r, t]
                bound = err + noise[0] * tnorm[t] + noise[1] * t0_weight[t] + series[t]
                kappa = 0.0  # |w| = |βBᵀx − shift|: the target-side scale e^{−κ}, when needed
                if added.size or logz.size:
                    w0, w1, w2, _, _, _, _ = kernel_direction(BT, beta, targets[i, 0], targets[i, 1],
                                                              targets[i, 2])
                    kappa = math.sqrt((w0 - shift[0]) ** 2 + (w1 - shift[1]) ** 2 + (w2 - shift[2]) ** 2)
                budget = tol * momt[0]
                if added.size:
                    z_add = math.exp(min(added[i] - kappa - log_offset, 700.0))
                    budget = min(tol * (momt[0] + z_add), 0.5 * momt[0])
                if not (momt[0] > 0.0 and 2.0 * bound <= budget):
                    fallback[i] = 1
                    continue
                fallback[i] = 0
                finish_target(i, targets[i, 0], targets[i, 1], targets[i, 2], 0.0, 0.0, 0.0, momt, BT,
                               beta, V, want_div, velocity, divergence, mean)
                if logz.size:
                    logz[i] = math.log(momt[0]) + kappa + log_offset


@njit(cache=True, parallel=True)
def _source_rows(sources, L, qmm, a, b, out):
    """out[j] = the harmonic_row of sources[j] (Y_k(y_j), k in harmonic_row order, no weights).
    out must start zeroed: harmonic_row leaves its padding untouched."""
    for j in prange(sources.shape[0]):
        ones = np.ones(L + 1)
        trig = np.zeros((2, L + 1 + PAD))
        q = np.zeros((3, L + 1 + PAD))
        harmonic_row(sources[j, 0], sources[j, 1], sources[j, 2], L, qmm, a, b, ones, trig, q, out[j])


def _moment_factors(sources, rows):
    """g_q(y_j) (rows × n): 1, y, y yᵀ (upper triangle) for the first 4 or 10 rows, then 0."""
    y0, y1, y2 = sources[:, 0], sources[:, 1], sources[:, 2]
    g = np.zeros((rows, len(sources)))
    g[0] = 1.0
    g[1], g[2], g[3] = y0, y1, y2
    if rows > 4:
        g[4], g[5], g[6], g[7], g[8], g[9] = y0 * y0, y0 * y1, y0 * y2, y1 * y1, y1 * y2, y2 * y2
    return g


def sphere_quadrature(n):
    """(points (n(2n − 1), 3), weights): Gauss–Legendre in z = cos θ with n nodes times the
    trapezoidal rule in φ with 2n − 1 nodes, exact for polynomials of degree ≤ 2n − 1 on S²."""
    z, wz = np.polynomial.legendre.leggauss(n)
    nphi = 2 * n - 1
    phi = 2.0 * math.pi * np.arange(nphi) / nphi
    r = np.sqrt(1.0 - z * z)
    points = np.stack([np.outer(r, np.cos(phi)), np.outer(r, np.sin(phi)), np.outer(z, np.ones(nphi))], axis=-1)
    weights = np.outer(wz, np.full(nphi, 2.0 * math.pi / nphi))
    return points.reshape(-1, 3), weights.ravel()


_MOMENT_MAPS = {}


def moment_maps(L):
    """The ten sparse matrices M_q (row_length(L) × row_length(L + 2)) with

        Σ_j μ_j g_q(y_j) Y_k(y_j) = Σ_k' M_q[k, k'] d_k',   d_k' = Σ_j μ_j Y_k'(y_j),

    g_q = 1, y, y yᵀ (upper triangle) as in _moment_factors, k ≤ degree L, k' ≤ L + 2 (harmonic_row
    order). Exact, not an approximation: g_q Y_k is a polynomial of degree ≤ L + 2, so it is its own
    expansion M_q[k, ·] = ∫ g_q Y_k Y_k' dA, and a quadrature exact to degree 2L + 4 computes it.
    The ten moment coefficients of any measure then cost one coefficient sum at degree L + 2
    (about 10× fewer multiply-adds per source) and these sparse products."""
    if L not in _MOMENT_MAPS:
        qmm, a, b = _legendre_tables(L)
        qmm2, a2, b2 = _legendre_tables(L + 2)
        points, weights = sphere_quadrature(L + 3)
        rows = np.zeros((len(points), row_length(L)))
        rows2 = np.zeros((len(points), row_length(L + 2)))
        _source_rows(points, L, qmm, a, b, rows)
        _source_rows(points, L + 2, qmm2, a2, b2, rows2)
        g = _moment_factors(points, 10) * weights
        maps = []
        for q in range(10):
            m = (rows * g[q][:, None]).T @ rows2
            m[np.abs(m) < 1e-12] = 0.0  # quadrature round-off where the integral is 0
            maps.append(scipy.sparse.csr_matrix(m))
        _MOMENT_MAPS[L] = maps
    return _MOMENT_MAPS[L]


def tilt_region_nside(beta_sigma):
    """The coarsest HEALPix level whose pixels (target regions) keep |w| ≤ TILT_MAX_W (w = βBᵀ(x − x_R),
    |w| ≤ βσ_max(B)·(pixel radius)), or None above TILT_MAX_NSIDE (large β: the tree's domain)."""
    nside = 1
    while beta_sigma * hp.max_pixrad(nside) > TILT_MAX_W:
        nside *= 2
        if nside > TILT_MAX_NSIDE:
            return None
    return nside


def region_coefficients(sources, mu, shifts, L2):
    """For each region (row of shifts, s_R): the coefficients to degree L2 of the tilted masses
    μ_j e^{⟨s_R, y_j⟩ − top_R} (≤ 1, top_R their largest exponent: overflow-safe), with the sums
    of the tilted masses and of their squares: (coef0 (regions, row_length(L2)), s1, s2, top). One
    matrix product per block of sources, (regions, block) × (block, harmonics)."""
    nreg = len(shifts)
    log_mu = np.log(mu)
    block = int(min(8192, max(256, 2**22 // nreg)))  # (regions, block) weights: ≤ 32 MB
    top = np.full(nreg, -np.inf)
    for j0 in range(0, len(mu), block):
        expo = shifts @ sources[j0:j0 + block].T + log_mu[j0:j0 + block]
        np.maximum(top, expo.max(axis=1), out=top)
    qmm2, a2, b2 = _legendre_tables(L2)
    coef0 = np.zeros((nreg, row_length(L2)))
    s1 = np.zeros(nreg)
    s2 = np.zeros(nreg)
    harmonics = np.zeros((block, row_length(L2)))  # the padding stays 0 (_source_rows)
    for j0 in range(0, len(mu), block):
        y = np.ascontiguousarray(sources[j0:j0 + block])
        weights = np.exp(shifts @ y.T + log_mu[j0:j0 + block] - top[:, None])  # (regions, block)
        s1 += weights.sum(axis=1)
        s2 += (weights * weights).sum(axis=1)
        rows_y = harmonics[:len(y)]
        _source_rows(y, L2, qmm2, a2, b2, rows_y)
        coef0 += weights @ rows_y
    return coef0, s1, s2, top


class _RegionCache(threading.local):
    """The coefficients of the last MEASURES source measures: the global ones (_global_pass) and the
    tilted ones per region level and region. The edge and the cell evaluations of one velocity
    refresh sum the same density over largely the same regions (the cells' are nearly always among
    the edges'), so the second pays only for new regions; and the paths of the tails
    (spherepde.solvers.tails) evaluate the field of two states, linear in time between them, at
    every Runge–Kutta stage, so each state's coefficients are computed once per coupling, not at
    every stage (with one measure held they were recomputed at every call, alternating). Keyed by
    the sources and the masses (compared by value), then by the model (β, B: the heads of a
    multi-head model, spherepde.models.heads, each keep theirs for the same measure, so that H heads
    cost H single-head sums), then by region level, degree and pixel; the global coefficients by
    degree and moment rows. The measure used least recently is dropped beyond MEASURES. Per thread
    (sweeps may run solvers in threads)."""

    MEASURES = 4

    def __init__(self):
        self.held = []  # [(sources, masses), models, global coefficients], most recently used first
        self.measure = None  # (sources, masses) of the measure in use
        self.models = {}  # its model key → rows
        self.rows = {}  # of the last model: (level, degree, region pixel) → (coef0 row, s1, s2)
        self.globals = {}  # its global coefficients: (degree, moment rows) → coef_t

    def use(self, sources, mu):
        """Make (sources, mu) the measure in use: its entry moved first, or a new one (the least
        recently used dropped beyond MEASURES)."""
        for i, entry in enumerate(self.held):
            if self._same(entry[0], sources, mu):
                self.held.insert(0, self.held.pop(i))
                break
        else:
            self.held.insert(0, [(sources.copy(), mu.copy()), {}, {}])
            del self.held[self.MEASURES:]
        self.measure, self.models, self.globals = self.held[0]

    @staticmethod
    def _same(measure, sources, mu):
        return (measure[0].shape == sources.shape and measure[1].shape == mu.shape
                and np.array_equal(measure[1], mu) and np.array_equal(measure[0], sources))

    def global_coefficients(self, sources, mu, L, rows):
        """The sum over the sources of _coefficients' parts, (rows, row_length(L)), from the cache
        where it holds them (shared by every caller of this measure: not to be written)."""
        self.use(sources, mu)
        key = (L, rows)
        if key not in self.globals:
            qmm, a, b = _legendre_tables(L)
            parts = np.empty((max(1, min(get_num_threads(), len(mu))), rows, row_length(L)))
            _coefficients(sources, mu, L, qmm, a, b, parts)
            self.globals[key] = parts.sum(axis=0)
        return self.globals[key]

    def coefficients(self, sources, mu, nside, regions, shifts, L2, model_key):
        """region_coefficients for the regions (pixels at nside, with their shifts), from the
        cache where it holds them. model_key: what else the shifts depend on (β, B)."""
        self.use(sources, mu)
        self.rows = self.models.setdefault(model_key, {})
        keys = [(nside, L2, r) for r in regions.tolist()]
        missing = np.array([k not in self.rows for k in keys], dtype=bool)
        if missing.any():
            new = region_coefficients(sources, mu, shifts[missing], L2)
            new_keys = [k for k, miss in zip(keys, missing) if miss]
            for i, k in enumerate(new_keys):
                self.rows[k] = (new[0][i], new[1][i], new[2][i], new[3][i])
        got = [self.rows[k] for k in keys]
        return (np.array([g[0] for g in got]).reshape(len(regions), -1), np.array([g[1] for g in got]),
                np.array([g[2] for g in got]), np.array([g[3] for g in got]))


_REGION_CACHE = _RegionCache()


def tilted_pass(model, sources, mu, targets, redo, tol, want_div, velocity, divergence, mean, logz=None,
                ln_top=0.0, added=None):
    """Re-evaluate the targets `redo` by tilted regional expansions (module docstring): group them by
    HEALPix pixel R of target space (centre x_R), tilt the masses by e^{⟨s_R, y⟩}, s_R = βBᵀx_R,
    and expand only e^{⟨w, y⟩}, w = βBᵀx − s_R. The coefficients of all regions come from one
    matrix product per block of sources, (regions, block) × (block, harmonics to degree L + 2),
    and moment_maps. Regions are HEALPix pixels at tilt_region_nside (the degree follows from the
    pixel radius); the targets still over their budget there get a second try in pixels half as
    wide (TILT_LEVELS). Writes the outputs of the targets within the error budget (and their log Z
    into logz, if given: mu = μ/max μ, ln_top = ln max μ; added: harmonic_softmax); returns the
    indices still over it."""
    BT = np.ascontiguousarray(model.B.T, dtype=float)
    beta = float(model.beta)
    beta_sigma = beta * float(np.linalg.norm(BT, 2))
    nside = tilt_region_nside(beta_sigma)
    if nside is None or len(mu) == 0:
        return redo
    for _ in range(TILT_LEVELS):
        if redo.size == 0 or nside > TILT_MAX_NSIDE:
            break
        redo = _tilted_level(model, BT, beta, beta_sigma, nside, sources, mu, targets, redo, tol, want_div,
                             velocity, divergence, mean, logz, ln_top, added)
        nside *= 2
    return redo


def _tilted_level(model, BT, beta, beta_sigma, nside, sources, mu, targets, redo, tol, want_div, velocity,
                  divergence, mean, logz=None, ln_top=0.0, added=None):
    """tilted_pass with regions at one HEALPix level nside (BT = Bᵀ, beta_sigma = β σ_max(B));
    returns the targets still over budget."""
    L, tail = harmonic_degree(min(TILT_MAX_W, beta_sigma * hp.max_pixrad(nside)), tail_target(tol))
    nk = row_length(L)
    rows = 12 if want_div else 4
    pix = hp.vec2pix(nside, *np.asarray(targets[redo]).T, nest=True)
    regions, region_of = np.unique(pix, return_inverse=True)
    centres = np.array(hp.pix2vec(nside, regions, nest=True)).T.reshape(-1, 3)
    shifts = beta * centres @ BT.T  # s_R = βBᵀx_R, one per row
    nreg = len(regions)
    coef0, s1, s2, top = _REGION_CACHE.coefficients(sources, mu, nside, regions, shifts, L + 2, (beta, BT.tobytes()))
    coef = np.zeros((nreg, rows, nk))  # rows 10, 11 (padding of the contraction) stay 0
    coef0_t = np.ascontiguousarray(coef0.T)
    for q, m in enumerate(moment_maps(L)[:10 if want_div else 4]):
        coef[:, q, :] = (m @ coef0_t).T
    still = []
    n = len(mu)
    # the targets of each region: one sort, not a scan of all targets per region
    order = np.argsort(region_of, kind="stable")
    bounds = np.searchsorted(region_of[order], np.arange(nreg + 1))
    for r in range(nreg):
        idx = redo[order[bounds[r]:bounds[r + 1]]]
        sub = np.ascontiguousarray(targets[idx])
        out = (np.empty((len(idx), 3)), np.empty(len(idx)), np.empty((len(idx), 3)),
               np.empty(len(idx) if logz is not None and logz.size else 0))
        # the budget of _expansion_pass from the region's tilted masses, summarised by their sums
        stats = _MassSummary(n, s1[r], s2[r])
        fallback = _expansion_pass(sub, coef[r], stats, L, tail, tol, BT, beta, shifts[r], model.V, want_div,
                                   *out[:3], out[3], ln_top + top[r],
                                   None if added is None else np.ascontiguousarray(added[idx]))
        good = fallback == 0
        write_back(idx, out, good, want_div, velocity, divergence, mean, logz)
        still.append(idx[~good])
    return np.concatenate(still) if still else redo[:0]


class _MassSummary:
    """What the error budget needs of normalised masses: their count, sum and sum of squares."""

    def __init__(self, n, total, squares):
        self.n, self.total, self.squares = n, float(total), float(squares)

    def __len__(self):
        return self.n

    def sum(self):
        return self.total


def degree_norms(row, L):
    """‖d_ℓ·‖₂ per degree ℓ ≤ L of a coefficient row in harmonic_row order (cos and sin halves)."""
    half = (L + 1) * (L + 2) // 2 + PAD
    squares = row[:half - PAD] ** 2 + row[half:2 * half - PAD] ** 2
    degree = np.repeat(np.arange(L + 1), np.arange(1, L + 2))  # entry ℓ(ℓ+1)/2 + m has degree ℓ
    return np.sqrt(np.bincount(degree, weights=squares, minlength=L + 1))


def _expansion_pass(targets, coef_t, mu, L, tail, tol, BT, beta, shift, V, want_div, velocity, divergence,
                    mean, logz=None, log_offset=0.0, added=None):
    """Evaluate the targets from the coefficients coef_t of the normalised masses mu (max 1) with
    the error budget of the module docstring; returns the flags of the targets over it. logz:
    None, or an array that receives log Z + log_offset (the log of the masses' unit). added: None,
    or ln Z_add per target (harmonic_softmax)."""
    qmm, a, b = _legendre_tables(L)
    eps = np.finfo(float).eps
    n = len(mu)
    # error budget of a target's moments (module docstring): the truncation, rigorous; the
    # rounding of the coefficient sums, estimated as random walks (4ε√N·rms(μ g Y) per
    # coefficient, seen through ‖t‖₂; the ℓ = 0 sum, whose partial sums grow linearly,
    # 4ε N^{3/2} mean(μ)/√(4π) seen through t₀); and of the target's own series,
    # 4(L+1)ε Σ|terms| ≤ 4(L+1)ε Σ_ℓ w_ℓ √((2ℓ+1)/4π) ‖d_ℓ·[1]‖₂ (Cauchy–Schwarz per degree, with
    # the addition theorem Σ_m Y_ℓm² = (2ℓ+1)/4π: tighter than over all degrees at once, which
    # sent targets with true errors ≤ 2e-12 back at tol 1e-10)
    # Σμ² without BLAS: an OpenBLAS dot product this long wakes its worker threads, which then
    # spin for ~0.1 s on the cores the evaluation below needs (measured: 190 instead of 145 ms)
    total, squares = ((mu.total, mu.squares) if isinstance(mu, _MassSummary)
                      else (float(mu.sum()), float(np.square(mu).sum())))
    err = tail * total
    noise = np.array([4.0 * eps * math.sqrt(n) * math.sqrt(squares / n) / math.sqrt(4.0 * math.pi),
                      4.0 * eps * n**1.5 * (total / n) / (4.0 * math.pi)])
    rounding = 4.0 * (L + 1) * eps * degree_norms(coef_t[0], L) * np.sqrt((2.0 * np.arange(L + 1) + 1.0) / (4.0 * math.pi))
    fallback = np.zeros(len(targets), dtype=np.int8)
    _evaluate(targets, coef_t, L, qmm, a, b, err, noise, rounding, tol, BT, beta, shift, V, want_div,
              velocity, divergence, mean, fallback, get_num_threads(),
              no_log_partition() if logz is None else logz, float(log_offset),
              no_log_partition() if added is None else added)
    return fallback


def harmonic_softmax(model, sources, masses, targets, want_div, tol, velocity, divergence, mean, route=None,
                     logz=None, added=None):
    """The sums of direct.softmax_blocked by the harmonic expansion (module docstring); writes
    the same outputs for the targets it serves. The harmonics are built and contracted in blocks
    of BLOCK points (no (points × (L+1)²) array). Targets over the error budget go to the tilted
    regional expansions (tilted_pass); those still over it are returned, their outputs unwritten:
    the caller re-sums them (spherepde.summation.field: by the tree or the direct sum).
    route: None, or a mask of targets to send to the tilted regions without trying the global
    expansion (those it handed back in an earlier call: in late, concentrated states most of
    them, whose global evaluation is then wasted). Only the cost depends on it: every target is
    still served within its error budget, here or by the caller. Returns (L, indices of the
    targets left to re-sum, number served by the tilted regions, mask of the targets the global
    expansion did not serve (routed or over its budget)). logz: None, or an array (T,) that
    receives log Z of the targets served here.
    added: None, or per target ln Z_add of point sources that the caller adds to these sums
    exactly afterwards (the atoms of split sums, spherepde.summation.points). A target's budget
    is then relative to the whole partition function, 2·err ≤ tol·(Z + Z_add), since an absolute
    error err of these sums moves the whole measure's mean by 2·err/(Z + Z_add); and at most Z/2,
    so that these sums' own mean and log Z stay meaningful (the solver extrapolates them in time).
    Where the points dominate (near the atoms) the tilted regions and re-sums are then spared."""
    BT = np.ascontiguousarray(model.B.T, dtype=float)
    beta = float(model.beta)
    L, tail = harmonic_degree(beta * float(np.linalg.norm(BT, 2)), tail_target(tol))
    sources = np.ascontiguousarray(sources, dtype=float)
    masses = np.asarray(masses, dtype=float)
    keep = masses > 0
    sources, mu = sources[keep], masses[keep] / masses.max()
    want_logz = logz is not None and logz.size > 0
    if added is not None and not (isinstance(added, np.ndarray) and added.shape == (len(targets),)
                                  and added.dtype == np.float64 and added.flags.c_contiguous):
        raise ValueError(f"added must be a contiguous float64 array of shape ({len(targets)},)")
    ln_top = float(np.log(masses.max())) if want_logz or added is not None else 0.0
    if route is None:
        handed = _global_pass(sources, mu, targets, L, tail, tol, BT, beta, model.V, want_div, velocity,
                              divergence, mean, logz, ln_top, added)
    else:
        handed = np.array(route, dtype=bool)
        tried = np.flatnonzero(~handed)
        if tried.size:
            n = tried.size
            out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)), np.empty(n if want_logz else 0))
            over = _global_pass(sources, mu, np.ascontiguousarray(targets[tried]), L, tail, tol, BT, beta,
                                model.V, want_div, *out, ln_top, None if added is None else added[tried])
            write_back(tried, out, ~over, want_div, velocity, divergence, mean, logz)
            handed[tried[over]] = True
    redo = np.flatnonzero(handed)
    handed_back = redo.size
    if redo.size:
        redo = tilted_pass(model, sources, mu, targets, redo, tol, want_div, velocity, divergence, mean, logz,
                           ln_top, added)
    return L, redo, int(handed_back - redo.size), handed


def _global_pass(sources, mu, targets, L, tail, tol, BT, beta, V, want_div, velocity, divergence, mean, logz=None,
                 ln_top=0.0, added=None):
    """The global expansion (shift 0) at the targets; returns the mask of those over budget (logz:
    None or an array for log Z, ln_top = ln max μ; added: None or ln Z_add per target)."""
    rows = 12 if want_div else 4  # the contraction takes moments in fours (rows 10, 11 stay 0)
    coef_t = _REGION_CACHE.global_coefficients(sources, mu, L, rows)  # (moments, harmonics)
    return _expansion_pass(targets, coef_t, mu, L, tail, tol, BT, beta, np.zeros(3), V, want_div, velocity,
                           divergence, mean, logz, ln_top, added).astype(bool)
