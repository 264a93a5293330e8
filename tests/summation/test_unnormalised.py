"""Unnormalised attention (issue 20 item 2): v(x) = P_x(V ∫ e^{β⟨x, By⟩} y dρ(y)) · e^{−c}.

Independent references: the definition summed in long double (tests/numpy_reference.
unnormalised_field: n and the second moment S directly, div = β tr(P_x V S Bᵀ) − 2⟨x, V n⟩),
finite differences of the field along great circles, the vMF closed form ∫ e^{⟨a, y⟩} y dρ =
Z A₃(|w|) w/|w|, Z = (sinh|w|/|w|)/(sinh κ/κ), w = a + κμ (docs/theory.md#formulas-and-exact-solutions), the Funk–Hecke growth
rates ℓ(ℓ+1) i_ℓ(β)/β about the uniform state, and, for B = V symmetric, the interaction energy
½∬e^{β⟨x, By⟩}dρdρ, which the dynamics ascends (a Lyapunov functional of the run).
"""

import math

import numpy as np
import numpy_reference as ref
import pytest

from spherepde.analysis.exact import langevin
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import VonMisesFisher
from spherepde.runner.config import ConfigError, resolve
from spherepde.summation import attention_field
from spherepde.summation.harmonic import sphere_quadrature


def _unit(rng, n):
    x = rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _model(beta, scale="none", seed=0, B=None, V=None):
    rng = np.random.default_rng(seed)
    B = rng.normal(size=(3, 3)) if B is None else B
    V = rng.normal(size=(3, 3)) if V is None else V
    return AttentionModel(B, V, beta, normalisation="unnormalised", unnormalised_scale=scale)


@pytest.mark.parametrize("method", ["direct", "tree", "harmonic"])
@pytest.mark.parametrize("beta,scale", [(0.5, "none"), (6.0, "none"), (6.0, "exp_beta"), (100.0, "none"),
                                        (1000.0, "exp_beta")])
def test_field_and_divergence_against_the_definition(method, beta, scale):
    rng = np.random.default_rng(1)
    model = _model(beta, scale)
    y = _unit(rng, 3500)
    x = _unit(rng, 40)
    mu = rng.random(len(y)) / len(y)
    mu[::9] *= 1e-250  # many decades
    v_ref, div_ref = ref.unnormalised_field(x, model.B, model.V, beta, y, mu, model.log_field_scale)
    assert np.isfinite(v_ref).all() and np.abs(v_ref).max() > 0
    v, div, _ = attention_field(model, y, mu, x, want_div=True, method=method)
    tol = 1e-9 if method == "direct" else 1e-8  # tree and harmonic: relative tol 1e-10 of Z
    np.testing.assert_allclose(v, v_ref, rtol=0, atol=tol * np.abs(v_ref).max())
    np.testing.assert_allclose(div, div_ref, rtol=0, atol=tol * np.abs(div_ref).max())


def test_exp_beta_scale_divides_by_e_beta_norm_b():
    rng = np.random.default_rng(2)
    B, V = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    y, x, mu = _unit(rng, 300), _unit(rng, 20), rng.random(300)
    plain = [o.copy() for o in attention_field(_model(3.0, "none", B=B, V=V), y, mu, x, want_div=True)[:2]]
    scaled = attention_field(_model(3.0, "exp_beta", B=B, V=V), y, mu, x, want_div=True)[:2]
    factor = math.exp(-3.0 * np.linalg.norm(B, 2))
    for p, s in zip(plain, scaled):
        np.testing.assert_allclose(s, p * factor, rtol=1e-13, atol=0)


