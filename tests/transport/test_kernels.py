"""Every numba kernel of spherepde.transport equals its NumPy reference on random data."""

import numpy as np
import numpy_reference as ref
import pytest

from spherepde.transport import kernels


@pytest.fixture(scope="module")
def setup(mesh_factory):
    m = mesh_factory(8, 3)
    rng = np.random.default_rng(42)
    f = rng.random(m.npix) ** 3  # rough, with near-zero values
    f[rng.random(m.npix) < 0.1] = 0.0
    v = rng.normal(size=m.edge_points.shape)
    un = ref.edge_normal_flux(v, m.edge_normals, m.edge_weights)
    return m, rng, f, v, un


def test_edge_normal_flux(setup):
    m, rng, f, v, un = setup
    out = np.empty_like(un)
    kernels.edge_normal_flux(v, m.edge_normals, m.edge_weights, out)
    np.testing.assert_allclose(out, un, rtol=1e-13, atol=1e-16)


def test_cell_flow_rates(setup):
    m, rng, f, v, un = setup
    outflow, div = np.empty(m.npix), np.empty(m.npix)
    kernels.cell_flow_rates(un, m.cell_edges, m.cell_edge_sign, 1 / m.area, outflow, div)
    o_ref, d_ref = ref.cell_flow_rates(un, m.cell_edges, m.cell_edge_sign, 1 / m.area)
    np.testing.assert_allclose(outflow, o_ref, rtol=1e-12)
    np.testing.assert_allclose(div, d_ref, rtol=1e-12, atol=1e-12 * np.abs(d_ref).max())


@pytest.mark.parametrize("bounded_fraction", [0.0, 0.5, 1.0])
def test_limited_gradients(setup, bounded_fraction):
    m, rng, f, v, un = setup
    bounded = rng.random(m.npix) < bounded_fraction
    grad = np.empty((m.npix, 3))
    kernels.limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points,
                              m.centroids, bounded, grad)
    expect = ref.limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points,
                                   m.centroids, bounded)
    np.testing.assert_allclose(grad, expect, rtol=1e-12, atol=1e-14)
    # the limiter's promise: every edge value in [0, 2 f_c], and in the local range if bounded
    disp = m.edge_points[m.cell_edges] - m.centroids[:, None, None, :]
    values = f[:, None] + np.einsum("cjkd,cd->cjk", disp, grad).reshape(m.npix, -1)
    assert values.min() >= -1e-15
    assert np.all(values <= 2 * f[:, None] + 1e-15)
    fmax = np.maximum(f[m.neighbours].max(1), f)
    assert np.all(values[bounded] <= fmax[bounded, None] + 1e-14)


def test_upwind_and_muscl_edge_fluxes(setup):
    m, rng, f, v, un = setup
    flux = np.empty(m.nedges)
    kernels.upwind_edge_fluxes(f, un, m.edge_cells, flux)
    np.testing.assert_allclose(flux, ref.upwind_edge_fluxes(f, un, m.edge_cells), rtol=1e-13, atol=1e-16)
    grad = rng.normal(size=(m.npix, 3))
    kernels.muscl_edge_fluxes(f, grad, un, m.edge_cells, m.edge_points, m.centroids, flux)
    expect = ref.muscl_edge_fluxes(f, grad, un, m.edge_cells, m.edge_points, m.centroids)
    np.testing.assert_allclose(flux, expect, rtol=1e-12, atol=1e-14)


def test_flux_divergence(setup):
    m, rng, f, v, un = setup
    flux = rng.normal(size=m.nedges)
    out = np.empty(m.npix)
    kernels.flux_divergence(flux, m.cell_edges, m.cell_edge_sign, 1 / m.area, out)
    np.testing.assert_allclose(out, ref.flux_divergence(flux, m.edge_cells, 1 / m.area, m.npix),
                               rtol=1e-12, atol=1e-12)
    assert abs(out.sum()) < 1e-12 * np.abs(out).sum()  # each flux enters twice with opposite signs


