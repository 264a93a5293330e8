"""Attention sums at moderate β by spherical harmonics (Funk–Hecke), O((N + T)·L²).

For a target x let κ = β|Bᵀx| and x' = Bᵀx/|Bᵀx|: the kernel is e^{β⟨Bᵀx, y⟩} = e^{κ⟨x', y⟩}, a
zonal function of y, whose Legendre expansion and the addition theorem give

    e^{κ⟨x', y⟩} = Σ_ℓ (2ℓ + 1) i_ℓ(κ) P_ℓ(⟨x', y⟩) = 4π Σ_ℓ i_ℓ(κ) Σ_m Y_ℓm(x') Y_ℓm(y)

(i_ℓ the modified spherical Bessel functions of the first kind, Y_ℓm real orthonormal spherical
harmonics). κ varies with x for a general B; it only enters the target side. So

    Σ_j μ_j g(y_j) e^{β⟨Bᵀx, y_j⟩} = 4π Σ_ℓm i_ℓ(κ) Y_ℓm(x') d_ℓm[g],  d_ℓm[g] = Σ_j μ_j g(y_j) Y_ℓm(y_j)

for the ten moments g = 1, y, y yᵀ: the d_ℓm are the harmonic coefficients of the discrete source
measure (exact sums, no quadrature), one pass over the sources; each target then costs
(L + 1)² × 10 multiply-adds.

Scaling and accuracy: the target side is multiplied by e^{−κ} and masses by 1/max μ, so no kernel
value exceeds 1. A source's truncation error is at most Σ_{ℓ>L} (2ℓ + 1) i_ℓ(κ) e^{−κ}
(|P_ℓ| ≤ 1), which grows with κ, and Σ_ℓm 4π i_ℓ e^{−κ}|Y_ℓm(x')||d_ℓm| ≤ M̃ = Σ_j μ_j/max μ
(Cauchy–Schwarz on the addition theorem). Every moment then has an absolute error of at most
tail(κ_max)·M̃ from the truncation, plus rounding. Rounding is estimated, not bounded: errors of
long sums grow like random walks, so a coefficient sum over N sources errs by ~4ε√N·rms(μ̃ g Y)
(the ℓ = 0 sum, whose partial sums grow linearly, by ~4εN^{3/2}·mean μ̃), seen by the target
through ‖t‖₂ (resp. t₀) of its weights t = 4π i_ℓ e^{−κ} Y_ℓm(x'); the target's own series errs by
~4(L + 1)ε·Σ|terms|. The worst-case bounds (Nε, (L + 1)²ε) are 10³–10⁵× pessimistic here and
would send most targets to the direct sum; the tests compare with the direct sum instead. The
relative error of m_β is then about 2·err/Z(x): where
that exceeds the tolerance (a density that is tiny where the kernel of x sits: the sums span e^{2κ}
and the small ones drown in the rounding of the large ones), the target is summed directly.
L is the smallest degree whose tail is below TAIL_FRACTION·tol, L ≈ √(70 κ_max): the cost grows with
κ, so this is the method for moderate β; the tree takes large β.
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from .attention import _SUMS, TARGET_BLOCK, _finish_target

__all__ = ["harmonic_degree", "harmonic_softmax", "scaled_bessel", "real_harmonics"]

TAIL_FRACTION = 1e-5  # truncation error per unit mass (relative to the largest kernel value) ≤
# this × tol: the bound 2·tail·M̃/Z then uses ≤ 1e-5·2κ·(max f/f near the peak) of tol
MAX_DEGREE = 400


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
    upper = 0.0
    current = 1e-280
    for l in range(start, 0, -1):
        lower = upper + (2 * l + 1) / kappa * current  # i_{l−1}
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


@njit(cache=True)
def _legendre_tables(L):
    """Recurrence coefficients of the normalised Q_ℓm = P̄_ℓm / sin^m θ: Q_mm (L+1,), a and b
    (L+1, L+1) with Q_ℓm = a_ℓm (t Q_{ℓ−1,m} − b_ℓm Q_{ℓ−2,m})."""
    qmm = np.empty(L + 1)
    qmm[0] = 1.0 / math.sqrt(4.0 * math.pi)
    for m in range(1, L + 1):
        qmm[m] = qmm[m - 1] * math.sqrt((2.0 * m + 1.0) / (2.0 * m))
    a = np.zeros((L + 1, L + 1))
    b = np.zeros((L + 1, L + 1))
    for m in range(L + 1):
        for l in range(m + 2, L + 1):
            a[l, m] = math.sqrt((4.0 * l * l - 1.0) / (l * l - m * m))
            b[l, m] = math.sqrt(((l - 1.0) ** 2 - m * m) / (4.0 * (l - 1.0) ** 2 - 1.0))
    return qmm, a, b


@njit(cache=True)
def real_harmonics(x0, x1, x2, L, qmm, a, b, wl, out):
    """Real orthonormal spherical harmonics of the unit vector x at all degrees ≤ L, in the order
    m = 0 (ℓ = 0 … L), then for each m ≥ 1 the cos terms (ℓ = m … L) and the sin terms:
    Y = Q_ℓm(z)·Re/Im((x₀ + i x₁)^m)·√2 (no division by sin θ, so the poles are regular), each
    multiplied by the degree weight wl[ℓ]."""
    k = 0
    # m = 0
    q2 = 0.0
    q1 = qmm[0]
    out[k] = q1 * wl[0]
    k += 1
    if L >= 1:
        q0 = math.sqrt(3.0) * x2 * q1
        out[k] = q0 * wl[1]
        k += 1
        q2, q1 = q1, q0
        for l in range(2, L + 1):
            q0 = a[l, 0] * (x2 * q1 - b[l, 0] * q2)
            out[k] = q0 * wl[l]
            k += 1
            q2, q1 = q1, q0
    re = 1.0
    im = 0.0
    root2 = math.sqrt(2.0)
    for m in range(1, L + 1):
        re, im = re * x0 - im * x1, re * x1 + im * x0  # (x₀ + i x₁)^m
        n = L - m + 1
        c_re = root2 * re
        c_im = root2 * im
        q1 = qmm[m]
        out[k] = q1 * wl[m] * c_re
        out[k + n] = q1 * wl[m] * c_im
        if m < L:
            q0 = math.sqrt(2.0 * m + 3.0) * x2 * q1
            out[k + 1] = q0 * wl[m + 1] * c_re
            out[k + 1 + n] = q0 * wl[m + 1] * c_im
            q2, q1 = q1, q0
            for j in range(2, n):
                l = m + j
                q0 = a[l, m] * (x2 * q1 - b[l, m] * q2)
                out[k + j] = q0 * wl[l] * c_re
                out[k + j + n] = q0 * wl[l] * c_im
                q2, q1 = q1, q0
        k += 2 * n


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


@njit(cache=True, fastmath=_SUMS)
def _accumulate(row, g, nmom, coef):
    """coef[k, q] += row[k]·g[q] for all k and the nmom moments q."""
    for k in range(row.size):
        y = row[k]
        for q in range(nmom):
            coef[k, q] += y * g[q]


@njit(cache=True, parallel=True)
def _coefficients(sources, mu, L, qmm, a, b, nmom, parts):
    """parts[p, k, q] = Σ_j μ_j g_q(y_j) Y_k(y_j) over the p-th chunk of the sources, g = 1, y,
    y yᵀ (upper triangle); their sum over p is d_ℓm[g] (module docstring)."""
    nparts = parts.shape[0]
    nsource = sources.shape[0]
    chunk = (nsource + nparts - 1) // nparts
    ones = np.ones(L + 1)
    for p in prange(nparts):
        coef = parts[p]
        coef[:, :] = 0.0
        row = np.empty((L + 1) ** 2)
        g = np.empty(10)
        for j in range(p * chunk, min(nsource, (p + 1) * chunk)):
            y0 = sources[j, 0]
            y1 = sources[j, 1]
            y2 = sources[j, 2]
            real_harmonics(y0, y1, y2, L, qmm, a, b, ones, row)
            w = mu[j]
            g[0] = w
            g[1] = w * y0
            g[2] = w * y1
            g[3] = w * y2
            g[4] = w * y0 * y0
            g[5] = w * y0 * y1
            g[6] = w * y0 * y2
            g[7] = w * y1 * y1
            g[8] = w * y1 * y2
            g[9] = w * y2 * y2
            _accumulate(row, g, nmom, coef)


@njit(cache=True, fastmath=_SUMS)
def _contract(row, coef, nmom, mom):
    """mom[q] = Σ_k row[k]·coef[k, q] and returns Σ_k |row[k]·coef[k, 0]|; coef (nk, 10) so that
    the ten moments of one k are adjacent (one sweep over coef, which stays in L2)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = m8 = m9 = 0.0
    size = 0.0
    if nmom == 10:
        for k in range(row.size):
            y = row[k]
            m0 += y * coef[k, 0]
            m1 += y * coef[k, 1]
            m2 += y * coef[k, 2]
            m3 += y * coef[k, 3]
            m4 += y * coef[k, 4]
            m5 += y * coef[k, 5]
            m6 += y * coef[k, 6]
            m7 += y * coef[k, 7]
            m8 += y * coef[k, 8]
            m9 += y * coef[k, 9]
            size += abs(y * coef[k, 0])
    else:
        for k in range(row.size):
            y = row[k]
            m0 += y * coef[k, 0]
            m1 += y * coef[k, 1]
            m2 += y * coef[k, 2]
            m3 += y * coef[k, 3]
            size += abs(y * coef[k, 0])
    mom[0] = m0
    mom[1] = m1
    mom[2] = m2
    mom[3] = m3
    if nmom == 10:
        mom[4] = m4
        mom[5] = m5
        mom[6] = m6
        mom[7] = m7
        mom[8] = m8
        mom[9] = m9
    return size


