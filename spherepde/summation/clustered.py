"""Attention sums over clustered sources: a tight group of sources as one expansion term.

Tokens concentrate: their clusters shrink like e^{−ct} until they are far narrower than the
scale 1/(β‖B‖₂) on which the softmax kernel varies. Then a group g of sources y_j (masses μ_j)
within a radius r_g of its mean c_g = Σ_g μ_j y_j / M_g (not a unit vector; M_g = Σ_g μ_j) acts
on every target x through a few moments. With a = βBᵀx, d_j = y_j − c_g (Σ_g μ_j d_j = 0 by the
choice of c_g), the central moments S = Σ_g μ_j d_j d_jᵀ / M_g and T = Σ_g μ_j d_j⊗d_j⊗d_j / M_g,
P = 1 + ½ aᵀSa + ⅙ T(a, a, a) and ε = |a| r_g, the Taylor expansion of e^{⟨a, d⟩} to third order gives

    Σ_g μ_j e^{⟨a, y_j⟩}     = M_g e^{⟨a, c_g⟩} P + R₀,                    |R₀| ≤ M_g e^{⟨a, c_g⟩} e^ε ε⁴/24
    Σ_g μ_j e^{⟨a, y_j⟩} y_j = M_g e^{⟨a, c_g⟩} (P c_g + S a + ½ T(a, a, ·)) + R₁,
                               |R₁| ≤ M_g e^{⟨a, c_g⟩} e^ε (ε⁴/24 + r_g ε³/6).

With ε ≤ ε_max and r_g ≤ ε_max both remainders are below (5/6)e^ε ε_max⁴ of the group's term:
ε_max = (4 tol)^{1/4} (epsilon) keeps them below tol, so Z(x) and the first moment have relative
errors ≤ tol and |Δm_β| ≤ 2 tol, for every target at once (as the tree's certified bound).
group_sources sorts the sources into HEALPix NESTED pixels of radius ≤ r/2, r = ε_max/max(β‖B‖₂, 1)
(|a| ≤ β‖B‖₂ for every target); a group that still fails r_g ≤ r (only at MAX_NSIDE) is split back
into its sources (exact terms, S = T = 0). clustered_softmax then sums over the G groups: O(G·T)
instead of O(N·T). spherepde.summation.field uses it when G ≤ N/CLUSTER_GAIN and no divergence is
asked for (the divergence needs the covariance, whose within-group part this expansion carries to
lower order): the token ensembles, whose O(n²) sums made n = 16 000 tokens cost ~20 min a run.

Units as in spherepde.summation.field: positions unit vectors, masses any positive unit.
"""

from __future__ import annotations

import math

import healpy as hp
import numpy as np
from numba import njit, prange

from .fastmath import exp_fast
from .kernels import kernel_direction, project_velocity

__all__ = ["SourceGroups", "group_sources", "clustered_softmax", "epsilon", "CLUSTER_GAIN", "MAX_NSIDE",
           "THIRD_COMPONENTS"]

THIRD_COMPONENTS = ("xxx", "yyy", "zzz", "xxy", "xxz", "xyy", "yyz", "xzz", "yzz", "xyz")
CLUSTER_GAIN = 8  # use the groups when there are at most N/8 of them (a group term costs ~2-3 source terms)
MAX_NSIDE = 2**29  # healpy's largest nside: pixels of ~2e-9 rad


def epsilon(tol):
    """ε_max = (4 tol)^{1/4}: the largest |a|·r_g and r_g allowed (module docstring)."""
    return (4.0 * float(tol)) ** 0.25


class SourceGroups:
    """Sources grouped for clustered_softmax: centres (G, 3) (group means c_g), log_mass (G,) =
    ln M_g, second (G, 6) the components (xx, yy, zz, xy, xz, yz) of S_g, third (G, 10) those of T_g
    (THIRD_COMPONENTS), radius (G,) = max |d_j|; count = G, nsources the sources with positive mass."""

    def __init__(self, centres, log_mass, second, third, radius, nsources):
        self.centres, self.log_mass, self.second, self.third = centres, log_mass, second, third
        self.radius = radius
        self.count, self.nsources = centres.shape[0], int(nsources)