@pytest.mark.parametrize("bounded_fraction", [0.0, 1.0])
def test_log_limited_gradients_and_fluxes(setup, bounded_fraction):
    """The reconstruction in log f: kernel against the NumPy reference; its promises: the cell
    average of the reconstruction is f_c, every edge value ≤ e^{log_ratio} f_c, within the local
    range of log f where bounded, and positive."""
    m, rng, f, v, un = setup
    bounded = rng.random(m.npix) < bounded_fraction
    qpoints, qweights = m.cell_quadrature(2)
    log_ratio = np.log(2.0)
    grad, shift = np.empty((m.npix, 3)), np.empty(m.npix)
    kernels.log_limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points, m.centroids, qpoints,
                                  qweights, bounded, log_ratio, grad, shift)
    g_ref, s_ref = ref.log_limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points, m.centroids,
                                             qpoints, qweights, bounded, log_ratio)
    np.testing.assert_allclose(grad, g_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(shift, s_ref, rtol=1e-12, atol=1e-12)
    positive = f > 0
    average = np.exp(shift[positive, None] + np.einsum("cqd,cd->cq", qpoints[positive] - m.centroids[positive, None],
                                                      grad[positive])) @ qweights
    np.testing.assert_allclose(average, f[positive], rtol=1e-12)
    disp = m.edge_points[m.cell_edges] - m.centroids[:, None, None, :]
    values = np.exp(shift[:, None] + np.einsum("cjkd,cd->cjk", disp, grad).reshape(m.npix, -1))[positive]
    assert np.all(values > 0) and np.all(values <= 2 * f[positive, None] * (1 + 1e-12))
    flux = np.empty(m.nedges)
    kernels.log_muscl_edge_fluxes(f, grad, shift, un, m.edge_cells, m.edge_points, m.centroids, flux)
    np.testing.assert_allclose(flux, ref.log_muscl_edge_fluxes(f, grad, shift, un, m.edge_cells, m.edge_points,
                                                               m.centroids), rtol=1e-12, atol=1e-14)


def test_log_reconstruction_is_second_order_relative_to_an_exponential(mesh_factory):
    """Cell averages of f = e^{a·x} with |a| = 40 (a factor e^{±2.5} across an nside-16 cell): the
    edge values reconstructed in log f are within O(h²) of f relative to f, those reconstructed in
    f are off by a factor (the same cells, no limiter: bounded nowhere, edge ratio unbounded)."""
    a = 40.0 * np.array([0.6, 0.0, 0.8])
    errors = {}
    for nside in (16, 32):
        m = mesh_factory(nside)
        f = m.cell_average(lambda x: np.exp(x @ a - 40.0), order=6)
        exact = np.exp(m.edge_points @ a - 40.0)  # (nedges, nq)
        qpoints, qweights = m.cell_quadrature(2)
        grad, shift = np.empty((m.npix, 3)), np.empty(m.npix)
        kernels.log_limited_gradients(f, m.neighbours, m.lsq_coef, m.cell_edges, m.edge_points, m.centroids,
                                      qpoints, qweights, np.zeros(m.npix, dtype=np.bool_), 50.0, grad, shift)
        c = m.edge_cells[:, 0]
        disp = m.edge_points - m.centroids[c][:, None, :]
        log_values = np.exp(shift[c][:, None] + np.einsum("ekd,ed->ek", disp, grad[c]))
        lin_grad = np.einsum("cjd,cj->cd", m.lsq_coef, f[m.neighbours] - f[:, None])
        lin_values = f[c][:, None] + np.einsum("ekd,ed->ek", disp, lin_grad[c])
        tail = exact < 1e-3 * exact.max()
        errors[nside] = (np.median(np.abs(log_values / exact - 1)[tail]), np.median(np.abs(lin_values / exact - 1)[tail]))
    assert errors[32][0] < 0.02 and errors[16][0] / errors[32][0] > 3.0, errors  # second order, small
    assert errors[16][1] > 5 * errors[16][0], errors  # the reconstruction in f is much worse there
