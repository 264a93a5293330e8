"""The Eulerian mean-field solver against exact solutions and conservation laws."""

import math

import numpy as np
import pytest
from scipy.special import eval_legendre

from spherepde.analysis.exact import linear_growth_rate, zero_temperature_density
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import ProjectedNormal, Uniform, VonMisesFisher
from spherepde.solvers.eulerian import EulerianSolver

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def l1_error(mesh, f, exact):
    return mesh.area * np.abs(f - exact).sum()


def test_zero_temperature_exact_density_second_order(mesh_factory):
    """β = ∞, uniform start: the angular central Gaussian; MUSCL converges at order ≈ 2 at t = 0.5."""
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    law = Uniform()
    err = {}
    for nside in (8, 16, 32):
        m = mesh_factory(nside)
        ds = EulerianSolver(m, model).run(law.cell_averages(m), 0.5, 0.5)
        exact = m.cell_average(zero_temperature_density(model, law, 0.5))
        err[nside] = l1_error(m, ds.density.values[-1], exact)
    assert math.log2(err[16] / err[32]) > 1.5, err
    assert err[32] < 1e-3


def test_zero_temperature_density_is_a_probability_density(mesh_factory):
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    m = mesh_factory(32)
    for t in (0.5, 1.0):
        f = m.cell_average(zero_temperature_density(model, VonMisesFisher([1, 1, 1], 2.0), t), order=6)
        assert m.integrate(f) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("scheme", ["upwind", "muscl"])
def test_mass_positivity_and_lower_bound(mesh_factory, scheme):
    """Finite β, non-symmetric matrices: mass to round-off, f ≥ 0, and min f_t above the
    a-posteriori bound ℓ₀ exp(−∫ sup div v) up to the discretisation error."""
    rng = np.random.default_rng(3)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), 8.0)
    m = mesh_factory(8)
    f0 = ProjectedNormal([0.5, 0.0, 0.2], np.diag([1.0, 0.5, 2.0])).cell_averages(m)
    ds = EulerianSolver(m, model, scheme=scheme).run(f0, 1.0, 0.25)
    assert np.abs(ds.mass.values - 1.0).max() < 1e-13
    assert ds.density.values.min() >= 0
    assert np.all(ds.min_density.values >= 0.9 * ds.lower_bound_aposteriori.values)
    assert ds.attrs["ell0"] == pytest.approx(f0.min())
    np.testing.assert_allclose(ds.lower_bound_paper.values,
                               0.5 * f0.min() * np.exp(-ds.attrs["C0"] * ds.time.values))


def test_reflection_symmetry_diagonal_matrices(mesh_factory):
    """Diagonal B, V and data symmetric under z → −z: the solution stays symmetric (HEALPix NESTED
    is symmetric under z → −z up to a permutation of cells)."""
    import healpy as hp

    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    m = mesh_factory(8)
    law = ProjectedNormal([0.0, 0.0, 0.0], np.diag([1.0, 0.6, 0.3]))
    ds = EulerianSolver(m, model).run(law.cell_averages(m), 0.5, 0.5)
    x = m.centers * np.array([1, 1, -1])
    mirror = hp.vec2pix(m.nside, *x.T, nest=True)
    f = ds.density.values[-1]
    assert np.abs(f - f[mirror]).max() < 1e-12 * f.max()


def test_linear_growth_rates_uniform_state(mesh_factory):
    """V = B = I, uniform plus ε P_ℓ: growth rate ℓ(ℓ+1) i_ℓ(β)/(β i₀(β)) (docs/theory.md#formulas-and-exact-solutions).
    The run from the exact uniform state is subtracted (linearisation about the discrete
    steady state)."""
    beta = 6.0
    model = AttentionModel(np.eye(3), np.eye(3), beta)
    m = mesh_factory(8)
    axis = np.array([0.3, 0.4, 0.866])
    axis /= np.linalg.norm(axis)
    solver = EulerianSolver(m, model)
    base = solver.run(np.full(m.npix, 1 / (4 * math.pi)), 0.3, 0.05).density.values
    for ell in (1, 2, 3):
        f0 = m.cell_average(lambda x: (1 + 1e-4 * eval_legendre(ell, x @ axis)) / (4 * math.pi))
        P = m.cell_average(lambda x: eval_legendre(ell, x @ axis))
        ds = solver.run(f0, 0.3, 0.05)
        amp = (ds.density.values - base) @ P
        rate = np.polyfit(ds.time.values, np.log(np.abs(amp)), 1)[0]
        assert rate == pytest.approx(linear_growth_rate(beta, ell), rel=0.03)


def test_bad_run_arguments(mesh_factory):
    m = mesh_factory(2)
    solver = EulerianSolver(m, AttentionModel(np.eye(3), np.eye(3), 1.0))
    f0 = np.full(m.npix, 1 / (4 * math.pi))
    with pytest.raises(ValueError, match="t_end"):
        solver.run(f0, 0.0, 0.1)
    with pytest.raises(ValueError, match="save_every"):
        solver.run(f0, 1.0, 2.0)
    with pytest.raises(ValueError, match="f0"):
        solver.run(f0[:-1], 1.0, 0.5)


def test_step_counts_are_per_run(mesh_factory):
    """A solver reused for a second run reports that run's steps, identical to the first."""
    m = mesh_factory(4)
    solver = EulerianSolver(m, AttentionModel(PAPER_B, PAPER_V, 5.0))
    f0 = VonMisesFisher([0, 0, 1], 2.0).cell_averages(m)
    first = solver.run(f0, 0.5, 0.25)
    second = solver.run(f0, 0.5, 0.25)
    assert first.steps.values[0] == second.steps.values[0] == 0
    np.testing.assert_array_equal(first.steps.values, second.steps.values)
    assert first.steps.values[-1] > 0
    # round-off, not bitwise: vectorised reductions depend on memory alignment
    np.testing.assert_allclose(first.density.values, second.density.values, rtol=1e-12, atol=0)
