"""HEALPix finite-volume geometry (NESTED ordering throughout).

A HEALPix pixel is the image of a square of the base-face coordinates (u, v) ∈ [0, 1]² under the
HEALPix projection, which is equal-area: on every base face the surface measure is
dA = (4π/12) du dv. That makes exact cell integrals cheap (uniform quadrature in (u, v)), and it
gives the true curved pixel boundaries (lines u = const or v = const), which are NOT great-circle
arcs (docs/theory.md#healpix-facts-for-finite-volumes).

Everything here is computed once per mesh, vectorised, and knows nothing about transport.
"""

from __future__ import annotations

import math

import healpy as hp
import numpy as np

from .faces import FACE_RING, face_to_sphere
from .quadrature import gauss_legendre_01, pixel_rule

__all__ = ["HealpixMesh", "EDGE_SLOTS", "EDGE_START", "EDGE_END"]

# Edge-sharing neighbour slots of healpy.get_all_neighbours (order SW, W, NW, N, NE, E, SE, S).
EDGE_SLOTS = (0, 2, 4, 6)  # SW, NW, NE, SE
# Each pixel edge traversed counter-clockwise seen from outside (docs/theory.md#healpix-facts-for-finite-volumes):
# SW = W→S, NW = N→W, NE = E→N, SE = S→E, given in pixel-local (a, b) ∈ [0, 1]² coordinates
# (a along the face u axis, b along v; S = (0,0), E = (1,0), N = (1,1), W = (0,1)).
EDGE_START = np.array([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
EDGE_END = np.array([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])


class HealpixMesh:
    """HEALPix finite-volume mesh in NESTED ordering.

    Attributes, all NumPy arrays computed once:

    - nside, npix, area (= 4π/npix, exact), level (= log2 nside)
    - centers (npix, 3): pixel centres as given by healpy.pix2vec (not area centroids)
    - centroids (npix, 3): unit area centroids ∫x dA / |∫x dA| (used by the reconstruction)
    - edge_cells (nedges, 2): the two cells (p, q) of each shared edge, p < q; each edge once
    - edge_points (nedges, nq, 3): Gauss points on the true curved edge, ordered A → B
    - edge_weights (nedges, nq): arc-length quadrature weights (sum = edge length, radians)
    - edge_normals (nedges, nq, 3): unit normals tangent to the sphere, pointing from p to q
    - edge_nodes (nedges, nq + 1, 3): sub-arc end points (corners A, B at both ends) such that
      the sub-arc k holds Gauss point k; the stream-function flux of sub-arc k is ψ(node k) −
      ψ(node k+1), and the sub-arcs telescope to ψ(A) − ψ(B)
    - cell_edges (npix, 4), cell_edge_sign (npix, 4): the edges of every cell (slots SW, NW, NE,
      SE) and +1 where the cell is the edge's p side (flux leaves), −1 where it is q
    - neighbours (npix, 8): all neighbours (edge and corner), missing corner slots → the cell
    - lsq_coef (npix, 8, 3): least-squares gradient weights: ∇f_p ≈ Σ_j lsq_coef[p, j] (f_nbr − f_p)

    The edge orientation A → B is counter-clockwise around p seen from outside, so that the unit
    normal is n = t × x (t the unit tangent) and, for a solenoidal field v = x × ∇ψ, the flux
    through the edge from p to q is exactly ψ(A) − ψ(B).
    """

    def __init__(self, nside: int, edge_quadrature: int = 2):
        if not (isinstance(nside, (int, np.integer)) and nside >= 1 and (nside & (nside - 1)) == 0):
            raise ValueError(f"nside must be a positive power of two, got {nside!r}")
        if edge_quadrature < 1:
            raise ValueError(f"edge_quadrature must be >= 1, got {edge_quadrature!r}")
        self.nside = int(nside)
        self.level = int(round(math.log2(self.nside)))
        self.npix = 12 * self.nside**2
        self.area = 4.0 * np.pi / self.npix
        self.edge_quadrature = int(edge_quadrature)
        self.cell_ids = np.arange(self.npix, dtype=np.int64)
        ix, iy, face = hp.pix2xyf(self.nside, self.cell_ids, nest=True)
        self._ix, self._iy, self._face = ix.astype(float), iy.astype(float), face
        self.centers = np.stack(hp.pix2vec(self.nside, self.cell_ids, nest=True), axis=-1)
        self.centroids = self._area_centroids()
        self._build_edges()
        self._build_gradient_stencil()

    # ---------------------------------------------------------------- cell quadrature
    def cell_quadrature(self, order: int = 3, cells=None):
        """Points (ncell, m, 3) and weights (m,) (fractions of a cell, sum 1) of an exact-area rule.

        Equal area of the HEALPix projection: the uniform (u, v) measure is the surface measure,
        so the cell average of g is Σ_k weights[k] g(points[:, k]).
        """
        cells = self.cell_ids if cells is None else np.asarray(cells)
        return self.square_quadrature(cells, 0.0, 0.0, 1.0, order)

    def square_quadrature(self, cells, a0, b0, size, order: int = 3):
        """The exact-area rule on sub-squares [a0, a0 + size] × [b0, b0 + size] of cells, in pixel
        coordinates (the cell is [0, 1]²). Points (n, m, 3); weights (m,) are fractions of the
        sub-square (sum 1), whose area is size² × the cell area. For adaptive integration."""
        a, b, w = pixel_rule(order)
        cells = np.asarray(cells)
        a0 = np.broadcast_to(np.asarray(a0, dtype=float), cells.shape)[:, None]
        b0 = np.broadcast_to(np.asarray(b0, dtype=float), cells.shape)[:, None]
        u = (self._ix[cells, None] + a0 + size * a[None, :]) / self.nside
        v = (self._iy[cells, None] + b0 + size * b[None, :]) / self.nside
        return face_to_sphere(self._face[cells, None], u, v), w

    def cell_average(self, func, order: int = 4, chunk: int = 65536):
        """Cell averages (1/A)∫_cell func(x) dA of a function of unit vectors (n, 3) → (n,)."""
        out = np.empty(self.npix)
        for start in range(0, self.npix, chunk):
            cells = self.cell_ids[start : start + chunk]
            pts, w = self.cell_quadrature(order, cells)
            vals = np.asarray(func(pts.reshape(-1, 3)), dtype=float).reshape(pts.shape[:2])
            out[start : start + chunk] = vals @ w
        return out

    def _area_centroids(self):
        out = np.empty((self.npix, 3))
        for start in range(0, self.npix, 65536):
            cells = self.cell_ids[start : start + 65536]
            pts, w = self.cell_quadrature(6, cells)
            out[start : start + 65536] = np.einsum("ckd,k->cd", pts, w)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    # ---------------------------------------------------------------- edges
    def _build_edges(self):
        npix, nside = self.npix, self.nside
        neighbours = hp.get_all_neighbours(nside, self.cell_ids, nest=True).T  # (npix, 8)
        side_nbr = neighbours[:, list(EDGE_SLOTS)]  # (npix, 4), always present
        if np.any(side_nbr < 0):
            raise RuntimeError("healpy returned a missing edge neighbour")
        # Each edge is seen from both of its cells; keep the view from the lower index p < q.
        # This uses neither reciprocity of the slots nor any face-boundary special case.
        owner = np.repeat(self.cell_ids, 4)
        slot = np.tile(np.arange(4), npix)
        other = side_nbr.ravel()
        keep = owner < other
        p, q, s = owner[keep], other[keep], slot[keep]
        if p.size != 2 * npix:
            raise RuntimeError(f"expected {2 * npix} edges, found {p.size}")
        self.nedges = p.size
        self.edge_cells = np.stack([p, q], axis=1)

        # Incidence: for every (cell, slot) its edge id, matched by the unordered pair key.
        key_all = np.minimum(owner, other) * npix + np.maximum(owner, other)
        key_kept = p * npix + q
        order = np.argsort(key_kept)
        pos = np.searchsorted(key_kept[order], key_all)
        if not np.array_equal(key_kept[order][pos], key_all):
            raise RuntimeError("edge incidence could not be matched")
        self.cell_edges = order[pos].reshape(npix, 4)
        self.cell_edge_sign = np.where(owner < other, 1.0, -1.0).reshape(npix, 4)

        # Geometry on p's side: a straight line in face coordinates, mapped onto the sphere.
        nq = self.edge_quadrature
        s_nodes, s_weights = gauss_legendre_01(nq)
        s_breaks = np.concatenate([[0.0], np.cumsum(s_weights)])
        s_breaks[-1] = 1.0
        a0, a1 = EDGE_START[s], EDGE_END[s]  # (E, 2) pixel-local start/end
        base_u, base_v, face = self._ix[p], self._iy[p], self._face[p]

        # In the polar caps the map has a pole at nr = 0 (φ ∝ 1/nr), one edge length away from
        # the edges next to the pole: Gauss points uniform in the face coordinate converge slowly
        # there (1e-3 relative flux error with 2 points). Uniform points in log nr see an entire
        # function instead. nr is linear along an edge, so the map s → position stays explicit.
        jr = FACE_RING[face][:, None] - (base_u[:, None] + np.stack([a0[:, 0], a1[:, 0]], 1)) / nside \
            - (base_v[:, None] + np.stack([a0[:, 1], a1[:, 1]], 1)) / nside
        nr_ends = np.where(np.all(jr <= 1.0, axis=1)[:, None], jr,
                           np.where(np.all(jr >= 3.0, axis=1)[:, None], 4.0 - jr, np.nan))
        graded = np.all(nr_ends > 0.0, axis=1)  # in a cap and not touching the pole
        nr_a = np.where(graded, nr_ends[:, 0], 1.0)
        nr_b = np.where(graded, nr_ends[:, 1], 2.0)
        log_ratio = np.log(nr_b / nr_a)

        def fraction(sv):
            """Fraction λ(s) ∈ [0, 1] along the edge and dλ/ds, for s ∈ [0, 1]."""
            nr = nr_a[:, None] ** (1.0 - sv[None, :]) * nr_b[:, None] ** sv[None, :]
            lam = np.where(graded[:, None], (nr - nr_a[:, None]) / (nr_b - nr_a)[:, None], sv[None, :])
            dlam = np.where(graded[:, None], nr * (log_ratio / (nr_b - nr_a))[:, None], 1.0)
            lam[:, 0] = np.where(sv[0] == 0.0, 0.0, lam[:, 0])
            lam[:, -1] = np.where(sv[-1] == 1.0, 1.0, lam[:, -1])
            return lam, dlam

        def along(sv):
            lam, dlam = fraction(sv)
            loc = a0[:, None, :] + lam[..., None] * (a1 - a0)[:, None, :]
            u = (base_u[:, None] + loc[..., 0]) / nside
            v = (base_v[:, None] + loc[..., 1]) / nside
            return u, v, dlam

        u, v, dlam = along(s_nodes)
        X, Xu, Xv = face_to_sphere(face[:, None], u, v, derivatives=True)
        d = (a1 - a0) / nside  # d(u, v)/dλ, (E, 2)
        tangent = (Xu * d[:, None, 0, None] + Xv * d[:, None, 1, None]) * dlam[..., None]
        speed = np.linalg.norm(tangent, axis=-1)
        self.edge_points = X
        self.edge_weights = s_weights[None, :] * speed
        self.edge_normals = np.cross(tangent / speed[..., None], X)
        ub, vb, _ = along(s_breaks)
        self.edge_nodes = face_to_sphere(face[:, None], ub, vb)
        # Both facts are built into the construction; checked here because a wrong slot table
        # would silently flip fluxes.
        toward_q = np.einsum("ekd,ed->ek", self.edge_normals, self.centroids[q] - self.centroids[p])
        if not np.all(toward_q > 0):
            raise RuntimeError("edge normals do not point from p to q")
        self.neighbours_raw = neighbours

    # ---------------------------------------------------------------- reconstruction stencil
    def _build_gradient_stencil(self):
        """Weighted least squares in the tangent plane at the centroid, from all 7–8 neighbours.

        Minimise Σ_j w_j (f_j − f_p − g·d_j)², d_j = P_c(c_j − c), w_j = 1/|d_j|².
        """
        nbr = self.neighbours_raw
        valid = nbr >= 0
        self.neighbours = np.where(valid, nbr, self.cell_ids[:, None])
        c = self.centroids
        d = c[self.neighbours] - c[:, None, :]
        d -= np.einsum("pjd,pd->pj", d, c)[..., None] * c[:, None, :]
        dist2 = np.einsum("pjd,pjd->pj", d, d)
        w = np.where(valid, 1.0 / np.where(valid, dist2, 1.0), 0.0)
        e1, e2 = _tangent_basis(c)
        d2 = np.stack([np.einsum("pjd,pd->pj", d, e1), np.einsum("pjd,pd->pj", d, e2)], axis=-1)
        G = np.einsum("pj,pja,pjb->pab", w, d2, d2)
        coef2 = np.einsum("pab,pjb->pja", np.linalg.inv(G), w[..., None] * d2)
        self.lsq_coef = coef2[..., 0, None] * e1[:, None, :] + coef2[..., 1, None] * e2[:, None, :]
        del self.neighbours_raw

    # ---------------------------------------------------------------- helpers
    def integrate(self, f):
        """Surface integral Σ_p A f_p of cell averages f (npix,)."""
        return self.area * np.sum(f)

    def __repr__(self):
        return f"HealpixMesh(nside={self.nside}, npix={self.npix}, edge_quadrature={self.edge_quadrature})"


def _tangent_basis(x):
    """Orthonormal tangent vectors e1, e2 at unit vectors x (n, 3), smooth away from the axis used."""
    ref = np.where(np.abs(x[:, 2:3]) < 0.9, np.array([[0.0, 0.0, 1.0]]), np.array([[1.0, 0.0, 0.0]]))
    e1 = np.cross(ref, x)
    e1 /= np.linalg.norm(e1, axis=1, keepdims=True)
    e2 = np.cross(x, e1)
    return e1, e2
