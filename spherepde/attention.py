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

The direct sum (``softmax_blocked``) works in base 2, centred, and in blocks:
- sources become a structure of arrays (y₀, y₁, y₂, λ) once per call, λ_j = log₂(μ_j / max μ) ≤ 0;
  empty cells (μ_j = 0) are dropped, so no −inf reaches the kernel;
- per target a = β log₂e Bᵀx and â = a/|a|; weights w_j = 2^(e_j − shift) with the centred
  exponents e_j = λ_j + ⟨a, y_j − â⟩ (they differ from λ_j + ⟨a, y_j⟩ by a constant) and the
  vectorised exp2 of spherepde.fastmath (≤ 1 ulp, exactly 0 below 2^−957.5). Centring makes
  the rounding error of an exponent ~ε|a||y_j − â| instead of ~ε|a|: the heavy weights of a large
  β sit near â. The moments are centred too, m = â + Σw d/Σw and C = Σw d dᵀ/Σw − (m − â)(m − â)ᵀ
  with d = y − â, which removes most of the cancellation in C at large β;
- shift: a rounding error of relative size ε in the exponents becomes an absolute one of
  ε·|e_j − shift|, so the shift must be close to the true maximum, not just above it. The
  maximum over a sample (every SAMPLE_STRIDE-th source and a heaviest one, 3 % of the sources)
  bounds it from below, e_j ≤ |a| r_max − ⟨a, â⟩ (r_max = max |y_j|, λ ≤ 0) from above. When
  the two are within SHIFT_SLACK = 64 the sample maximum is the shift: one pass, weights in
  (0, 2⁶⁴], and the exponents lose at most 64ε. Otherwise (large β|Bᵀx| or mass concentrated
  between sample points) an exact max pass over all sources comes first;
- targets go in blocks of TARGET_BLOCK (the parallel loop), sources in blocks of SOURCE_BLOCK
  (4 arrays × 8192 × 8 B = 256 KiB, resident in the 1 MiB L2 while the target block sweeps over
  them; L2 bandwidth is ample for one pair per ~3 cycles, and smaller blocks only add per-block
  reduction overhead: measured 512 / 2048 / 8192 / unblocked = 0.48 / 0.43 / 0.41 / 0.41 ns per
  pair at nside 32 and 8192 / unblocked = 0.41 / 0.42 at nside 64, where the sources exceed L2);
- the sums are compiled with fastmath contract/reassoc/nsz (FMAs, vectorised reductions) but not
  nnan/ninf: the inputs are finite and IEEE semantics stay intact.
``softmax_direct_reference`` is the original scalar kernel (libm exp, natural base, uncentred),
kept as the reference of the tests.
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from .fastmath import LOG2E, exp2_weight, maxnum

__all__ = ["attention_field", "choose_method", "METHODS", "DEFAULT_TOL", "softmax_blocked", "softmax_direct_reference", "source_arrays",
           "zero_temperature_field", "AttentionField", "mesh_sources"]

TARGET_BLOCK = 64  # targets per parallel work item
SOURCE_BLOCK = 8192  # sources per block (256 KiB of source data: stays in L2 for the target block)
SHIFT_SLACK = 64.0  # base-2 units: one pass when the sampled maximum is within 2⁶⁴ of the bound
SAMPLE_STRIDE = 32  # every 32nd source (and the heaviest) estimates the maximum exponent
_EXP2_LIMIT = 2.0**49  # exp2_weight needs |exponent| < 2⁵⁰
_SUMS = {"contract", "reassoc", "nsz"}  # no nnan/ninf: keep IEEE semantics


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


@njit(cache=True, fastmath=_SUMS)
def _block_max(a0, a1, a2, h0, h1, h2, y0, y1, y2, lw):
    """max_j (λ_j + ⟨a, y_j − â⟩) over one block of sources (â = (h0, h1, h2))."""
    m = -np.inf
    for j in range(y0.size):  # slices: j ≥ 0 is known, so no wraparound check blocks vectorising
        m = maxnum(m, lw[j] + a0 * (y0[j] - h0) + a1 * (y1[j] - h1) + a2 * (y2[j] - h2))
    return m


