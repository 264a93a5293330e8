"""Diagnostics of weighted measures against closed forms and a second method (POT)."""

import math

import numpy as np
import ot
import pytest
from scipy.integrate import quad

from spherepde.analysis.diagnostics import (
    MeasureDiagnostics,
    alignment,
    lyapunov,
    lyapunov_cell_averages,
    projection_atoms,
    w2_binned,
    w2_parts_two_atoms,
    w2_to_two_atoms,
)
from spherepde.models.attention import AttentionModel

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def uniform_measure(mesh):
    pts, w = mesh.cell_quadrature(2)
    weights = np.broadcast_to(w * mesh.area / (4 * math.pi), pts.shape[:2]).ravel()
    return pts.reshape(-1, 3), weights


def random_measure(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True), rng.random(n)


def test_uniform_alignment_w2_and_lyapunov(mesh_factory):
    """Uniform law, paper matrices (E = span e₁, F = span e₂): alignments 1/3; W₂ to ½δ_{e₁} + ½δ_{−e₁}
    is 1 (E|x − sign(x₁)e₁|² = 2 − 2E|x₁| = 1); V_p = ∫₀¹ ((1 − u²)/u²)^p du (x₁ is uniform on [−1, 1])."""
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    x, w = uniform_measure(mesh_factory(16))
    d = MeasureDiagnostics(model, x, w, p=0.25)
    values = d(x, w)
    assert values["alignment_E"] == pytest.approx(1 / 3, abs=1e-7)
    assert values["alignment_F"] == pytest.approx(1 / 3, abs=1e-7)
    assert np.allclose(d.atom_masses, 0.5, atol=1e-12)
    assert values["w2_to_projection"] == pytest.approx(1.0, abs=2e-4)
    exact_vp = quad(lambda u: ((1 - u * u) / (u * u)) ** 0.25, 0, 1, limit=200)[0]
    # the point sum on a fixed cell rule converges like √h only (singular integrand on x₁ = 0)
    assert values["lyapunov"] == pytest.approx(exact_vp, rel=0.1)


@pytest.mark.parametrize("p", [0.1, 0.25, 0.45])
def test_lyapunov_cell_averages_singular_integrand(mesh_factory, p):
    """Uniform law: V_p = ∫₀¹ ((1 − u²)/u²)^p du (dim E = 1) and ∫₀¹ (z²/(1 − z²))^p dz for
    M = diag(1, 1, −1) (dim E = 2, point singularities at ±e₃); ∞ when p ≥ ½ (dim E = 1)."""
    m = mesh_factory(8)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    exact = quad(lambda u: ((1 - u * u) / (u * u)) ** p, 0, 1, limit=400)[0]
    assert lyapunov_cell_averages(m, model, p).mean() == pytest.approx(exact, rel=5e-5)
    model2 = AttentionModel(np.eye(3), np.diag([1.0, 1.0, -1.0]), 10.0)
    exact2 = quad(lambda z: (z * z / (1 - z * z)) ** p, 0, 1, limit=400)[0]
    # g ~ dist(x, E)^{2p} has a cusp on E ∩ S² (the equator here), left to the fixed rule
    assert lyapunov_cell_averages(m, model2, p).mean() == pytest.approx(exact2, rel=5e-4)
    if p == 0.45:
        assert np.isinf(lyapunov_cell_averages(m, model, 0.5)).any()


