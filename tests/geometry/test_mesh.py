"""HealpixMesh geometry: counts, orientation, quadrature exactness, and consistency checks that
do not rely on the construction (independent quadratures, both sides of every edge)."""

import healpy as hp
import numpy as np
import pytest

from spherepde import HealpixMesh
from spherepde.geometry.faces import face_to_sphere
from spherepde.geometry.mesh import EDGE_END, EDGE_START


@pytest.mark.parametrize("nside", [1, 2, 4, 8, 32])
def test_counts_and_unique_edges(mesh_factory, nside):
    m = mesh_factory(nside)
    assert m.npix == 12 * nside**2
    assert m.area == pytest.approx(4 * np.pi / m.npix, rel=1e-15)
    assert m.nedges == 2 * m.npix  # Euler: V − E + F = 2 with V = npix + 2
    p, q = m.edge_cells.T
    assert np.all(p < q)
    keys = p * m.npix + q
    assert np.unique(keys).size == m.nedges  # each shared edge exactly once
    # every cell has 4 edges; each edge appears in the incidence of exactly its two cells
    counts = np.bincount(m.cell_edges.ravel(), minlength=m.nedges)
    assert np.all(counts == 2)
    own = m.edge_cells[m.cell_edges, 0]
    assert np.array_equal(m.cell_edge_sign == 1.0, own == m.cell_ids[:, None])


def test_bad_nside():
    for bad in (0, 3, 12, -4, 2.0):
        with pytest.raises(ValueError, match="nside"):
            HealpixMesh(bad)


def test_face_map_reproduces_healpy_centres_and_corners():
    nside = 8
    ipix = np.arange(12 * nside**2)
    ix, iy, face = hp.pix2xyf(nside, ipix, nest=True)
    X = face_to_sphere(face, (ix + 0.5) / nside, (iy + 0.5) / nside)
    assert np.abs(X - np.stack(hp.pix2vec(nside, ipix, nest=True), -1)).max() < 1e-14
    corners = hp.boundaries(nside, ipix, step=1, nest=True)  # (npix, 3, 4): N, W, S, E
    local = {"N": (1, 1), "W": (0, 1), "S": (0, 0), "E": (1, 0)}
    for k, name in enumerate("NWSE"):
        a, b = local[name]
        C = face_to_sphere(face, (ix + a) / nside, (iy + b) / nside)
        assert np.abs(C - corners[:, :, k]).max() < 1e-14


def test_face_map_is_equal_area_and_derivatives_match_differences():
    rng = np.random.default_rng(1)
    for face in range(12):
        u, v = rng.random(50), rng.random(50)
        X, Xu, Xv = face_to_sphere(np.full(50, face), u, v, derivatives=True)
        jac = np.linalg.norm(np.cross(Xu, Xv), axis=1)
        np.testing.assert_allclose(jac, np.pi / 3, rtol=1e-12)  # face area 4π/12 on (u, v) ∈ [0,1]²
        h = 1e-6
        fd = (face_to_sphere(np.full(50, face), u + h, v) - face_to_sphere(np.full(50, face), u - h, v)) / (2 * h)
        np.testing.assert_allclose(Xu, fd, atol=1e-8)


def test_edge_points_normals_weights(mesh_factory):
    m = mesh_factory(8)
    x, n = m.edge_points, m.edge_normals
    np.testing.assert_allclose(np.linalg.norm(x, axis=-1), 1, atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(n, axis=-1), 1, atol=1e-14)
    assert np.abs(np.sum(x * n, axis=-1)).max() < 1e-14  # tangent to the sphere
    # normal ⊥ edge: compare with the chord between neighbouring sub-arc nodes
    chord = m.edge_nodes[:, 1:] - m.edge_nodes[:, :-1]
    cos = np.sum(chord * n, -1) / np.linalg.norm(chord, axis=-1)
    assert np.abs(cos).max() < 0.05  # sub-arcs are short, nearly straight
    # p → q: positive projection on the centroid difference (also checked at build time)
    p, q = m.edge_cells.T
    assert np.all(np.einsum("ekd,ed->ek", n, m.centroids[q] - m.centroids[p]) > 0)


def test_edge_lengths_match_dense_polyline(mesh_factory):
    """Arc-length weights sum to the length of the true curved edge (dense independent sampling)."""
    m = mesh_factory(4, 6)
    p = m.edge_cells[:, 0]
    ix, iy, face = hp.pix2xyf(m.nside, p, nest=True)
    # the p-side slot of every edge
    slot = np.argmax(m.cell_edges[p] == np.arange(m.nedges)[:, None], axis=1)
    s = np.linspace(0, 1, 20001)
    a0, a1 = EDGE_START[slot], EDGE_END[slot]
    loc = a0[:, None, :] + s[None, :, None] * (a1 - a0)[:, None, :]
    X = face_to_sphere(face[:, None], (ix[:, None] + loc[..., 0]) / m.nside, (iy[:, None] + loc[..., 1]) / m.nside)
    dense = np.linalg.norm(np.diff(X, axis=1), axis=-1).sum(1)
    np.testing.assert_allclose(m.edge_weights.sum(1), dense, rtol=2e-8)
    # end nodes are the pixel corners from healpy
    corners = hp.boundaries(m.nside, p, step=1, nest=True).transpose(0, 2, 1)
    d0 = np.min(np.linalg.norm(corners - m.edge_nodes[:, None, 0], axis=-1), axis=1)
    d1 = np.min(np.linalg.norm(corners - m.edge_nodes[:, None, -1], axis=-1), axis=1)
    assert max(d0.max(), d1.max()) < 1e-14