@njit(cache=True, fastmath=_SUMS)
def _block_moments1(a0, a1, a2, h0, h1, h2, c, y0, y1, y2, lw):
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


@njit(cache=True, fastmath=_SUMS)
def _block_moments2(a0, a1, a2, h0, h1, h2, c, y0, y1, y2, lw):
    """As _block_moments1, plus Σ w_j d_j d_jᵀ (upper triangle, row-major)."""
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
    """Add the near-field corrections of target i (spherepde.near_field) to its moments.

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
def _finish_target(i, x0, x1, x2, h0, h1, h2, mom, BT, beta, V, want_div,
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


@njit(cache=True, parallel=True)
def softmax_blocked(targets, BT, beta, soa, sample, rmax, V, want_div, velocity, divergence, mean,
                    near_cells, near_delta, log2_factor):
    """Direct O(N·T) softmax sums, vectorised and blocked, fused with velocity and divergence.

    targets (T, 3) unit vectors; BT = Bᵀ (3, 3); soa, sample, rmax from source_arrays (positive
    masses only; exponents must stay below 2⁵⁰ in size, see attention_field); V (3, 3). Writes
    velocity (T, 3), mean (T, 3) and, if want_div, divergence (T,), like softmax_direct_reference.
    near_cells (T, K), near_delta (T, K, 10), log2_factor (cells,): near-field corrections
    (add_near_field; K = 0 for none).
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
            # the exponents λ_j + ⟨a, y_j − â⟩ are ≤ |a| r_max − ⟨a, â⟩ (λ ≤ 0), and their maximum
            # is ≥ that of the sample. Shifting by the sample maximum costs an absolute rounding
            # error ε·(max − shift) in the exponents: allow it only up to SHIFT_SLACK
            upper = norm * rmax - (a0 * h[t, 0] + a1 * h[t, 1] + a2 * h[t, 2])
            lower = _block_max(a0, a1, a2, h[t, 0], h[t, 1], h[t, 2], sample[0], sample[1],
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
                        shift[t] = max(shift[t], _block_max(
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
                    r2 = _block_moments2(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2],
                                         -shift[t], y0, y1, y2, lw)
                    for k in range(10):
                        mom[t, k] += r2[k]
                else:
                    r1 = _block_moments1(a[t, 0], a[t, 1], a[t, 2], h[t, 0], h[t, 1], h[t, 2],
                                         -shift[t], y0, y1, y2, lw)
                    for k in range(4):
                        mom[t, k] += r1[k]
        for t in range(nt):
            i = i0 + t
            add_near_field(i, mom[t], nmom, shift[t], near_cells, near_delta, log2_factor)
            _finish_target(i, targets[i, 0], targets[i, 1], targets[i, 2], h[t, 0], h[t, 1],
                           h[t, 2], mom[t], BT, beta, V, want_div, velocity, divergence, mean)


@njit(cache=True, parallel=True)
def softmax_direct_reference(targets, BT, beta, sources, log_mass, V, want_div, velocity, divergence, mean):
    """Direct O(N·T) softmax sums, fused with the velocity and divergence of each target.

    The original scalar kernel (libm exp per pair), kept as the reference of softmax_blocked.

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
        # no centring here (â = 0): the moments are the raw Σ e y and Σ e y yᵀ
        _finish_target(i, x0, x1, x2, 0.0, 0.0, 0.0, (z, s0, s1, s2, c00, c01, c02, c11, c12, c22),
                       BT, beta, V, want_div, velocity, divergence, mean)


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


METHODS = ("auto", "direct", "tree", "harmonic")
DEFAULT_TOL = 1e-10
TREE_MIN_SOURCES = 3072  # below this the tree's overhead is not worth it
TREE_MAX_CAP_FRACTION = 0.2  # the tree pays when the weights live on < 20 % of the sphere
# harmonic cost per target ≈ HARMONIC_PAIRS_PER_TERM·(L+1)² direct pairs (per source: twice that;
# measured against softmax_blocked in the same runs at nside 8 to 32, β = 3 to 30: 0.9 to 2.1,
# larger at small L where the per-point overheads weigh more)
HARMONIC_PAIRS_PER_TERM = 1.5


def tree_cap_fraction(model, targets, tol=DEFAULT_TOL):
    """The fraction (ln(1/tol) + 5)/(2β|Bᵀx|) of the sphere that the tree visits around a target
    (median |Bᵀx| over up to 256 of the targets); inf where Bᵀx = 0."""
    sample = np.asarray(targets)[:: max(1, len(targets) // 256)]
    bx = float(np.median(np.linalg.norm(sample @ model.B, axis=1)))
    return (math.log(1.0 / tol) + 5.0) / (2.0 * model.beta * bx) if bx > 0 else math.inf


def choose_method(model, targets, nsources, tol=DEFAULT_TOL):
    """The cost model of "auto".

    tree: it visits the cap where β|Bᵀx|(1 − cos θ) ≲ ln(1/tol) + 5, a fraction
    (ln(1/tol) + 5)/(2β|Bᵀx|) of the sphere (median |Bᵀx| over the targets); "tree" when that
    fraction is small. harmonic: (T + 2N)·c·(L+1)² against T·N for the direct sum, L the degree
    spherepde.harmonic_sum needs at κ_max = βσ_max(B); "harmonic" when cheaper. Else "direct".
    """
    if nsources < TREE_MIN_SOURCES:
        return "direct"
    fraction = tree_cap_fraction(model, targets, tol)
    if fraction == math.inf:
        return "direct"
    if fraction < TREE_MAX_CAP_FRACTION:
        return "tree"
    from .harmonic_sum import harmonic_degree, tail_target

    L, _ = harmonic_degree(model.beta * float(np.linalg.norm(model.B, 2)), tail_target(tol))
    ntarget = len(targets)
    harmonic = (ntarget + 2 * nsources) * HARMONIC_PAIRS_PER_TERM * (L + 1) ** 2
    return "harmonic" if harmonic < ntarget * nsources else "direct"


def attention_field(model, sources, masses, targets, want_div=False, out=None, method="auto",
                    tol=DEFAULT_TOL, stats=None, near=None, route=None):
    """Velocity v (T, 3), divergence div_S v (T,) (or None) and softmax mean m_β (T, 3).

    sources (N, 3) with masses (N,) ≥ 0 (need not be normalised); targets (T, 3) unit vectors.
    The one entry point of the summation. At β = ∞ the masses are unused and mean is None.
    method: "direct" (softmax_blocked, exact to rounding), "tree" (spherepde.tree_sum: pruning
    with a certified neglected weight ≤ tol·Z per target; unit-vector sources only), "harmonic"
    (spherepde.harmonic_sum: Funk–Hecke expansion for moderate β, targets whose error bound
    exceeds tol re-evaluated by tilted regional expansions, then by the tree or directly; unit-vector
    sources only) or "auto" (choose_method). stats, if a dict, receives the method used, the
    targets served by the tilted expansions and those re-summed by the tree or directly.
    near: a spherepde.near_field.NearField for these targets with the sources = the cells of its
    mesh (masses = f·A in cell order): the kernel is integrated exactly over the cells around its
    peak (accuracy uniform in β); None: the cell-centre sums only.
    route: for "harmonic", a mask of targets to send to the tilted regional expansions without
    trying the global one (harmonic_sum.harmonic_softmax; cost only); stats["handed_back"] then
    receives the mask for the next call.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not (0 < tol < 1):
        raise ValueError(f"tol must be in (0, 1), got {tol!r}")
    targets = np.ascontiguousarray(targets, dtype=float)
    ntarget = targets.shape[0]
    if out is None:
        out = (np.empty((ntarget, 3)), np.empty(ntarget), np.empty((ntarget, 3)))
    velocity, divergence, mean = out
    if model.zero_temperature:
        zero_temperature_field(targets, model.B, model.M, want_div, velocity, divergence)
        return velocity, (divergence if want_div else None), None
    sources = np.ascontiguousarray(sources, dtype=float)
    if method == "auto":
        method = choose_method(model, targets, sources.shape[0], tol)
    if method in ("tree", "harmonic") and np.abs(np.einsum("ij,ij->i", sources, sources) - 1.0).max() > 1e-12:
        method = "direct"  # the caps of the tree bound ⟨a, y⟩, and Funk–Hecke needs, unit vectors y
    if method == "harmonic" and near is not None and near.active:
        method = "direct"  # the harmonic sums are uncentred: no near-field correction there
    soa, sample, rmax = source_arrays(sources, masses)
    near_cells, near_delta, log2_factor = _near_arrays(near, masses, sources.shape[0], ntarget)
    BT = np.ascontiguousarray(model.B.T)
    # the fast kernels' exponents λ + ⟨a, y − â⟩ − shift are bounded by 2|a|(r_max + 1) + max|λ|
    bound = 2.0 * model.beta * LOG2E * np.linalg.norm(BT, 2) * (rmax + 1.0) - soa[3].min()
    if bound >= _EXP2_LIMIT:  # absurd β (> ~10¹⁴): the reference kernel has no range limit
        method = "reference"
        masses = np.asarray(masses, dtype=float)
        with np.errstate(divide="ignore"):
            log_mass = np.log(np.maximum(masses, 0.0))
        softmax_direct_reference(targets, BT, model.beta, sources, log_mass, model.V,
                                 want_div, velocity, divergence, mean)
    elif method == "tree":
        fallbacks = tree_sums(model, sources, masses, soa, targets, tol, want_div, velocity,
                              divergence, mean, near_cells, near_delta, log2_factor)
        if stats is not None:
            stats["fallbacks"] = fallbacks
    elif method == "harmonic":
        from .harmonic_sum import harmonic_softmax

        degree, redo, how, tilted, handed = harmonic_softmax(model, sources, masses, targets, soa, sample,
                                                             rmax, want_div, tol, velocity, divergence, mean,
                                                             route)
        if stats is not None:
            stats["handed_back"] = handed
            stats["degree"] = degree
            stats["tilted"] = tilted
            stats["fallbacks"] = redo
            stats["fallback_method"] = how
    else:
        softmax_blocked(targets, BT, model.beta, soa, sample, rmax, model.V, want_div,
                        velocity, divergence, mean, near_cells, near_delta, log2_factor)
    if stats is not None:
        stats["method"] = method
    return velocity, (divergence if want_div else None), mean

def tree_sums(model, sources, masses, soa, targets, tol, want_div, velocity, divergence, mean,
              near_cells=None, near_delta=None, log2_factor=None):
    """The tree sums (spherepde.tree_sum) of attention_field, written into velocity, divergence
    and mean; returns the number of targets the tree summed directly."""
    from .tree_sum import SourceTree, tree_softmax

    ntarget = targets.shape[0]
    if near_cells is None:
        near_cells, near_delta, log2_factor = _near_arrays(None, masses, len(masses), ntarget)
    tree = SourceTree(sources, masses, soa=soa)  # soa: already built by the caller
    fallbacks = np.zeros(ntarget, dtype=np.int8)
    tree_softmax(targets, np.ascontiguousarray(model.B.T), model.beta, tree.soa, tree.depth,
                 tree.level_offset, tree.node_start, tree.node_end, tree.node_centre,
                 tree.node_cos_r, tree.node_sin_r, tree.node_log_mass, model.V, tol, want_div,
                 velocity, divergence, mean, fallbacks, near_cells, near_delta, log2_factor,
                 get_num_threads())
    return int(fallbacks.sum())


def _near_arrays(near, masses, nsource, ntarget):
    """(cells, delta, log2_factor) for the kernels: log2_factor[c] = log₂(f_c/μ_max) with
    f_c = μ_c/A; empty arrays (K = 0) without a near field."""
    if near is None or near.cells.shape[1] == 0:
        return (np.empty((ntarget, 0), dtype=np.int64), np.empty((ntarget, 0, 10)), np.empty(0))
    # the cells come first; point sources after them (atoms) need no correction
    if near.cells.shape[0] != ntarget or nsource < near.npix:
        raise ValueError("the near field was built for other targets or another mesh")
    masses = np.asarray(masses, dtype=float)
    with np.errstate(divide="ignore"):
        log2_factor = (np.log2(np.maximum(masses[: near.npix], 0.0)) - np.log2(masses.max())
                       - np.log2(near.area))
    return near.cells, near.delta, log2_factor


def mesh_sources(mesh, f, points=None, point_masses=None):
    """(sources, masses) of the measure f dA + Σ m_k δ_{x_k}: the cell centroids with masses f·A,
    then the points (atoms) with theirs (near-field tables index the cells, which come first)."""
    sources, masses = mesh.centroids, f * mesh.area
    if points is not None and len(points):
        sources = np.concatenate([sources, points])
        masses = np.concatenate([masses, point_masses])
    return sources, masses


NEAR_FIELD_MAX_BYTES = 2 * 1024**3  # a larger near-field table is not built (warning instead)


class AttentionField:
    """The attention field of cell densities on a mesh, evaluated at fixed target points.

    Sources are the cell centroids with masses f_c·A; work arrays are allocated once. method and
    tol as in attention_field; self.stats holds the method used by the last call.
    near_field: True integrates the kernel exactly over the cells around its peak wherever it is
    narrower than a cell (spherepde.near_field; built once here, costs T·K·88 bytes and a few ms
    per corrected target), False keeps the cell-centre sums. A table above NEAR_FIELD_MAX_BYTES
    is not built: a warning says so and the centre sums are used.

    Routing: the targets the global harmonic expansion handed back are sent straight to the
    tilted regions in the next call (late, concentrated states: most targets; each is still
    served within its error budget). Results then depend on the calls before at round-off level
    only; forget_route() restarts, which a solver does at its snapshots so that a run resumed
    from one repeats the uninterrupted run.
    """

    def __init__(self, model, mesh, targets, method="auto", tol=DEFAULT_TOL, near_field=True):
        self.model = model
        self.mesh = mesh
        self.method = method
        self.tol = tol
        self.stats = {}
        self._route = None
        self.targets = np.ascontiguousarray(targets, dtype=float)
        n = self.targets.shape[0]
        self._out = (np.empty((n, 3)), np.empty(n), np.empty((n, 3)))
        self.near = None
        if near_field and not model.zero_temperature:
            from .near_field import NearField, table_bytes

            size = table_bytes(mesh, model, self.targets)
            if size > NEAR_FIELD_MAX_BYTES:
                import warnings

                warnings.warn(f"near-field table of {size / 2**30:.1f} GiB not built (limit "
                              f"{NEAR_FIELD_MAX_BYTES / 2**30:.0f} GiB): the kernel is narrower than a "
                              "cell and the centre sums under-resolve it; use a finer mesh", stacklevel=2)
            elif size > 0:
                self.near = NearField(mesh, model, self.targets)

    def __call__(self, f, want_div=False, points=None, point_masses=None):
        """The field of the cell densities f (and of point masses at points (n, 3), the atoms of
        spherepde.atoms: exact point sources, appended after the cells)."""
        self.stats.pop("handed_back", None)
        sources, masses = mesh_sources(self.mesh, f, points, point_masses)
        result = attention_field(self.model, sources, masses, self.targets,
                                 want_div=want_div, out=self._out, method=self.method, tol=self.tol,
                                 stats=self.stats, near=self.near, route=self._route)
        self._route = self.stats.get("handed_back")
        return result

    def forget_route(self):
        """The next call tries the global expansion at every target again."""
        self._route = None