@njit(cache=True, parallel=True)
def _evaluate(targets, coef, L, qmm, a, b, err, noise, rounding, tol, BT, beta, V, want_div,
              velocity, divergence, mean, fallback):
    """For each target: 4π i_ℓ(κ)e^{−κ} Y_ℓm(x') (x' = Bᵀx/|Bᵀx|, κ = β|Bᵀx|), contracted with the
    coefficients, then finished (velocity, divergence, mean); a target whose error bound
    2·(err + noise₀‖t‖₂ + noise₁t₀ + rounding·Σ|terms|)/Z exceeds tol is marked for the direct sum
    (fallback[i] = 1)."""
    nk = (L + 1) ** 2
    nmom = 10 if want_div else 4
    ntarget = targets.shape[0]
    for blk in prange((ntarget + TARGET_BLOCK - 1) // TARGET_BLOCK):
        # work arrays once per block of targets, not per target (this loop is the hot path)
        bes = np.empty(L + 1)
        row = np.empty(nk)
        mom = np.empty(nmom)
        for i in range(blk * TARGET_BLOCK, min(ntarget, (blk + 1) * TARGET_BLOCK)):
            x0 = targets[i, 0]
            x1 = targets[i, 1]
            x2 = targets[i, 2]
            u0 = BT[0, 0] * x0 + BT[0, 1] * x1 + BT[0, 2] * x2
            u1 = BT[1, 0] * x0 + BT[1, 1] * x1 + BT[1, 2] * x2
            u2 = BT[2, 0] * x0 + BT[2, 1] * x1 + BT[2, 2] * x2
            unorm = math.sqrt(u0 * u0 + u1 * u1 + u2 * u2)
            if unorm > 0:
                u0 /= unorm
                u1 /= unorm
                u2 /= unorm
            else:
                u2 = 1.0
            kappa = beta * unorm
            scaled_bessel(kappa, kappa, bes)
            tnorm = 0.0  # ‖t‖₂ of the weights t = 4π i_ℓ e^{−κ} Y_ℓm(x')
            for l in range(L + 1):
                bes[l] *= 4.0 * math.pi
                tnorm += bes[l] * bes[l] * (2 * l + 1)
            tnorm = math.sqrt(tnorm / (4.0 * math.pi))
            real_harmonics(u0, u1, u2, L, qmm, a, b, bes, row)
            size = _contract(row, coef, nmom, mom)
            bound = err + noise[0] * tnorm + noise[1] * bes[0] + rounding * size
            if not (mom[0] > 0.0 and 2.0 * bound <= tol * mom[0]):
                fallback[i] = 1
                continue
            fallback[i] = 0
            _finish_target(i, x0, x1, x2, 0.0, 0.0, 0.0, mom, BT, beta, V, want_div, velocity,
                           divergence, mean)


def harmonic_softmax(model, sources, masses, targets, soa, sample, rmax, want_div, tol, velocity,
                     divergence, mean):
    """The sums of attention.softmax_blocked by the harmonic expansion (module docstring); writes
    the same outputs. Each source's and each target's harmonics are contracted with the
    moments as they are built (no (points × (L+1)²) array). Returns (L, number of targets summed
    directly)."""
    from .attention import softmax_blocked

    BT = np.ascontiguousarray(model.B.T, dtype=float)
    beta = float(model.beta)
    L, tail = harmonic_degree(beta * float(np.linalg.norm(BT, 2)), tail_target(tol))
    qmm, a, b = _legendre_tables(L)
    nk = (L + 1) ** 2
    nmom = 10 if want_div else 4
    sources = np.ascontiguousarray(sources, dtype=float)
    masses = np.asarray(masses, dtype=float)
    keep = masses > 0
    sources, mu = sources[keep], masses[keep] / masses.max()
    parts = np.empty((max(1, min(get_num_threads(), len(mu))), nk, nmom))
    _coefficients(sources, mu, L, qmm, a, b, nmom, parts)
    coef_t = parts.sum(axis=0)  # (nk, nmom): the moments of one k adjacent
    eps = np.finfo(float).eps
    n = len(mu)
    # error budget of a target's moments (module docstring): the truncation, rigorous; the
    # rounding of the coefficient sums, estimated as random walks (4ε√N·rms(μ g Y) per
    # coefficient, seen through ‖t‖₂; the ℓ = 0 sum, whose partial sums grow linearly,
    # 4ε N^{3/2} mean(μ)/√(4π) seen through t₀); and of the target's own series, 4(L+1)ε Σ|terms|
    err = tail * float(mu.sum())
    noise = np.array([4.0 * eps * math.sqrt(n) * math.sqrt(float(np.mean(mu**2))) / math.sqrt(4.0 * math.pi),
                      4.0 * eps * n**1.5 * float(mu.mean()) / (4.0 * math.pi)])
    rounding = 4.0 * (L + 1) * eps
    fallback = np.zeros(len(targets), dtype=np.int8)
    _evaluate(targets, coef_t, L, qmm, a, b, err, noise, rounding, tol, BT, beta, model.V, want_div,
              velocity, divergence, mean, fallback)
    redo = np.flatnonzero(fallback)
    if redo.size:
        n = redo.size
        out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)))
        softmax_blocked(np.ascontiguousarray(targets[redo]), BT, beta, soa, sample, rmax, model.V,
                        want_div, *out, np.empty((n, 0), dtype=np.int64), np.empty((n, 0, 10)),
                        np.empty(0))
        velocity[redo] = out[0]
        mean[redo] = out[2]
        if want_div:
            divergence[redo] = out[1]
    return L, int(redo.size)
