"""Near-field correction: exact cell integrals of the kernel, and m_β uniform in β.

Independent references: the closed-form integrals of e^{⟨a, y − â⟩} over the whole sphere, a
uniform sub-square rule (numpy, spherepde.geometry.mesh) for single cells, the vMF closed form of m_β, and
the β = ∞ field as the limit of large β.
"""

import math

import numpy as np
import pytest

from spherepde.geometry.faces import FACE_LONGITUDE, FACE_RING
from spherepde.geometry.mesh import HealpixMesh
from spherepde.geometry.quadrature import pixel_rule
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import VonMisesFisher
from spherepde.summation import attention_field
from spherepde.summation.near_field import (
    GAUSS_ORDER,
    NearField,
    cell_kernel_integral,
    near_rings,
    tensor_rule,
)

RULE = pixel_rule(GAUSS_ORDER) + tensor_rule(GAUSS_ORDER)
JRLL, JPLL = FACE_RING.astype(float), FACE_LONGITUDE.astype(float)


def _cell_integral(mesh, cell, a):
    anorm = float(np.linalg.norm(a))
    out = np.zeros(10)
    cell_kernel_integral(int(mesh._face[cell]), mesh._ix[cell] / mesh.nside, mesh._iy[cell] / mesh.nside,
                         1.0 / mesh.nside, a, a / anorm, anorm, mesh.area, *RULE, JRLL, JPLL, out)
    return out


def _numpy_cell_integral(mesh, cell, a, split=32, order=8):
    """The same integral with a uniform split × split sub-square rule (plain numpy)."""
    ahat = a / np.linalg.norm(a)
    total = np.zeros(10)
    size = 1.0 / split
    for i in range(split):
        for j in range(split):
            pts, w = mesh.square_quadrature(np.array([cell]), i * size, j * size, size, order)
            d = pts[0] - ahat
            k = np.exp(d @ a) * w * mesh.area * size**2
            dd = d[:, [0, 0, 0, 1, 1, 2]] * d[:, [0, 1, 2, 1, 2, 2]]
            total += np.concatenate([[k.sum()], k @ d, k @ dd])
    return total


@pytest.mark.parametrize("anorm", [30.0, 400.0])
def test_cell_integrals_sum_to_the_sphere_closed_form(anorm):
    """Σ over all cells of ∫_cell e^{⟨a,y−â⟩}(1, y) dA = 2π(1 − e^{−2|a|})/|a| · (1, L(|a|)â),
    L the Langevin function coth s − 1/s: the exact integrals over S²."""
    mesh = HealpixMesh(4)
    rng = np.random.default_rng(3)
    ahat = rng.normal(size=3)
    ahat /= np.linalg.norm(ahat)
    a = anorm * ahat
    total = sum(_cell_integral(mesh, c, a) for c in range(mesh.npix))
    z = 2.0 * math.pi * (-math.expm1(-2.0 * anorm)) / anorm
    langevin = 1.0 / math.tanh(anorm) - 1.0 / anorm
    assert total[0] == pytest.approx(z, rel=1e-11)
    # Σ∫K d = Z (L â − â): the mean direction of the kernel
    np.testing.assert_allclose(total[1:4], z * (langevin - 1.0) * ahat, rtol=1e-9, atol=1e-13 * z)


def test_cell_integral_matches_uniform_subsquares():
    """The adaptive rule against a plain numpy rule of 32 × 32 sub-squares, for cells on the
    polar cap, the equator and across a pixel diagonal, kernel width ~ a third of a cell."""
    mesh = HealpixMesh(8)
    rng = np.random.default_rng(5)
    for cell in (0, 300, 383, 500, 767):
        y = mesh.centroids[cell] + 0.3 * math.sqrt(mesh.area) * rng.normal(size=3)
        a = 800.0 * y / np.linalg.norm(y)
        ours = _cell_integral(mesh, cell, a)
        ref = _numpy_cell_integral(mesh, cell, a)
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12 * abs(ref[0]))


def test_rings_only_where_the_kernel_is_narrower_than_a_cell():
    h = 0.1
    rings = near_rings(np.array([10.0, 99.0, 101.0, 1e3, 1e6]), h)
    assert rings.tolist() == [0, 0, 3, 1, 1]


