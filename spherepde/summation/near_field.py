"""Near-field correction of the attention sums: exact cell integrals of the kernel near its peak.

The sums of spherepde.summation are the cell-centre (midpoint) rule for

    Z(x) = ∫ f(y) e^{⟨a, y − â⟩} dy,  ∫ f(y) e^{⟨a, y − â⟩} d dy,  ∫ f(y) e^{⟨a, y − â⟩} d dᵀ dy

(a = βBᵀx, â = a/|a|, d = y − â). The rule is second order, but its constant grows like |a|h²
(h the cell size): when the kernel's width σ = |a|^{-1/2} is comparable to a cell, the sums are
dominated by a few cell centres and m_β degrades towards a hardmax over centres; div v, which
needs the covariance to O(1/β), degrades first.

This module replaces, for the cells around the peak â, the midpoint terms μ_c e^{⟨a, d_c⟩}(1, d_c,
d_c d_cᵀ) by the integrals of the kernel over the true cell, times the cell average f_c:

    Δ_c(x) = ∫_cell e^{⟨a, y − â⟩} (1, d, d dᵀ) dA − A e^{⟨a, d_c⟩} (1, d_c, d_c d_cᵀ)

so the corrected sums are Σ_c μ_c K(y_c) + Σ_{near c} f_c Δ_c: the exact integral of the kernel
against the piecewise-constant density near the peak, the midpoint rule elsewhere. Δ depends on
the mesh, the model and the target only, not on f, so it is computed once per (mesh, model,
targets) and each evaluation adds K·10 multiply-adds per target. Units: Δ_c is an area on the
unit sphere (steradians) times the kernel relative to its peak, e^{⟨a, y − â⟩} ≤ 1 (= 1 at y = â).

The cell integrals use the equal-area HEALPix map (dA = A du dv on the pixel square, see
spherepde.geometry.mesh) with adaptive subdivision of the pixel square: a sub-square is dropped when the
kernel on it is below NEGLIGIBLE of the cell's largest kernel value, integrated with the
Gauss rule when an error model of the rule (or the exponent's spread LEAF_VARIATION) allows, and
split in four otherwise. Squares that meet the map's derivative jumps (the lines jr = 1, 3 on the
pixel diagonals of the rings z = ±2/3, and the poles) get the two-triangle rule, whose split
follows the sub-square's anti-diagonal; the others the tensor Gauss rule.

In the tails f falls by decades per cell, and f constant per cell puts the weight of a narrow
kernel in the wrong place. NearField(..., slopes=γ) then takes the log-linear profile
f_c e^{⟨γ_c, y − y_c⟩}/N_c in each near cell (same cell average): the kernel times the profile is
the kernel of a + γ_c, so the same adaptive integral serves (_sloped_cell_integral), and the
table depends on f (docs/numerics.md#near-field-in-the-tails-near_field_profile).
"""

from __future__ import annotations

import math

import healpy as hp
import numpy as np
from numba import njit, prange

from ..geometry.faces import FACE_LONGITUDE, FACE_RING
from ..geometry.quadrature import gauss_legendre_01, pixel_rule

__all__ = ["NearField", "near_field_table", "near_rings", "table_bytes", "cell_kernel_integral", "tensor_rule",
           "log_mean_exp_linear"]

GAUSS_ORDER = 10  # points per direction of each triangle's collapsed Gauss rule (200 per square)
LEAF_VARIATION = 1.0  # |a|·(r·sin θ + r²): the exponent's spread over a leaf sub-square
NEGLIGIBLE = 1e-16  # a sub-square whose kernel bound × area is below this × (cell max × A) is dropped
ACCURACY = 1e-12  # target error of a leaf, relative to the cell's largest kernel value × A
_FACTORIAL_2P = float(math.factorial(2 * GAUSS_ORDER))
MAX_RINGS = 3  # at most 7 × 7 cells per target
WIDTH_RATIO = 1.0  # correct where the kernel is narrower than a cell (|a|h² > 1)
COVERAGE = 3.0  # rings reach 3σ from the peak (2σ: div v errors 3× larger, measured)
MAX_DEPTH = 24  # sub-square size 2⁻²⁴ of a pixel: far below any kernel width in double precision
STACK = 4 * MAX_DEPTH + 4  # depth-first: at most 3 pending siblings per level
SLOPE_SPLIT = 4  # N_c of a log-linear profile: 4 × 4 sub-squares of the 10 × 10 Gauss rule
MAX_SLOPE_SPREAD = 20.0  # |γ|·h ≤ 20: Gauss error of N_c ≤ (2.5)^20/20! ≈ 4e-11 of a sub-square's max