@pytest.mark.parametrize("beta,scale", [(0.5, "none"), (8.0, "none"), (400.0, "exp_beta")])
def test_divergence_against_finite_differences(beta, scale):
    rng = np.random.default_rng(3)
    model = _model(beta, scale, seed=4, B=None)
    y = _unit(rng, 300)
    mu = rng.random(300)
    x = _unit(rng, 20)
    h = 1e-5 if beta < 100 else 1e-6
    _, div, _ = attention_field(model, y, mu, x, want_div=True, method="direct")
    e1 = np.cross(x, [0.3, 0.5, 0.8])
    e1 /= np.linalg.norm(e1, axis=1, keepdims=True)
    e2 = np.cross(x, e1)
    fd = np.zeros(len(x))
    for e in (e1, e2):
        vp = attention_field(model, y, mu, np.cos(h) * x + np.sin(h) * e, method="direct")[0].copy()
        vm = attention_field(model, y, mu, np.cos(h) * x - np.sin(h) * e, method="direct")[0]
        fd += np.sum(e * (vp - vm), axis=1) / (2 * h)
    np.testing.assert_allclose(div, fd, rtol=0, atol=1e-6 * np.abs(div).max())


@pytest.mark.parametrize("method", ["direct", "tree", "harmonic"])
@pytest.mark.parametrize("beta,kappa,scale", [(1.0, 2.0, "none"), (6.0, 5.0, "none"), (20.0, 10.0, "exp_beta")])
def test_vmf_closed_form(method, beta, kappa, scale):
    """f = vMF(μ, κ): ∫ e^{β⟨Bᵀx, y⟩} y f dA = Z A₃(|w|) w/|w|, w = βBᵀx + κμ, on a product
    Gauss rule; v = P_x(V·that)·e^{−c}."""
    rng = np.random.default_rng(5)
    B = rng.normal(size=(3, 3)) / 2.0
    V = rng.normal(size=(3, 3))
    model = AttentionModel(B, V, beta, normalisation="unnormalised", unnormalised_scale=scale)
    law = VonMisesFisher(np.array([0.3, -0.4, 0.866]), kappa)
    y, w = sphere_quadrature(90)
    x = _unit(rng, 60)
    wv = beta * x @ B + kappa * law.mu
    ww = np.linalg.norm(wv, axis=1)
    log_z = ww + np.log(-np.expm1(-2 * ww) / (2 * ww)) - (kappa + math.log(-math.expm1(-2 * kappa) / (2 * kappa)))
    n = (np.exp(log_z - model.log_field_scale) * langevin(ww) / ww)[:, None] * wv
    u = n @ V.T
    want = u - np.sum(u * x, axis=1, keepdims=True) * x
    v, _, _ = attention_field(model, y, law.density(y) * w, x, method=method, tol=1e-12)
    np.testing.assert_allclose(v, want, rtol=0, atol=1e-10 * np.abs(want).max())


def test_beta_inf_and_bad_settings_are_refused():
    with pytest.raises(ValueError, match="no beta = inf limit"):
        AttentionModel(np.eye(3), np.eye(3), math.inf, normalisation="unnormalised")
    with pytest.raises(ValueError, match="exp_beta"):
        AttentionModel(np.eye(3), np.eye(3), 1000.0, normalisation="unnormalised")
    AttentionModel(np.eye(3), np.eye(3), 1000.0, normalisation="unnormalised", unnormalised_scale="exp_beta")
    with pytest.raises(ValueError, match="normalisation"):
        AttentionModel(np.eye(3), np.eye(3), 1.0, normalisation="l1")


BASE = {"model": {"beta": 5.0, "B": "identity", "V": "identity"}, "time": {"t_end": 0.1, "save_every": 0.1}}


def _config(**model):
    cfg = {k: dict(v) for k, v in BASE.items()}
    cfg["model"].update(model)
    return cfg


@pytest.mark.parametrize("model,words", [
    ({"normalisation": "none"}, ["[model] normalisation", "softmax"]),
    ({"normalisation": "unnormalised", "unnormalised_scale": "e"}, ["[model] unnormalised_scale", "exp_beta"]),
    ({"normalisation": "unnormalised", "beta": "inf"}, ["[model] beta", "unnormalised", "inf"]),
    ({"normalisation": "unnormalised", "beta": 1000.0}, ["[model] unnormalised_scale", "overflows", "exp_beta"]),
])
def test_config_errors_name_the_key(model, words):
    with pytest.raises(ConfigError) as err:
        resolve(_config(**model))
    text = str(err.value)
    assert "\n" not in text
    for w in words:
        assert w in text, (w, text)