def test_vmf_error_bounded_as_beta_grows():
    """Without the correction the error of m_β grows towards the cell size as β → ∞ (a hardmax
    over centres); with it, it stays at the small-β level (measured 3.8e-4 … 9.6e-4 at nside 16).
    spherepde.validation.near_field.errors: vMF closed form, random B and V."""
    from spherepde.validation.near_field import errors

    small_beta = errors(16, 10.0, ntargets=150)[1]
    for beta in (1e3, 1e4, 1e5):
        before, after, div_before, div_after, _ = errors(16, beta, ntargets=150)
        assert before > 5e-3
        assert after < 3.0 * small_beta
        assert after < before / 5
        assert div_after < 0.2 < div_before  # div v needs the covariance to O(1/β)


def test_large_beta_recovers_the_zero_temperature_field():
    """β = 10⁶ with the near field: v and div v approach the β = ∞ local field (before: div v off
    by ~10, the covariance of one dominant cell centre is 0)."""
    rng = np.random.default_rng(0)
    B, V = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    x = rng.normal(size=(100, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    mesh = HealpixMesh(16)
    mu = np.array([0.0, 0.6, 0.8])
    f = VonMisesFisher(mu, 4.0).cell_averages(mesh)
    v_inf, d_inf, _ = attention_field(AttentionModel(B, V, np.inf), None, None, x, want_div=True)
    v_inf, d_inf = v_inf.copy(), d_inf.copy()
    model = AttentionModel(B, V, 1e6)
    results = {}
    for near in (None, NearField(mesh, model, x)):
        v, d, _ = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True,
                                  method="direct", near=near)
        results[near is None] = (np.abs(v - v_inf).max(), np.abs(d - d_inf).max())
    assert np.isfinite(results[False]).all()
    assert results[False][0] < 1e-3 and results[False][1] < 0.2
    assert results[True][1] > 1.0  # the uncorrected divergence is wrong: the test can tell


@pytest.mark.parametrize("want_div", [False, True])
def test_tree_and_direct_apply_the_same_correction(want_div):
    rng = np.random.default_rng(2)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), 3000.0)
    mesh = HealpixMesh(16)
    f = VonMisesFisher(np.array([1.0, 0.0, 0.0]), 2.0).cell_averages(mesh)
    x = rng.normal(size=(200, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    near = NearField(mesh, model, x)
    assert near.active > 0
    out = {}
    for method in ("direct", "tree"):
        v, d, m = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=want_div,
                                  method=method, near=near)
        out[method] = (v.copy(), None if d is None else d.copy(), m.copy())
    np.testing.assert_allclose(out["tree"][2], out["direct"][2], atol=1e-10)
    if want_div:
        np.testing.assert_allclose(out["tree"][1], out["direct"][1], rtol=1e-8, atol=1e-8)


def test_near_field_for_other_targets_is_refused():
    mesh = HealpixMesh(8)
    model = AttentionModel(np.eye(3), np.eye(3), 1e4)
    x = mesh.centroids[:10]
    near = NearField(mesh, model, x)
    with pytest.raises(ValueError, match="other targets"):
        attention_field(model, mesh.centroids, np.full(mesh.npix, mesh.area), mesh.centroids[:5], near=near)


# ---------------------------------------------------------------- the log-linear profile (the tails)
def _numpy_profile_integral(mesh, cell, a, gamma, split=32, order=8):
    """∫_cell e^{⟨a, y − â⟩} e^{⟨γ, y − y_c⟩}/N_c (1, d, d dᵀ) dA by a uniform sub-square rule,
    N_c the cell average of e^{⟨γ, y − y_c⟩} by the same rule (plain numpy)."""
    ahat = a / np.linalg.norm(a)
    yc = mesh.centroids[cell]
    total, norm = np.zeros(10), 0.0
    size = 1.0 / split
    for i in range(split):
        for j in range(split):
            pts, w = mesh.square_quadrature(np.array([cell]), i * size, j * size, size, order)
            d = pts[0] - ahat
            profile = np.exp((pts[0] - yc) @ gamma) * w * size**2
            norm += profile.sum()
            k = np.exp(d @ a) * profile * mesh.area
            dd = d[:, [0, 0, 0, 1, 1, 2]] * d[:, [0, 1, 2, 1, 2, 2]]
            total += np.concatenate([[k.sum()], k @ d, k @ dd])
    return total / norm, math.log(norm)


def test_log_linear_profile_integral_matches_numpy():
    """The sloped cell integral (kernel of a + γ shifted to moments about â, scaled by N_c) and
    ln N_c against plain sub-square sums, on polar, equatorial and diagonal-crossing cells, for
    profiles spanning up to e^{±8} over a cell."""
    from spherepde.summation.near_field import _sloped_cell_integral, log_mean_exp_linear

    mesh = HealpixMesh(8)
    h = math.sqrt(mesh.area)
    rng = np.random.default_rng(11)
    for cell in (0, 300, 383, 500, 767):
        yc = mesh.centroids[cell]
        y = yc + 0.3 * h * rng.normal(size=3)
        a = 800.0 * y / np.linalg.norm(y)
        for spread in (0.5, 4.0, 16.0):
            gamma = rng.normal(size=3)
            gamma -= (gamma @ yc) * yc  # tangent at the centroid, as the slopes are
            gamma *= spread / (h * np.linalg.norm(gamma))
            ref, log_norm = _numpy_profile_integral(mesh, cell, a, gamma)
            args = (int(mesh._face[cell]), mesh._ix[cell] / mesh.nside, mesh._iy[cell] / mesh.nside, 1.0 / mesh.nside)
            assert log_mean_exp_linear(*args, gamma, yc, *RULE, JRLL, JPLL) == pytest.approx(log_norm, abs=1e-11)
            ours = np.zeros(10)
            _sloped_cell_integral(*args, a, a / 800.0, 800.0, gamma, yc, mesh.area, *RULE, JRLL, JPLL, ours)
            np.testing.assert_allclose(ours, ref, rtol=1e-8, atol=1e-11 * abs(ref[0]))


def _vmf_exact(x, beta, kappa, mu):
    """m_β and ln Z(x) = ln ∫ f e^{β⟨x, y⟩} dy for f the vMF(μ, κ) density and B = I: with
    c = βx + κμ, r = |c|: Z = κ sinh r/(r sinh κ), m_β = L(r) c/r (L the Langevin function)."""
    c = beta * x + kappa * mu
    r = np.linalg.norm(c, axis=1)
    log_z = (math.log(kappa) - kappa - math.log1p(-math.exp(-2.0 * kappa))
             + r + np.log1p(-np.exp(-2.0 * r)) - np.log(r))
    return (1.0 / np.tanh(r) - 1.0 / r)[:, None] * c / r[:, None], log_z


@pytest.mark.parametrize("beta", [1e3, 1e4])
def test_log_linear_profile_sees_a_steep_density(beta):
    """A density falling by 1.7 decades per cell (vMF, κ = 60, nside 16) seen by a kernel narrower
    than a cell, at targets 35°–135° from its mode: against the closed form, the log-linear profile
    (slopes of ln f from the cell averages) cuts the error of ln Z (the background's weight against
    the atoms) from ~1 to ≤ 0.03 and that of m_β by ≥ 5× (measured: ln Z 0.99 → 0.0031 median,
    m_β 7.5e-4 → 5.2e-5 at β = 1000)."""
    from spherepde.transport.semi_lagrangian import PolynomialInterpolant

    mesh = HealpixMesh(16)
    mu, kappa = np.array([0.0, 0.0, 1.0]), 60.0
    f = VonMisesFisher(mu, kappa).cell_averages(mesh)
    rng = np.random.default_rng(1)
    theta, phi = rng.uniform(0.6, 2.4, 150), rng.uniform(0.0, 2.0 * np.pi, 150)
    x = np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], axis=1)
    model = AttentionModel(np.eye(3), np.eye(3), beta)
    m_exact, log_z_exact = _vmf_exact(x, beta, kappa, mu)
    slopes = PolynomialInterpolant(mesh).slopes(np.log(f))
    err = {}
    for name, near in (("constant", NearField(mesh, model, x)), ("log_linear", NearField(mesh, model, x, slopes))):
        log_z = np.empty(len(x))
        _, _, m = attention_field(model, mesh.centroids, f * mesh.area, x, method="direct", near=near,
                                  log_partition=log_z)
        err[name] = (np.median(np.linalg.norm(m - m_exact, axis=1)), np.median(np.abs(log_z - log_z_exact)))
    assert err["constant"][1] > 0.1  # the constant profile is wrong: the test can tell
    assert err["log_linear"][1] < 0.03
    assert err["log_linear"][0] < err["constant"][0] / 5


def test_zero_slopes_are_the_constant_profile():
    """slopes = 0 everywhere gives the constant table bit for bit."""
    mesh = HealpixMesh(8)
    model = AttentionModel(np.eye(3), np.eye(3), 3000.0)
    x = mesh.centroids[::40]
    plain, zero = NearField(mesh, model, x), NearField(mesh, model, x, np.zeros((mesh.npix, 3)))
    assert plain.active > 0
    np.testing.assert_array_equal(plain.delta, zero.delta)