@njit(cache=True)
def _face_point(face, u, v, jrll, jpll, out):
    """Unit vector of base-face coordinates (u, v) (scalar version of mesh.face_to_sphere)."""
    jr = jrll[face] - u - v
    if jr < 1.0:
        nr = jr
        tmp = nr * nr / 3.0
        z = 1.0 - tmp
        s = math.sqrt(tmp * (2.0 - tmp))
    elif jr > 3.0:
        nr = 4.0 - jr
        tmp = nr * nr / 3.0
        z = tmp - 1.0
        s = math.sqrt(tmp * (2.0 - tmp))
    else:
        nr = 1.0
        z = (2.0 - jr) * (2.0 / 3.0)
        s = math.sqrt((1.0 - z) * (1.0 + z))
    phi = (math.pi / 4.0) * (jpll[face] + (u - v) / nr) if nr > 1e-15 else 0.0
    out[0] = s * math.cos(phi)
    out[1] = s * math.sin(phi)
    out[2] = z


@njit(cache=True)
def _angle(p, q):
    """Angle between unit vectors p and q (atan2 form: accurate for small angles)."""
    c0 = p[1] * q[2] - p[2] * q[1]
    c1 = p[2] * q[0] - p[0] * q[2]
    c2 = p[0] * q[1] - p[1] * q[0]
    return math.atan2(math.sqrt(c0 * c0 + c1 * c1 + c2 * c2), p[0] * q[0] + p[1] * q[1] + p[2] * q[2])


@njit(cache=True)
def _square_extent(face, u0, v0, du, jrll, jpll, centre, work):
    """Centre point (written to centre) and angular radius of the face square [u0, u0+du] × [v0, v0+du]:
    the largest angle from the centre to its corners and edge midpoints, +5 % for the curved sides."""
    _face_point(face, u0 + 0.5 * du, v0 + 0.5 * du, jrll, jpll, centre)
    r = 0.0
    for ka in range(3):
        for kb in range(3):
            if ka == 1 and kb == 1:
                continue
            _face_point(face, u0 + 0.5 * du * ka, v0 + 0.5 * du * kb, jrll, jpll, work)
            r = max(r, _angle(centre, work))
    return 1.05 * r


@njit(cache=True)
def _meets_kink(face, u, v, d, jrll):
    """Whether the face square [u, u+d] × [v, v+d] meets a line jr ∈ {0, 1, 3, 4} (pole, polar/
    equatorial boundary), where the map's derivative jumps: then the two-triangle rule."""
    jr_hi = jrll[face] - u - v
    jr_lo = jr_hi - 2.0 * d
    for line in (0.0, 1.0, 3.0, 4.0):
        if jr_lo <= line <= jr_hi:
            return True
    return False


@njit(cache=True)
def log_mean_exp_linear(face, u0, v0, du, gamma, centre, ra, rb, rw, ta, tb, tw, jrll, jpll):
    """ln (1/A)∫_cell e^{⟨γ, y − y_c⟩} dA over the pixel [u0, u0+du] × [v0, v0+du] (y_c = centre):
    the normalisation of the log-linear reconstruction f_c e^{⟨γ, y − y_c⟩}/N_c, whose cell average
    is f_c. SLOPE_SPLIT² equal sub-squares, each with the rule of cell_kernel_integral, summed with
    the largest exponent factored out (no overflow for any |γ|·h)."""
    n = SLOPE_SPLIT
    d = du / n
    y = np.empty(3)
    top = -np.inf  # the largest exponent met (log-sum-exp)
    total = 0.0
    for i in range(n):
        for j in range(n):
            u = u0 + d * i
            v = v0 + d * j
            qa, qb, qw = (ra, rb, rw) if _meets_kink(face, u, v, d, jrll) else (ta, tb, tw)
            for k in range(qw.size):
                _face_point(face, u + d * qa[k], v + d * qb[k], jrll, jpll, y)
                e = (gamma[0] * (y[0] - centre[0]) + gamma[1] * (y[1] - centre[1])
                     + gamma[2] * (y[2] - centre[2]))
                if e > top:
                    total = total * math.exp(top - e) if total > 0.0 else 0.0
                    top = e
                total += qw[k] * math.exp(e - top)
    return top + math.log(total / (n * n))


