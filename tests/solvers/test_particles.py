"""The particle solver against exact trajectories, exact carried densities and convergence orders."""

import math

import numpy as np
import numpy_reference as ref
import pytest
import scipy.linalg

from spherepde.analysis.exact import zero_temperature_density
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import ProjectedNormal, Uniform, VonMisesFisher
from spherepde.solvers.particles import (
    ParticleSolver,
    hardmax_field,
    quadrature_particles,
    tokens_from_law,
)

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def random_points(n, seed):
    x = np.random.default_rng(seed).normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_hardmax_kernel_matches_numpy():
    rng = np.random.default_rng(0)
    B, V = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    src, x = random_points(300, 1), random_points(100, 2)
    w = rng.random(300)
    w[::7] = 0.0  # zero-weight tokens never win
    v = np.empty((100, 3))
    hardmax_field(x, np.ascontiguousarray(B.T), src, w, V, v)
    np.testing.assert_allclose(v, ref.hardmax_field(x, B, src, w, V), atol=1e-14)


def exact_zero_temperature_path(model, x0, t):
    y = x0 @ scipy.linalg.expm(t * model.M).T
    return y / np.linalg.norm(y, axis=1, keepdims=True)


@pytest.mark.parametrize("scheme,order", [("euler", 1), ("rk4", 4)])
def test_zero_temperature_paths_and_carried_density(mesh_factory, scheme, order):
    """β = ∞, B orthogonal: X_t = e^{tM}x₀/|e^{tM}x₀| and f(X_t) = the exact push-forward density.
    Errors fall at the scheme's order when dt is halved."""
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    law = ProjectedNormal([0.2, 0.1, 0.0], np.diag([1.0, 0.7, 0.5]))
    x0, w, logf0 = quadrature_particles(mesh_factory(4), law)
    t = 0.8
    exact_x = exact_zero_temperature_path(model, x0, t)
    exact_f = zero_temperature_density(model, law, t)(exact_x)
    errors = []
    for dt in (0.04, 0.02):
        ds = ParticleSolver(model, scheme, dt, carry_density=True).run(x0, w, t, t, log_f0=logf0)
        ex = np.abs(ds.positions.values[-1] - exact_x).max()
        ef = np.abs(ds.particle_density.values[-1] / exact_f - 1).max()
        errors.append((ex, ef))
    for k in range(2):
        observed = math.log2(errors[0][k] / errors[1][k])
        assert abs(observed - order) < 0.35, (errors, observed)
    if scheme == "rk4":
        assert errors[1][0] < 1e-6 and errors[1][1] < 1e-5


def test_eigenvector_token_is_stationary():
    """A Dirac at an eigenvector of V does not move (docs/theory.md#formulas-and-exact-solutions), at any β and at β = ∞."""
    for beta in (3.0, math.inf):
        model = AttentionModel(PAPER_B, PAPER_V, beta)
        x0 = np.array([[0.0, 1.0, 0.0]])
        ds = ParticleSolver(model, "rk4", 0.1).run(x0, [1.0], 1.0, 0.5)
        np.testing.assert_allclose(ds.positions.values[-1], x0, atol=1e-15)


def test_token_schemes_converge_to_the_same_paths():
    """Finite-β tokens, random non-symmetric B and V: Euler (order 1) and RK4 (order 4) against a
    fine RK4 reference."""
    rng = np.random.default_rng(4)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), 5.0)
    x0, w = tokens_from_law(VonMisesFisher([0.3, 0.5, 0.8], 1.0), 40, seed=1)
    t = 0.3
    reference = ParticleSolver(model, "rk4", 0.3 / 256).run(x0, w, t, t).positions.values[-1]
    for scheme, order, dts in (("euler", 1, (0.3 / 32, 0.3 / 64)), ("rk4", 4, (0.3 / 8, 0.3 / 16))):
        err = [np.abs(ParticleSolver(model, scheme, dt).run(x0, w, t, t).positions.values[-1] - reference).max()
               for dt in dts]
        assert abs(math.log2(err[0] / err[1]) - order) < 0.5, (scheme, err)


def test_hardmax_tokens_are_the_large_beta_limit():
    """Hardmax tokens = softmax tokens at β = 1e6 when every argmax is separated by a margin δ with
    βδ ≫ 1 along the path (checked): the softmax weight off the argmax is ≤ n e^{−βδ}."""
    rng = np.random.default_rng(6)
    B, V = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    x0, w = random_points(12, 7), np.full(12, 1 / 12)
    hard = ParticleSolver(AttentionModel(B, V, math.inf), "euler", 0.01).run(x0, w, 0.1, 0.01)
    soft = ParticleSolver(AttentionModel(B, V, 1e6), "euler", 0.01).run(x0, w, 0.1, 0.01)
    for x in hard.positions.values:
        scores = np.sort((x @ B) @ x.T, axis=1)
        assert (scores[:, -1] - scores[:, -2]).min() > 1e-4  # β δ > 100
    np.testing.assert_allclose(hard.positions.values, soft.positions.values, atol=1e-12)


def test_norm_and_mass_preserved_and_uniform_tokens_concentrate():
    """Particles stay on the sphere; with the paper's matrices at β = 30 tokens move towards E = ±e₁."""
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    x0, w = tokens_from_law(Uniform(), 500, seed=3)
    ds = ParticleSolver(model, "euler", 0.05).run(x0, w, 2.0, 1.0)
    x = ds.positions.values
    np.testing.assert_allclose(np.linalg.norm(x, axis=-1), 1.0, atol=1e-14)
    align = (x[..., 0] ** 2).mean(axis=1)
    assert align[0] < 0.45 and align[-1] > 0.8


def test_bad_arguments():
    model = AttentionModel(PAPER_B, PAPER_V, 2.0)
    with pytest.raises(ValueError, match="scheme"):
        ParticleSolver(model, "leapfrog")
    with pytest.raises(ValueError, match="dt"):
        ParticleSolver(model, dt=0.0)
    with pytest.raises(ValueError, match="hardmax"):
        ParticleSolver(AttentionModel(PAPER_B, PAPER_V, math.inf), carry_density=True, hardmax=True)
    solver = ParticleSolver(model)
    with pytest.raises(ValueError, match="weights"):
        solver.run(random_points(5, 0), np.ones(4), 1.0, 0.5)
    with pytest.raises(ValueError, match="log_f0"):
        ParticleSolver(model, carry_density=True).run(random_points(5, 0), np.ones(5), 1.0, 0.5)
    with pytest.raises(ValueError, match="positive integer"):
        tokens_from_law(Uniform(), 0)


def test_same_trajectories_as_cbx():
    """The paper's update written with CBXpy (PolarCBO consensus = softmax mean) gives the same
    tokens as our numba Euler steps (spherepde/validation/benchmark_cbx.py; cbx is a test dependency)."""
    from spherepde.validation.benchmark_cbx import compare

    r = compare(300, steps=20)
    assert r["max_diff"] < 1e-10