@njit(cache=True)
def _group_moments(sources, masses, order, starts, centres, log_mass, second, third, radius):
    """Moments of the groups order[starts[g]:starts[g+1]] (sources sorted by pixel): the mean
    c_g, ln M_g, the central second and third moments (6 and 10 components) and the radius
    max |y_j − c_g|."""
    for g in range(starts.shape[0] - 1):
        m = 0.0
        c0 = c1 = c2 = 0.0
        for k in range(starts[g], starts[g + 1]):
            j = order[k]
            w = masses[j]
            m += w
            c0 += w * sources[j, 0]
            c1 += w * sources[j, 1]
            c2 += w * sources[j, 2]
        c0 /= m
        c1 /= m
        c2 /= m
        s2 = np.zeros(6)
        s3 = np.zeros(10)
        r2 = 0.0
        for k in range(starts[g], starts[g + 1]):
            j = order[k]
            w = masses[j] / m
            d0 = sources[j, 0] - c0
            d1 = sources[j, 1] - c1
            d2 = sources[j, 2] - c2
            s2[0] += w * d0 * d0
            s2[1] += w * d1 * d1
            s2[2] += w * d2 * d2
            s2[3] += w * d0 * d1
            s2[4] += w * d0 * d2
            s2[5] += w * d1 * d2
            s3[0] += w * d0 * d0 * d0
            s3[1] += w * d1 * d1 * d1
            s3[2] += w * d2 * d2 * d2
            s3[3] += w * d0 * d0 * d1
            s3[4] += w * d0 * d0 * d2
            s3[5] += w * d0 * d1 * d1
            s3[6] += w * d1 * d1 * d2
            s3[7] += w * d0 * d2 * d2
            s3[8] += w * d1 * d2 * d2
            s3[9] += w * d0 * d1 * d2
            r2 = max(r2, d0 * d0 + d1 * d1 + d2 * d2)
        centres[g, 0], centres[g, 1], centres[g, 2] = c0, c1, c2
        log_mass[g] = math.log(m)
        second[g] = s2
        third[g] = s3
        radius[g] = math.sqrt(r2)


def group_sources(sources, masses, scale, tol) -> SourceGroups:
    """Group the sources with positive mass for targets with |a| = |βBᵀx| ≤ scale (= β‖B‖₂):
    HEALPix NESTED pixels of radius ≤ r/2, r = epsilon(tol)/max(scale, 1) (nside ≤ MAX_NSIDE),
    each pixel's sources one group; a group with r_g > r is split into its sources."""
    sources = np.ascontiguousarray(sources, dtype=float)
    masses = np.asarray(masses, dtype=float)
    keep = np.flatnonzero(masses > 0)
    if keep.size == 0:
        raise ValueError("the density has no positive mass")
    sources, masses = np.ascontiguousarray(sources[keep]), np.ascontiguousarray(masses[keep])
    eps = epsilon(tol)
    r_allowed = eps / max(scale, 1.0)
    nside = 1
    while nside < MAX_NSIDE and hp.max_pixrad(nside) > 0.5 * r_allowed:
        nside *= 2
    pix = hp.vec2pix(nside, sources[:, 0], sources[:, 1], sources[:, 2], nest=True)
    order = np.argsort(pix, kind="stable")
    sorted_pix = pix[order]
    starts = np.flatnonzero(np.r_[True, sorted_pix[1:] != sorted_pix[:-1], True]).astype(np.int64)
    count = starts.size - 1
    centres, log_mass = np.empty((count, 3)), np.empty(count)
    second, third, radius = np.empty((count, 6)), np.empty((count, 10)), np.empty(count)
    _group_moments(sources, masses, order, starts, centres, log_mass, second, third, radius)
    loose = radius > r_allowed  # only when nside stopped at MAX_NSIDE (huge β): sources one by one
    if loose.any():
        split = np.concatenate([order[starts[g]:starts[g + 1]] for g in np.flatnonzero(loose)])
        tight = ~loose
        centres = np.concatenate([centres[tight], sources[split]])
        log_mass = np.concatenate([log_mass[tight], np.log(masses[split])])
        second = np.concatenate([second[tight], np.zeros((split.size, 6))])
        third = np.concatenate([third[tight], np.zeros((split.size, 10))])
        radius = np.concatenate([radius[tight], np.zeros(split.size)])
    return SourceGroups(np.ascontiguousarray(centres), log_mass, np.ascontiguousarray(second),
                        np.ascontiguousarray(third), radius, keep.size)