def test_config_defaults_and_record():
    r = resolve(_config())
    assert r["model"]["normalisation"] == "softmax" and r["model"]["unnormalised_scale"] == "none"
    r = resolve(_config(normalisation="unnormalised", unnormalised_scale="exp_beta", beta=1000.0))
    assert r["model"]["normalisation"] == "unnormalised"


# ------------------------------------------------------------------ solvers
from spherepde.validation.unnormalised import (
    energy_history,
    growth_rates,
    interaction_energy,
    unnormalised_growth_rate,
)  # noqa: E402


@pytest.mark.parametrize("beta", [1.0, 6.0])
def test_linear_growth_rates_nside_8(mesh_factory, beta):
    """Uniform + 10⁻⁸ P_ℓ, V = B = I: rate ℓ(ℓ+1) i_ℓ(β)/β (Funk–Hecke; measured at nside 8
    −0.13 … −0.93 % for ℓ ≤ 3, second order: nside 16 −0.03 … −0.24 %)."""
    rates = growth_rates(mesh_factory(8), beta, (1, 2, 3))
    for ell, rate in rates.items():
        assert rate == pytest.approx(unnormalised_growth_rate(beta, ell), rel=0.015)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [1.0, 6.0])
def test_linear_growth_rates_nside_32(mesh_factory, beta):
    rates = growth_rates(mesh_factory(32), beta, tuple(range(1, 7)))
    for ell, rate in rates.items():
        assert rate == pytest.approx(unnormalised_growth_rate(beta, ell), rel=0.01)


def test_growth_rate_with_the_exp_beta_scale(mesh_factory):
    """exp_beta divides the field, hence the rates, by e^{β‖B‖₂} = e^β here."""
    rates = growth_rates(mesh_factory(4), 3.0, (2,), scale="exp_beta")
    plain = growth_rates(mesh_factory(4), 3.0, (2,))
    assert rates[2] == pytest.approx(plain[2], rel=1e-6)


@pytest.mark.parametrize("kind", ["eulerian", "quadrature", "tokens"])
@pytest.mark.parametrize("scale", ["none", "exp_beta"])
def test_interaction_energy_never_decreases(kind, scale):
    """B = V symmetric: unnormalised attention ascends ½∬e^{β⟨x, By⟩}dρdρ (docs/theory.md#formulas-and-exact-solutions),
    computed on the run's measures (cells and atoms; particles)."""
    t, e = energy_history(kind, nside=4, t_end=0.6, save_every=0.1, scale=scale, n=300)
    assert np.all(np.diff(e) > 0)
    assert e[-1] > e[0] * (1.5 if scale == "none" else 1.01)


def test_energy_identity_for_tokens():
    """dE/dt = β Σ_i w_i |v(x_i)|² e^{c}·e^{−c}: with V = B, v = e^{−c} P_x(B n) = e^{−c}∇_S Z/β.
    Central difference of E over ±dt of an RK4 step against the identity (independent of the
    field's own divergence)."""
    from spherepde.solvers.particles import ParticleSolver, tokens_from_law

    B = np.array([[1.0, 0.3, 0.0], [0.3, 0.6, -0.2], [0.0, -0.2, -0.4]])
    model = AttentionModel(B, B, 3.0, normalisation="unnormalised")
    x, w = tokens_from_law(VonMisesFisher([0.2, -0.5, 0.8], 1.5), 300, 1)
    solver = ParticleSolver(model, dt=1e-3)
    v, _ = solver.field(x, w)
    rate = model.beta * float(np.sum(w * np.sum(v * v, axis=1)))
    dt = 1e-3
    forward, _ = solver.step(x, None, w, dt)
    backward, _ = solver.step(x, None, w, -dt)
    de = (interaction_energy(model, forward, w) - interaction_energy(model, backward, w)) / (2 * dt)
    assert de == pytest.approx(rate, rel=1e-5)


def test_old_run_files_resume_as_softmax():
    """A file written before these keys implies softmax without scale (config.ADDED_KEYS)."""
    from spherepde.runner.config import difference

    new = resolve(BASE)
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in new.items()}
    del old["model"]["normalisation"], old["model"]["unnormalised_scale"]
    assert difference(old, new) is None
    changed = resolve(_config(normalisation="unnormalised"))
    assert "[model] normalisation" in difference(old, changed)