def test_edges_agree_seen_from_both_cells(mesh_factory):
    """The q side's own parametrisation of each edge gives the same curve (reversed) and flux."""
    m = mesh_factory(8)
    q = m.edge_cells[:, 1]
    slot_q = np.argmax(m.cell_edges[q] == np.arange(m.nedges)[:, None], axis=1)
    ix, iy, face = hp.pix2xyf(m.nside, q, nest=True)
    a0, a1 = EDGE_START[slot_q], EDGE_END[slot_q]
    start = face_to_sphere(face, (ix + a0[:, 0]) / m.nside, (iy + a0[:, 1]) / m.nside)
    end = face_to_sphere(face, (ix + a1[:, 0]) / m.nside, (iy + a1[:, 1]) / m.nside)
    # counter-clockwise around q is clockwise around p: q's start is p's end
    assert np.abs(start - m.edge_nodes[:, -1]).max() < 1e-14
    assert np.abs(end - m.edge_nodes[:, 0]).max() < 1e-14


@pytest.mark.parametrize("nside", [2, 16])
def test_divergence_theorem_with_independent_cell_integrals(mesh_factory, nside):
    """∮ P_x(a)·n ds = ∫ div_S P_x(a) dA = −2 a·∫x dA, the right side from the cell quadrature."""
    a = np.array([0.3, -0.7, 0.5])
    m = mesh_factory(nside, 6)
    flux = np.einsum("ekd,d,ek->e", m.edge_normals, a, m.edge_weights)
    div = np.einsum("cj,cj->c", m.cell_edge_sign, flux[m.cell_edges])
    pts, w = m.cell_quadrature(6)
    rhs = -2 * m.area * np.einsum("ckd,k,d->c", pts, w, a)
    assert np.abs(div - rhs).max() < 1e-9 * np.abs(flux).max()


def test_edge_quadrature_converges_near_poles(mesh_factory):
    """The default 2-point rule: relative flux error per edge small even at the pole pixels."""
    a = np.array([0.3, -0.7, 0.5])
    ref = mesh_factory(16, 8)
    m = mesh_factory(16, 2)
    f_ref = np.einsum("ekd,d,ek->e", ref.edge_normals, a, ref.edge_weights)
    f = np.einsum("ekd,d,ek->e", m.edge_normals, a, m.edge_weights)
    rel = np.abs(f - f_ref) / (ref.edge_weights.sum(1) * np.linalg.norm(a))
    assert rel.max() < 5e-4
    assert np.median(rel) < 1e-7


def test_cell_quadrature_exact_integrals(mesh_factory):
    m = mesh_factory(8)
    ones = m.cell_average(lambda x: np.ones(len(x)))
    np.testing.assert_allclose(ones, 1.0, rtol=1e-14)
    z2 = m.integrate(m.cell_average(lambda x: x[:, 2] ** 2))
    assert z2 == pytest.approx(4 * np.pi / 3, rel=1e-12)
    xyz = m.integrate(m.cell_average(lambda x: x[:, 0] ** 2 * x[:, 1] ** 2 * x[:, 2] ** 2, order=6))
    assert xyz == pytest.approx(4 * np.pi / 105, rel=1e-10)


def test_centroids_are_area_centroids(mesh_factory):
    m = mesh_factory(4)
    pts, w = m.cell_quadrature(10)
    c = np.einsum("ckd,k->cd", pts, w)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    assert np.abs(c - m.centroids).max() < 1e-9
    # pix2vec centres are not centroids (docs/theory.md#healpix-facts-for-finite-volumes): the offset is a visible fraction of a cell
    offset = np.linalg.norm(m.centers - m.centroids, axis=1).max() / np.sqrt(m.area)
    assert 0.01 < offset < 0.2


@pytest.mark.parametrize("nside", [8, 16, 32])
def test_least_squares_gradient_first_order_accurate(mesh_factory, nside):
    """For f = a·x the tangential gradient at the centroid is P_c a; error O(h)."""
    a = np.array([0.4, -1.0, 0.7])
    m = mesh_factory(nside)
    f = m.cell_average(lambda x: x @ a)
    g = np.einsum("cjd,cj->cd", m.lsq_coef, f[m.neighbours] - f[:, None])
    exact = a - (m.centroids @ a)[:, None] * m.centroids
    err = np.abs(g - exact).max()
    assert err < 1.5 * np.sqrt(m.area)


def test_missing_corner_neighbours_are_masked(mesh_factory):
    m = mesh_factory(4)
    raw = hp.get_all_neighbours(4, m.cell_ids, nest=True).T
    missing = raw < 0
    assert missing.sum() == 24 * 1 * 1  # 24 pixels with 7 neighbours at every nside ≥ 2
    assert np.all(m.neighbours[missing] == np.nonzero(missing)[0])
    assert np.all(m.lsq_coef[missing] == 0)