def test_theory_curve_decay_rate(mesh_factory):
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    x, w = uniform_measure(mesh_factory(8))
    d = MeasureDiagnostics(model, x, w, p=0.25)
    t = np.array([0.0, 1.0, 2.0])
    curve = d.theory_curves(t)["w2_bound_zero_temperature"][0]
    # γ = 1 − (−1) = 2, σ_max(B) = 1: rate pγ/σ = 0.5
    np.testing.assert_allclose(curve, math.sqrt(2 * d.lyapunov0) * np.exp(-0.5 * t), rtol=1e-14)
    assert "w2_bound_finite_beta" not in d.theory_curves(t, C0=1.0, C1=2.0)
    finite = MeasureDiagnostics(AttentionModel(PAPER_B, PAPER_V, 10.0), x, w)
    b = finite.theory_curves(t, C0=1.0, C1=2.0)["w2_bound_finite_beta"][0]
    np.testing.assert_allclose(b, 2 * math.sqrt(math.log(11) / 10) * (np.exp(2 * t) - np.exp(t)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_atom_w2_equals_linear_programme(seed):
    """The threshold plan equals the exact discrete OT (POT network simplex)."""
    x, w = random_measure(60, seed)
    e = np.array([0.6, 0.0, 0.8])
    p_plus = 0.3 + 0.1 * seed
    ours = w2_to_two_atoms(x, w, e, p_plus)
    atoms = np.array([e, -e])
    cost = ((x[:, None, :] - atoms[None, :, :]) ** 2).sum(-1)
    lp = math.sqrt(ot.emd2(w / w.sum(), np.array([p_plus, 1 - p_plus]), cost))
    assert ours == pytest.approx(lp, rel=1e-10)


def test_w2_across_is_the_cost_of_the_mass_that_crossed():
    """W₂ across: 0.1 of the mass sits at +e where Π#ρ₀ wants it at −e, so it pays |2e|² = 4 each,
    W₂² = 0.4, all of it across; a measure whose sides hold p± pays nothing across, and its W₂ is
    that of each side to its own atom (here 0.2 · |x − e|² with x = (0.6, 0.8, 0))."""
    e = np.array([1.0, 0.0, 0.0])
    w2, across = w2_parts_two_atoms(np.array([e, -e]), np.array([0.6, 0.4]), e, 0.5)
    assert w2 == pytest.approx(math.sqrt(0.4), rel=1e-14) and across == pytest.approx(math.sqrt(0.4), rel=1e-14)
    x = np.array([[0.6, 0.8, 0.0], [1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    w2, across = w2_parts_two_atoms(x, np.array([0.2, 0.3, 0.5]), e, 0.5)
    assert across == 0.0 and w2 == pytest.approx(math.sqrt(0.2 * 0.8), rel=1e-14)
    y, w = random_measure(80, 5)
    p_plus = float(w[y @ e > 0].sum() / w.sum()) - 0.01  # 1 % of the mass must cross to −e
    w2, across = w2_parts_two_atoms(y, w, e, p_plus)
    assert 2 * 0.01 <= across**2 <= 4 * 0.01 + 1e-12 and across < w2


def test_binned_w2_close_to_exact_ot():
    x, a = random_measure(300, 3)
    y, b = random_measure(300, 4)
    cost = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    exact = math.sqrt(ot.emd2(a / a.sum(), b / b.sum(), cost))
    for nside, tol in ((4, 0.6), (8, 0.3)):  # 2 × the largest bin diameter ≈ 2.4/nside
        assert abs(w2_binned(x, a, y, b, nside=nside) - exact) < tol
    assert w2_binned(x, a, x, a, nside=8) == pytest.approx(0.0, abs=1e-7)


def test_vmf_atom_masses(mesh_factory):
    """vMF about e₁: ρ₀{x₁ > 0} = 1/(1 + e^{−κ})."""
    from spherepde.models.initial import VonMisesFisher

    m = mesh_factory(16)
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    kappa = 1.5
    pts, qw = m.cell_quadrature(2)
    f = VonMisesFisher([1, 0, 0], kappa).density(pts.reshape(-1, 3))
    w = f * np.tile(qw * m.area, m.npix)
    atoms, masses = projection_atoms(model, pts.reshape(-1, 3), w)
    assert masses[0] == pytest.approx(1 / (1 + math.exp(-kappa)), abs=2e-3)
    np.testing.assert_allclose(np.abs(atoms[0]), [1, 0, 0], atol=1e-12)


def test_lyapunov_and_alignment_edge_cases():
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    on_E = np.array([[1.0, 0, 0], [-1.0, 0, 0]])
    assert lyapunov(model, on_E, [0.5, 0.5], 0.25) == 0.0
    assert alignment(on_E, [1, 1], model.E.basis) == pytest.approx(1.0)
    assert lyapunov(model, np.array([[0.0, 1.0, 0]]), [1.0], 0.25) == math.inf
    with pytest.raises(ValueError, match="mass"):
        alignment(on_E, [0.0, 0.0], model.E.basis)


def test_dim_E_above_one_uses_binned_ot():
    """M = I: E = R³, Π = identity, so W₂(ρ₀, Π#ρ₀) = 0 and V_p ≡ 0."""
    model = AttentionModel(np.eye(3), np.eye(3), 2.0)
    x, w = random_measure(500, 5)
    d = MeasureDiagnostics(model, x, w, w2_nside=8)
    assert "POT" in d.w2_method
    v = d(x, w)
    assert v["w2_to_projection"] == pytest.approx(0.0, abs=1e-7)
    assert v["lyapunov"] == 0.0
