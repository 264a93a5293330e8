"""Shared numba kernels of the attention sums: source arrays, block maxima and moments, finishing.

The direct sum (spherepde.summation.direct) and the tree (spherepde.summation.tree) sum the
softmax weights in base 2, centred, over blocks of sources with the kernels here; the harmonic
expansion (spherepde.summation.harmonic) finishes its moments with the same finish_target.

- sources become a structure of arrays (y₀, y₁, y₂, λ) once per call (source_arrays),
  λ_j = log₂(μ_j / max μ) ≤ 0 (μ_j the masses: any positive unit, only ratios enter); empty
  cells (μ_j = 0) are dropped, so no −inf reaches a kernel;
- per target a = β log₂e Bᵀx and â = a/|a| (kernel_direction); weights w_j = 2^(e_j − shift)
  with the centred exponents e_j = λ_j + ⟨a, y_j − â⟩ (they differ from λ_j + ⟨a, y_j⟩ by a
  constant) and the vectorised exp2 of spherepde.summation.fastmath (≤ 1 ulp, exactly 0 below
  2^−957.5). Centring makes the rounding error of an exponent ~ε|a||y_j − â| instead of ~ε|a|:
  the heavy weights of a large β sit near â. The moments are centred too (block_moments1/2),
  m = â + Σw d/Σw and C = Σw d dᵀ/Σw − (m − â)(m − â)ᵀ with d = y − â, which removes most of
  the cancellation in C at large β (finish_target);
- shift: a rounding error of relative size ε in the exponents becomes an absolute one of
  ε·|e_j − shift|, so the shift must be close to the true maximum, not just above it. The
  maximum over a sample (every SAMPLE_STRIDE-th source and a heaviest one, 3 % of the sources)
  bounds it from below (block_max over the sample), e_j ≤ |a| r_max − ⟨a, â⟩ (r_max = max |y_j|,
  λ ≤ 0) from above. When the two are within SHIFT_SLACK = 64 the sample maximum is the shift:
  one pass, weights in (0, 2⁶⁴], and the exponents lose at most 64ε. Otherwise (large β|Bᵀx| or
  mass concentrated between sample points) an exact max pass over all sources comes first;
- the sums are compiled with fastmath contract/reassoc/nsz (SUMS: FMAs, vectorised reductions)
  but not nnan/ninf: the inputs are finite and IEEE semantics stay intact.

finish_target turns the moments into the outputs (per unit time; V, B dimensionless):

    m_β = â + Σw d/z,   v = P_x(V m_β),   div_S v = β tr(P_x V C Bᵀ) − 2⟨x, V m_β⟩,

and add_near_field adds the near-field corrections (spherepde.summation.near_field) to a
target's moments in the same scale.

Log-partition function (optional output of every sum, attention_field(log_partition=...)):
the zeroth moment is z = Σ_j 2^(λ_j + ⟨a, y_j − â⟩ − shift) (plus the near-field corrections in
the same scale), and ⟨a, â⟩ = |a|, λ_j = log₂ μ_j − log₂ max μ, a = β log₂e Bᵀx, so

    log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} = ln 2·(log₂ z + shift + |a|) + ln max μ

(store_log_partition; the shift is the one add_near_field returns). A kernel writes it only when
its logz array is not empty (no_log_partition(): length 0), so callers that do not ask pay one
branch per target.

Unnormalised attention (unnormalise): n(x) = ∫ e^{β⟨x, By⟩} y dρ = Z m_β, and from
∂n/∂x = β (Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} y_j y_jᵀ) Bᵀ = β Z (C + m mᵀ) Bᵀ,

    v = P_x(V n) = Z·P_x(V m_β),
    div_S v = β tr(P_x V S Bᵀ) − 2⟨x, V n⟩ = Z·(div_S v_softmax + β⟨B m_β, P_x(V m_β)⟩)

(S = Z(C + m mᵀ) the unnormalised second moment; tr(P_x V m mᵀ Bᵀ) = ⟨Bm, P_x V m⟩), both times
e^{−c} for the chosen time scale (model.log_field_scale): the factor e^{log Z − c} is formed
from log Z, so no intermediate overflows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .fastmath import exp2_weight, maxnum

__all__ = ["source_arrays", "kernel_direction", "project_velocity", "add_near_field", "no_near_field",
           "write_back", "SHIFT_SLACK", "SAMPLE_STRIDE", "store_log_partition", "no_log_partition",
           "LN2", "unnormalise"]

SHIFT_SLACK = 64.0  # base-2 units: one pass when the sampled maximum is within 2⁶⁴ of the bound
SAMPLE_STRIDE = 32  # every 32nd source (and the heaviest) estimates the maximum exponent
EXP2_LIMIT = 2.0**49  # exp2_weight needs |exponent| < 2⁵⁰
SUMS = {"contract", "reassoc", "nsz"}  # no nnan/ninf: keep IEEE semantics
LN2 = math.log(2.0)


def source_arrays(sources, masses):
    """Sources as a structure of arrays for softmax_blocked, cells without mass dropped.

    Returns (soa, sample, rmax): soa (4, n) with rows y₀, y₁, y₂, λ of the n sources with μ > 0,
    λ = log₂(μ / max μ) ≤ 0; sample (4, k) the same rows for every SAMPLE_STRIDE-th of them plus
    a heaviest one (λ = 0); r_max = max |y_j|. Masses need not be normalised; raises if no mass
    is positive.
    """
    masses = np.asarray(masses, dtype=float)
    keep = np.flatnonzero(masses > 0)
    if keep.size == 0:
        raise ValueError("the density has no positive mass")
    mu = masses[keep]
    top = mu.max()
    soa = np.empty((4, keep.size))
    soa[:3] = np.asarray(sources, dtype=float)[keep].T
    ratio = mu / top  # exact log₂ near the heaviest source (λ = 0 there) ...
    tiny = ratio < np.finfo(float).tiny  # ... but a ratio below 2⁻¹⁰²² may underflow to 0
    soa[3] = np.log2(np.where(tiny, 1.0, ratio))
    soa[3, tiny] = np.log2(mu[tiny]) - np.log2(top)  # finite: λ > −2100 for any positive float64
    picks = np.append(np.arange(0, keep.size, SAMPLE_STRIDE), np.argmax(mu))
    rmax = float(np.sqrt(np.max(np.sum(soa[:3] ** 2, axis=0))))
    return soa, np.ascontiguousarray(soa[:, picks]), rmax


@njit(cache=True, fastmath=SUMS)
def block_max(a0, a1, a2, h0, h1, h2, y0, y1, y2, lw):
    """max_j (λ_j + ⟨a, y_j − â⟩) over one block of sources (â = (h0, h1, h2))."""
    m = -np.inf
    for j in range(y0.size):  # slices: j ≥ 0 is known, so no wraparound check blocks vectorising
        m = maxnum(m, lw[j] + a0 * (y0[j] - h0) + a1 * (y1[j] - h1) + a2 * (y2[j] - h2))
    return m


@njit(cache=True, fastmath=SUMS)
def block_moments1(a0, a1, a2, h0, h1, h2, c, y0, y1, y2, lw):
    """Σ w_j and Σ w_j d_j over one block, d_j = y_j − â, w_j = 2^(c + λ_j + ⟨a, d_j⟩)."""
    z = 0.0
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    for j in range(y0.size):
        d0 = y0[j] - h0
        d1 = y1[j] - h1
        d2 = y2[j] - h2
        w = exp2_weight(c + lw[j] + a0 * d0 + a1 * d1 + a2 * d2)
        z += w
        s0 += w * d0
        s1 += w * d1
        s2 += w * d2
    return z, s0, s1, s2


@njit(cache=True, fastmath=SUMS)
def block_moments2(a0, a1, a2, h0, h1, h2, c, y0, y1, y2, lw):
    """As block_moments1, plus Σ w_j d_j d_jᵀ (upper triangle, row-major)."""
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
    for j in range(y0.size):
        d0 = y0[j] - h0
        d1 = y1[j] - h1
        d2 = y2[j] - h2
        w = exp2_weight(c + lw[j] + a0 * d0 + a1 * d1 + a2 * d2)
        w0 = w * d0
        w1 = w * d1
        w2 = w * d2
        z += w
        s0 += w0
        s1 += w1
        s2 += w2
        c00 += w0 * d0
        c01 += w0 * d1
        c02 += w0 * d2
        c11 += w1 * d1
        c12 += w1 * d2
        c22 += w2 * d2
    return z, s0, s1, s2, c00, c01, c02, c11, c12, c22


@njit(cache=True)
def kernel_direction(BT, scale, x0, x1, x2):
    """(a₀, a₁, a₂, |a|, â₀, â₁, â₂) for a = scale·Bᵀx and â = a/|a| (â = 0 if a = 0)."""
    a0 = scale * (BT[0, 0] * x0 + BT[0, 1] * x1 + BT[0, 2] * x2)
    a1 = scale * (BT[1, 0] * x0 + BT[1, 1] * x1 + BT[1, 2] * x2)
    a2 = scale * (BT[2, 0] * x0 + BT[2, 1] * x1 + BT[2, 2] * x2)
    norm = math.sqrt(a0 * a0 + a1 * a1 + a2 * a2)
    if norm > 0:
        return a0, a1, a2, norm, a0 / norm, a1 / norm, a2 / norm
    return a0, a1, a2, norm, 0.0, 0.0, 0.0


@njit(cache=True)
def project_velocity(V, m0, m1, m2, x0, x1, x2, out):
    """out = P_x(V m) = u − ⟨x, u⟩x with u = V m; returns ⟨x, u⟩ (used by the divergence)."""
    u0 = V[0, 0] * m0 + V[0, 1] * m1 + V[0, 2] * m2
    u1 = V[1, 0] * m0 + V[1, 1] * m1 + V[1, 2] * m2
    u2 = V[2, 0] * m0 + V[2, 1] * m1 + V[2, 2] * m2
    xu = x0 * u0 + x1 * u1 + x2 * u2
    out[0] = u0 - xu * x0
    out[1] = u1 - xu * x1
    out[2] = u2 - xu * x2
    return xu


@njit(cache=True)
def add_near_field(i, mom, nmom, shift, near_cells, near_delta, log2_factor):
    """Add the near-field corrections of target i (spherepde.summation.near_field) to its moments.

    mom holds Σ_j 2^(λ_j + ⟨a, d_j⟩ − shift)(1, d_j, d_j d_jᵀ) with λ_j = log₂(μ_j/μ_max); the
    correction of cell c is f_c Δ_c in the same scale: 2^(log2_factor[c] − shift) Δ_c with
    log2_factor[c] = log₂(f_c/μ_max) (−inf for an empty cell). When the kernel is much narrower
    than a cell, the corrections can exceed the centre sums by a factor 2^1000 (the peak sits
    between centres): the shift is then raised to the largest log₂ of a correction and the sums
    rescaled, so nothing overflows. Returns the shift used.
    """
    top = shift
    for k in range(near_cells.shape[1]):
        c = near_cells[i, k]
        if c < 0:
            break
        size = abs(near_delta[i, k, 0])
        if size > 0 and log2_factor[c] > -np.inf:
            top = max(top, log2_factor[c] + math.log2(size))
    if top > shift:
        factor = 2.0 ** (shift - top)
        for q in range(nmom):
            mom[q] *= factor
        shift = top
    for k in range(near_cells.shape[1]):
        c = near_cells[i, k]
        if c < 0:
            break
        lam = log2_factor[c]
        if lam == -np.inf:
            continue
        s = 2.0 ** (lam - shift)
        for q in range(nmom):
            mom[q] += s * near_delta[i, k, q]
    return shift


@njit(cache=True)
def finish_target(i, x0, x1, x2, h0, h1, h2, mom, BT, beta, V, want_div,
                   velocity, divergence, mean):
    """m = â + Σw d/z, v = P_x(V m) and div = β tr(P_x V C Bᵀ) − 2⟨x, V m⟩ from
    C = Σw d dᵀ/z − (m − â)(m − â)ᵀ; mom = (z, Σw d[, Σw d dᵀ upper triangle]), d = y − â.
    """
    z = mom[0]
    g0 = mom[1] / z  # m − â
    g1 = mom[2] / z
    g2 = mom[3] / z
    m0 = h0 + g0
    m1 = h1 + g1
    m2 = h2 + g2
    mean[i, 0] = m0
    mean[i, 1] = m1
    mean[i, 2] = m2
    xu = project_velocity(V, m0, m1, m2, x0, x1, x2, velocity[i])
    if want_div:
        c00 = mom[4] / z - g0 * g0
        c01 = mom[5] / z - g0 * g1
        c02 = mom[6] / z - g0 * g2
        c11 = mom[7] / z - g1 * g1
        c12 = mom[8] / z - g1 * g2
        c22 = mom[9] / z - g2 * g2
        C = ((c00, c01, c02), (c01, c11, c12), (c02, c12, c22))
        x = (x0, x1, x2)
        # tr(P_x K) = tr K − xᵀKx with K = V C Bᵀ
        tr = 0.0
        xKx = 0.0
        for r in range(3):
            vc0 = V[r, 0] * C[0][0] + V[r, 1] * C[1][0] + V[r, 2] * C[2][0]  # row r of V C
            vc1 = V[r, 0] * C[0][1] + V[r, 1] * C[1][1] + V[r, 2] * C[2][1]
            vc2 = V[r, 0] * C[0][2] + V[r, 1] * C[1][2] + V[r, 2] * C[2][2]
            for c in range(3):
                k = vc0 * BT[0, c] + vc1 * BT[1, c] + vc2 * BT[2, c]
                if r == c:
                    tr += k
                xKx += x[r] * k * x[c]
        divergence[i] = beta * (tr - xKx) - 2.0 * xu


@njit(cache=True)
def store_log_partition(i, logz, z, exponent2, log_offset):
    """logz[i] = ln 2·(log₂ z + exponent2) + log_offset if logz is not empty (else nothing).

    z: the zeroth moment of a target in some scale, exponent2 the base-2 exponent that scale
    removed (shift + |a| for the centred kernels), log_offset the natural log of the mass unit
    (ln max μ). z ≤ 0 (no mass reached the target) gives −inf."""
    if logz.size == 0:
        return
    if z > 0.0:
        logz[i] = LN2 * (math.log2(z) + exponent2) + log_offset
    else:
        logz[i] = -np.inf


@njit(cache=True)
def unnormalise(B, beta, log_scale, logz, want_div, velocity, divergence, mean):
    """Turn the softmax outputs of T targets into those of unnormalised attention, in place
    (module docstring): s = e^{logz − log_scale}, div ← s·(div + β⟨B m, v⟩), v ← s·v (mean, the
    softmax mean m_β, unchanged). B (3, 3); logz (T,) natural log of Z."""
    for i in range(logz.size):
        s = math.exp(logz[i] - log_scale)
        v0 = velocity[i, 0]
        v1 = velocity[i, 1]
        v2 = velocity[i, 2]
        if want_div:
            m0 = mean[i, 0]
            m1 = mean[i, 1]
            m2 = mean[i, 2]
            bm0 = B[0, 0] * m0 + B[0, 1] * m1 + B[0, 2] * m2
            bm1 = B[1, 0] * m0 + B[1, 1] * m1 + B[1, 2] * m2
            bm2 = B[2, 0] * m0 + B[2, 1] * m1 + B[2, 2] * m2
            divergence[i] = s * (divergence[i] + beta * (bm0 * v0 + bm1 * v1 + bm2 * v2))
        velocity[i, 0] = s * v0
        velocity[i, 1] = s * v1
        velocity[i, 2] = s * v2


def no_log_partition():
    """The logz argument of the kernels when log Z is not wanted (length 0: never written)."""
    return np.empty(0)


def no_near_field(ntarget):
    """The near-field arguments (cells, delta, log2_factor) of the kernels without corrections
    (K = 0)."""
    return np.empty((ntarget, 0), dtype=np.int64), np.empty((ntarget, 0, 10)), np.empty(0)


def write_back(idx, out, keep, want_div, velocity, divergence, mean, logz=None):
    """The outputs of the targets idx[keep] from those of a subset evaluation, out[·][keep]
    (out[3]: their log Z, copied into logz when that is given and not empty)."""
    velocity[idx[keep]] = out[0][keep]
    mean[idx[keep]] = out[2][keep]
    if want_div:
        divergence[idx[keep]] = out[1][keep]
    if logz is not None and logz.size and len(out) > 3:
        logz[idx[keep]] = out[3][keep]