@njit(cache=True, parallel=True)
def clustered_softmax(targets, BT, beta, centres, log_mass, second, third, V, velocity, mean, logz):
    """The softmax mean m_β, v = P_x(V m_β) and (if logz is not empty) log Z(x) of grouped
    sources (module docstring: third-order expansion per group; exact for groups with S = T = 0).

    targets (T, 3) unit vectors; BT = Bᵀ; centres (G, 3), log_mass (G,), second (G, 6), third
    (G, 10) from group_sources. Writes velocity (T, 3), mean (T, 3), logz (T,) or length 0 for none.
    """
    G = centres.shape[0]
    for i in prange(targets.shape[0]):
        x0, x1, x2 = targets[i, 0], targets[i, 1], targets[i, 2]
        a0, a1, a2, _, _, _, _ = kernel_direction(BT, beta, x0, x1, x2)  # a = βBᵀx
        shift = -np.inf
        for g in range(G):
            e = a0 * centres[g, 0] + a1 * centres[g, 1] + a2 * centres[g, 2] + log_mass[g]
            shift = max(shift, e)
        q00, q11, q22 = a0 * a0, a1 * a1, a2 * a2
        q01, q02, q12 = 2.0 * a0 * a1, 2.0 * a0 * a2, 2.0 * a1 * a2
        z = n0 = n1 = n2 = 0.0
        for g in range(G):
            e = a0 * centres[g, 0] + a1 * centres[g, 1] + a2 * centres[g, 2] + log_mass[g] - shift
            w = exp_fast(e)
            s = second[g]
            sa0 = s[0] * a0 + s[3] * a1 + s[4] * a2  # S a
            sa1 = s[3] * a0 + s[1] * a1 + s[5] * a2
            sa2 = s[4] * a0 + s[5] * a1 + s[2] * a2
            t = third[g]  # xxx yyy zzz xxy xxz xyy yyz xzz yzz xyz
            ta0 = t[0] * q00 + t[5] * q11 + t[7] * q22 + t[3] * q01 + t[4] * q02 + t[9] * q12  # T(a, a, ·)
            ta1 = t[3] * q00 + t[1] * q11 + t[8] * q22 + t[5] * q01 + t[9] * q02 + t[6] * q12
            ta2 = t[4] * q00 + t[6] * q11 + t[2] * q22 + t[9] * q01 + t[7] * q02 + t[8] * q12
            f = 1.0 + 0.5 * (a0 * sa0 + a1 * sa1 + a2 * sa2) + (a0 * ta0 + a1 * ta1 + a2 * ta2) / 6.0
            z += w * f
            n0 += w * (f * centres[g, 0] + sa0 + 0.5 * ta0)
            n1 += w * (f * centres[g, 1] + sa1 + 0.5 * ta1)
            n2 += w * (f * centres[g, 2] + sa2 + 0.5 * ta2)
        m0, m1, m2 = n0 / z, n1 / z, n2 / z
        mean[i, 0], mean[i, 1], mean[i, 2] = m0, m1, m2
        project_velocity(V, m0, m1, m2, x0, x1, x2, velocity[i])
        if logz.shape[0] > 0:
            logz[i] = shift + math.log(z)