@njit(cache=True)
def cell_kernel_integral(face, u0, v0, du, a, ahat, anorm, area, ra, rb, rw, ta, tb, tw, jrll, jpll, out):
    """out[0:10] += ∫_cell e^{⟨a, y − â⟩}(1, d, d dᵀ upper triangle) dA, d = y − â, over the pixel
    [u0, u0+du] × [v0, v0+du] of base face `face` (dA = area/du² du dv: equal-area map).

    Adaptive subdivision (module docstring). ra, rb, rw: the two-triangle rule on [0, 1]², ta, tb,
    tw: the tensor Gauss rule (weights sum to 1). Returns the number of leaf sub-squares integrated.
    """
    su = np.empty(STACK)
    sv = np.empty(STACK)
    sd = np.empty(STACK)
    centre = np.empty(3)
    work = np.empty(3)
    y = np.empty(3)
    # the cell's largest kernel value bounds what "negligible" means for its sub-squares
    r_cell = _square_extent(face, u0, v0, du, jrll, jpll, centre, work)
    theta = max(0.0, _angle(centre, ahat) - r_cell)
    cell_max = math.exp(-anorm * (1.0 - math.cos(theta)))
    floor = NEGLIGIBLE * cell_max
    top = 0
    su[0] = u0
    sv[0] = v0
    sd[0] = du
    top = 1
    leaves = 0
    while top > 0:
        top -= 1
        u = su[top]
        v = sv[top]
        d = sd[top]
        frac = (d / du) ** 2  # area fraction of the cell
        r = _square_extent(face, u, v, d, jrll, jpll, centre, work)
        theta_c = _angle(centre, ahat)
        theta = max(0.0, theta_c - r)
        if frac * math.exp(-anorm * (1.0 - math.cos(theta))) < floor:
            continue
        spread = anorm * (r * math.sin(min(theta_c + r, math.pi / 2.0)) + r * r)
        # error model of the Gauss rule for e^{g·s} over a spread L: (L/2)^{2p}/(2p)!, relative to
        # the sub-square's kernel bound; compare with ACCURACY × the cell's largest kernel value
        bound = frac * math.exp(-anorm * (1.0 - math.cos(theta)))
        error = bound * (0.5 * spread) ** (2 * GAUSS_ORDER) / _FACTORIAL_2P
        if spread > LEAF_VARIATION and error > ACCURACY * cell_max and d > du * 2.0**-MAX_DEPTH:
            h = 0.5 * d
            for k in range(4):
                su[top] = u + h * (k % 2)
                sv[top] = v + h * (k // 2)
                sd[top] = h
                top += 1
            continue
        leaves += 1
        weight_scale = area * frac
        # the map is smooth inside the square unless a line jr ∈ {0, 1, 3, 4} (pole, polar/
        # equatorial boundary) meets it: then the two-triangle rule, else the tensor Gauss rule
        qa, qb, qw = (ra, rb, rw) if _meets_kink(face, u, v, d, jrll) else (ta, tb, tw)
        for k in range(qw.size):
            _face_point(face, u + d * qa[k], v + d * qb[k], jrll, jpll, y)
            d0 = y[0] - ahat[0]
            d1 = y[1] - ahat[1]
            d2 = y[2] - ahat[2]
            w = weight_scale * qw[k] * math.exp(a[0] * d0 + a[1] * d1 + a[2] * d2)
            out[0] += w
            out[1] += w * d0
            out[2] += w * d1
            out[3] += w * d2
            out[4] += w * d0 * d0
            out[5] += w * d0 * d1
            out[6] += w * d0 * d2
            out[7] += w * d1 * d1
            out[8] += w * d1 * d2
            out[9] += w * d2 * d2
    return leaves


@njit(cache=True)
def _sloped_cell_integral(face, u0, v0, du, a, ahat, anorm, gamma, centre, area, ra, rb, rw, ta, tb, tw,
                          jrll, jpll, out):
    """out[0:10] = ∫_cell e^{⟨a, y − â⟩} φ(y) (1, d, d dᵀ upper triangle) dA, d = y − â, for the
    log-linear density profile φ(y) = e^{⟨γ, y − y_c⟩}/N_c of cell average 1 (y_c = centre):

        e^{⟨a, y − â⟩ + ⟨γ, y − y_c⟩} = e^{⟨a', y − â'⟩} e^{|a'| − |a| − ⟨γ, y_c⟩},  a' = a + γ,

    i.e. the kernel of a' (cell_kernel_integral, moments about â') shifted to moments about â."""
    a2 = np.empty(3)
    ahat2 = np.empty(3)
    for r in range(3):
        a2[r] = a[r] + gamma[r]
    anorm2 = math.sqrt(a2[0] ** 2 + a2[1] ** 2 + a2[2] ** 2)
    for r in range(3):
        ahat2[r] = a2[r] / anorm2
    o = np.zeros(10)
    cell_kernel_integral(face, u0, v0, du, a2, ahat2, anorm2, area, ra, rb, rw, ta, tb, tw, jrll, jpll, o)
    log_norm = log_mean_exp_linear(face, u0, v0, du, gamma, centre, ra, rb, rw, ta, tb, tw, jrll, jpll)
    scale = math.exp(anorm2 - anorm - (gamma[0] * centre[0] + gamma[1] * centre[1] + gamma[2] * centre[2])
                     - log_norm)
    s = (ahat2[0] - ahat[0], ahat2[1] - ahat[1], ahat2[2] - ahat[2])  # d = d' + s
    m1 = (o[1], o[2], o[3])
    out[0] = scale * o[0]
    for r in range(3):
        out[1 + r] = scale * (m1[r] + s[r] * o[0])
    q = 4
    for r in range(3):
        for t in range(r, 3):
            out[q] = scale * (o[q] + s[r] * m1[t] + m1[r] * s[t] + s[r] * s[t] * o[0])
            q += 1


@njit(cache=True, parallel=True)
def near_field_table(targets, BT, beta, home, neighbours, rings, face, ix, iy, nside, centroids,
                     area, ra, rb, rw, ta, tb, tw, jrll, jpll, slopes, cells, delta):
    """Fill cells (T, K) (−1 = unused) and delta (T, K, 10) with the near cells of each target
    (the home cell of â and `rings` rings of neighbours around it) and their corrections Δ_c
    (module docstring). Targets with rings[i] = 0 get no correction. slopes (npix, 3): the
    tangent gradient γ_c of ln f in each cell (1/radian); a cell with γ_c ≠ 0 is integrated with
    the log-linear profile e^{⟨γ_c, y − y_c⟩}/N_c (_sloped_cell_integral), one with γ_c = 0 with
    f constant."""
    ntarget = targets.shape[0]
    kmax = cells.shape[1]
    for i in prange(ntarget):
        for k in range(kmax):
            cells[i, k] = -1
            for q in range(10):
                delta[i, k, q] = 0.0
        if rings[i] == 0:
            continue
        a = np.empty(3)
        ahat = np.empty(3)
        for r in range(3):
            a[r] = beta * (BT[r, 0] * targets[i, 0] + BT[r, 1] * targets[i, 1] + BT[r, 2] * targets[i, 2])
        anorm = math.sqrt(a[0] ** 2 + a[1] ** 2 + a[2] ** 2)
        for r in range(3):
            ahat[r] = a[r] / anorm
        # the near cells: home, then ring after ring of neighbours (deduplicated)
        count = 1
        cells[i, 0] = home[i]
        begin = 0
        for _ in range(rings[i]):
            end = count
            for k in range(begin, end):
                for s in range(8):
                    c = neighbours[cells[i, k], s]
                    new = True
                    for m in range(count):
                        if cells[i, m] == c:
                            new = False
                            break
                    if new and count < kmax:
                        cells[i, count] = c
                        count += 1
            begin = end
        out = np.empty(10)
        for k in range(count):
            c = cells[i, k]
            for q in range(10):
                out[q] = 0.0
            if slopes[c, 0] == 0.0 and slopes[c, 1] == 0.0 and slopes[c, 2] == 0.0:
                cell_kernel_integral(face[c], ix[c] / nside, iy[c] / nside, 1.0 / nside, a, ahat, anorm,
                                     area, ra, rb, rw, ta, tb, tw, jrll, jpll, out)
            else:
                _sloped_cell_integral(face[c], ix[c] / nside, iy[c] / nside, 1.0 / nside, a, ahat, anorm,
                                      slopes[c], centroids[c], area, ra, rb, rw, ta, tb, tw, jrll, jpll, out)
            d0 = centroids[c, 0] - ahat[0]
            d1 = centroids[c, 1] - ahat[1]
            d2 = centroids[c, 2] - ahat[2]
            w = area * math.exp(a[0] * d0 + a[1] * d1 + a[2] * d2)
            mid = (w, w * d0, w * d1, w * d2, w * d0 * d0, w * d0 * d1, w * d0 * d2, w * d1 * d1,
                   w * d1 * d2, w * d2 * d2)
            for q in range(10):
                delta[i, k, q] = out[q] - mid[q]


def near_rings(anorm, h, max_rings=MAX_RINGS, width_ratio=WIDTH_RATIO, coverage=COVERAGE):
    """Rings of neighbour cells to correct, per target, for kernel exponent norms |a| on a mesh of
    cell size h (σ = |a|^{-1/2} the kernel width): none where σ ≥ width_ratio·h (the midpoint
    rule's error ~|a|h²/24 is small and its errors in the numerator and denominator of m_β
    cancel), else enough rings to cover coverage·σ around the peak, at least 1, at most
    max_rings. Correcting fewer cells than the kernel's support breaks that cancellation: one ring
    at σ ≈ h doubled the error of m_β (measured)."""
    sigma = 1.0 / np.sqrt(np.maximum(anorm, 1e-300))
    rings = np.clip(np.ceil(coverage * sigma / h), 1, max_rings)
    return np.where(sigma >= width_ratio * h, 0, rings).astype(np.int64)


def tensor_rule(order):
    """order × order Gauss–Legendre rule on [0, 1]² (weights sum to 1)."""
    x, w = gauss_legendre_01(order)
    a, b = np.meshgrid(x, x, indexing="ij")
    return a.ravel(), b.ravel(), np.outer(w, w).ravel()


def _rings_of(mesh, model, targets):
    a = np.asarray(targets, dtype=float) @ model.B * model.beta  # rows (βBᵀx)ᵀ
    anorm = np.linalg.norm(a, axis=1)
    return a, anorm, near_rings(anorm, math.sqrt(mesh.area))


def table_bytes(mesh, model, targets):
    """Bytes of the NearField table these targets would need (0: no target needs a correction)."""
    _, _, ring = _rings_of(mesh, model, targets)
    if not ring.any():
        return 0
    return len(targets) * (2 * int(ring.max()) + 1) ** 2 * 88


class NearField:
    """Precomputed near-field corrections of a mesh, a model and fixed targets.

    cells (T, K) int64 (−1 = unused), delta (T, K, 10): pass both to attention_field(near=...).
    Memory: T·K·88 bytes (K = 9 for one ring).
    slopes: None (f constant in each cell), or (npix, 3) tangent gradients γ_c of ln f (1/radian):
    the near cells then hold the log-linear profile f_c e^{⟨γ_c, y − y_c⟩}/N_c (same cell average),
    so that a kernel narrower than a cell sees how the density varies across it where it falls by
    decades per cell (the tails). |γ_c| is capped at MAX_SLOPE_SPREAD/h (h = √A): the profile
    spans at most e^{±MAX_SLOPE_SPREAD/2} over a cell. The table then depends on f: build it for
    every density (cost ~ 6·10³ exponentials per sloped near cell per target).
    """

    def __init__(self, mesh, model, targets, slopes=None):
        targets = np.ascontiguousarray(targets, dtype=float)
        self.npix, self.area = mesh.npix, float(mesh.area)
        a, anorm, ring = _rings_of(mesh, model, targets)
        self.active = int(np.count_nonzero(ring))
        kmax = (2 * int(ring.max()) + 1) ** 2 if self.active else 0
        self.cells = np.full((targets.shape[0], kmax), -1, dtype=np.int64)
        self.delta = np.zeros((targets.shape[0], kmax, 10))
        if not self.active:
            return
        safe = np.where(anorm[:, None] > 0, a / np.maximum(anorm, 1e-300)[:, None], targets)
        home = hp.vec2pix(mesh.nside, safe[:, 0], safe[:, 1], safe[:, 2], nest=True).astype(np.int64)
        ra, rb, rw = pixel_rule(GAUSS_ORDER)
        ta, tb, tw = tensor_rule(GAUSS_ORDER)
        if slopes is None:
            slopes = np.zeros((mesh.npix, 3))
        else:
            slopes = np.array(slopes, dtype=float).reshape(mesh.npix, 3)
            size = np.linalg.norm(slopes, axis=1) * math.sqrt(mesh.area)
            slopes *= (np.minimum(size, MAX_SLOPE_SPREAD) / np.maximum(size, 1e-300))[:, None]
        near_field_table(targets, np.ascontiguousarray(model.B.T), float(model.beta), home,
                         np.ascontiguousarray(mesh.neighbours, dtype=np.int64), ring,
                         np.ascontiguousarray(mesh._face, dtype=np.int64), mesh._ix, mesh._iy,
                         float(mesh.nside), mesh.centroids, float(mesh.area), ra, rb, rw, ta, tb, tw,
                         FACE_RING.astype(float), FACE_LONGITUDE.astype(float), slopes, self.cells, self.delta)

    @property
    def nbytes(self):
        return self.cells.nbytes + self.delta.nbytes
