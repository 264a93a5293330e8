"""The attention field: closed forms, finite differences, a NumPy reference, extreme β."""

import math

import numpy as np
import pytest
from numpy_reference import random_points, reference_field

from spherepde.models.attention import AttentionModel
from spherepde.summation import attention_field


@pytest.mark.parametrize("beta", [1e-3, 0.7, 12.0, 300.0])
def test_matches_numpy_reference(beta):
    rng = np.random.default_rng(5)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    src = random_points(400, 1)
    mass = rng.random(400)
    x = random_points(50, 2)
    v, div, m = attention_field(model, src, mass, x, want_div=True)
    rv, rdiv, rm = reference_field(model, src, mass, x)
    np.testing.assert_allclose(m, rm, atol=1e-13)
    np.testing.assert_allclose(v, rv, atol=1e-12)
    np.testing.assert_allclose(div, rdiv, atol=1e-10 * max(1.0, beta))


def tangent_fd_divergence(model, src, mass, x, h=1e-5):
    e1 = np.cross(x, [0.3, 0.5, 0.8])
    e1 /= np.linalg.norm(e1, axis=1, keepdims=True)
    e2 = np.cross(x, e1)
    div = np.zeros(len(x))
    for e in (e1, e2):
        vp = attention_field(model, src, mass, np.cos(h) * x + np.sin(h) * e)[0]
        vm = attention_field(model, src, mass, np.cos(h) * x - np.sin(h) * e)[0]
        div += np.sum(e * (vp - vm), axis=1) / (2 * h)
    return div


@pytest.mark.parametrize("beta", [0.5, 8.0, math.inf])
def test_divergence_against_finite_differences(beta):
    rng = np.random.default_rng(7)
    model = AttentionModel(rng.normal(size=(3, 3)) + 2 * np.eye(3), rng.normal(size=(3, 3)), beta)
    src, mass = random_points(300, 3), rng.random(300)
    x = random_points(20, 4)
    _, div, _ = attention_field(model, src, mass, x, want_div=True)
    np.testing.assert_allclose(div, tangent_fd_divergence(model, src, mass, x), atol=1e-7 * max(1, np.abs(div).max()))


def test_linear_field_divergence_formula():
    """div_S P_x(Ax) = tr A − 3xᵀAx (docs/theory.md#formulas-and-exact-solutions): the β = ∞ field with B = I."""
    rng = np.random.default_rng(8)
    V = rng.normal(size=(3, 3))
    model = AttentionModel(np.eye(3), V, math.inf)
    x = random_points(30, 9)
    v, div, _ = attention_field(model, None, None, x, want_div=True)
    np.testing.assert_allclose(div, np.trace(V) - 3 * np.einsum("ti,ij,tj->t", x, V, x), atol=1e-13)
    np.testing.assert_allclose(v, x @ V.T - np.einsum("ti,ij,tj->t", x, V, x)[:, None] * x, atol=1e-14)


def A3(k):
    return 1 / np.tanh(k) - 1 / k


def test_vmf_closed_form_second_order(mesh_factory):
    """m_β = A₃(|w|) w/|w|, w = βBᵀx + κμ, for a vMF density given by cell averages: the centroid
    sum is a second-order quadrature."""
    from spherepde.models.initial import VonMisesFisher

    rng = np.random.default_rng(11)
    B, V = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    beta, law = 4.0, VonMisesFisher([1.0, 2.0, -1.0], 6.0)
    model = AttentionModel(B, V, beta)
    x = random_points(100, 12)
    w = beta * x @ B + law.kappa * law.mu
    nw = np.linalg.norm(w, axis=1, keepdims=True)
    exact = A3(nw) * w / nw
    err = {}
    for nside in (8, 16, 32):
        m = mesh_factory(nside)
        f = law.cell_averages(m)
        err[nside] = np.abs(attention_field(model, m.centroids, f * m.area, x)[2] - exact).max()
    assert 1.7 < math.log2(err[16] / err[32]) < 2.3, err
    assert err[32] < 1e-3


@pytest.mark.parametrize("beta", [1e-3, 1e6])
def test_extreme_beta_finite(beta):
    rng = np.random.default_rng(13)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    src = random_points(500, 14)
    mass = rng.random(500) * 1e-200  # tiny masses: the shift includes log μ
    mass[::3] = 0.0  # empty cells
    v, div, m = attention_field(model, src, mass, random_points(40, 15), want_div=True)
    assert np.all(np.isfinite(v)) and np.all(np.isfinite(div)) and np.all(np.isfinite(m))
    assert np.all(np.linalg.norm(m, axis=1) <= 1 + 1e-12)


def test_large_beta_tends_to_argmax():
    model = AttentionModel(np.eye(3), np.eye(3), 1e6)
    src = random_points(200, 16)
    x = random_points(10, 17)
    m = attention_field(model, src, np.ones(200), x)[2]
    np.testing.assert_allclose(m, src[np.argmax(x @ src.T, axis=1)], atol=1e-9)


def test_no_mass_is_an_error():
    model = AttentionModel(np.eye(3), np.eye(3), 1.0)
    with pytest.raises(ValueError, match="no positive mass"):
        attention_field(model, random_points(5, 0), np.zeros(5), random_points(2, 1))


@pytest.mark.parametrize("method", ["direct", "tree", "harmonic", "auto"])
def test_no_targets_give_empty_fields(method):
    """A solver may ask for the field at no points (e.g. a subset that came out empty)."""
    model = AttentionModel(np.eye(3), np.eye(3), 30.0)
    src = random_points(300, 3)
    v, d, m = attention_field(model, src, np.ones(300), np.empty((0, 3)), want_div=True, method=method)
    assert v.shape == (0, 3) and d.shape == (0,) and m.shape == (0, 3)


@pytest.mark.parametrize("method", ["direct", "tree", "harmonic"])
def test_prepared_sources_give_the_same_sums_to_the_bit(method):
    """PreparedSources: the source arrays (and the tree) built once serve every later call with
    other targets, and each call's field, divergence, mean and log Z are those of the call that
    builds them itself, bit for bit; the tree is built once."""
    from spherepde.summation import PreparedSources

    beta = 6.0 if method == "harmonic" else 300.0
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), beta)
    src = random_points(4000, 21)
    masses = np.exp(-20.0 * (1.0 - src[:, 2]))  # decades of mass, as in the tails
    prepared = PreparedSources(src, masses)
    for seed in (22, 23):
        x = random_points(40, seed)
        own_logz, prepared_logz = np.empty(40), np.empty(40)
        own = attention_field(model, src, masses, x, want_div=True, method=method, log_partition=own_logz)
        again = attention_field(model, prepared.sources, prepared.masses, x, want_div=True, method=method,
                                log_partition=prepared_logz, prepared=prepared)
        for a, b in zip(own, again):
            assert np.array_equal(a, b)
        assert np.array_equal(own_logz, prepared_logz)
    if method == "tree":
        assert prepared.tree() is prepared.tree()
    with pytest.raises(ValueError, match="prepared was built for other sources"):
        attention_field(model, src.copy(), masses, x, prepared=prepared)
