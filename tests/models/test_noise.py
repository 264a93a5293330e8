"""Noise: ∂_t f + div_S(f v) = ν(t) Δ_S f on the mesh, Brownian tokens on S².

References are exact or independent: Y_ℓ decays like e^{−νℓ(ℓ+1)t}; the Funk–Hecke growth rates
about the uniform state lose νℓ(ℓ+1) (docs/theory.md#formulas-and-exact-solutions); Brownian motion on S² has E[x_t] = e^{−2νt}x₀;
scipy's expm_multiply for the heat flow; scipy's SLSQP for the rates' quadratic program; closed
schedule integrals against quadrature; mass, positivity, ν = 0 against the noiseless run, resume
against the uninterrupted run, bad configs against exit status 2 and the key's name."""

import json
import math

import netCDF4
import numpy as np
import numpy_reference as ref
import pytest
from run_configs import PAPER_VMF_CONFIG
from run_helpers import ROUND_OFF, interrupt_after, one_numba_thread, run_difference  # noqa: F401 (autouse: one numba thread)
from scipy.integrate import quad
from scipy.optimize import minimize
from scipy.sparse.linalg import expm_multiply
from scipy.special import eval_legendre, spherical_in

from spherepde import AttentionModel, EulerianSolver, ParticleSolver
from spherepde.analysis.exact import linear_growth_rate
from spherepde.cli import main
from spherepde.models.initial import VonMisesFisher
from spherepde.models.noise import NoiseSchedule
from spherepde.runner.config import ADDED_KEYS, ConfigError, difference, resolve
from spherepde.solvers.particles import geodesic_noise_step, noise_mean_factor
from spherepde.storage.runfile import open_run
from spherepde.transport import FluxDivergence, SSPStepper, kernels
from spherepde.transport.diffusion import (
    MeshDiffusion,
    _one_sided_rates,
    poisson_weights,
)

AXIS = np.array([0.3, 0.4, 0.866]) / np.linalg.norm([0.3, 0.4, 0.866])
PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


@pytest.fixture(scope="module")
def diffusion_factory(mesh_factory):
    cache = {}

    def get(nside):
        if nside not in cache:
            cache[nside] = MeshDiffusion(mesh_factory(nside))
        return cache[nside]

    return get


def legendre_cells(mesh, ell):
    return mesh.cell_average(lambda x: eval_legendre(ell, x @ AXIS), order=6)


# ------------------------------------------------------------------ the schedule
SCHEDULES = [NoiseSchedule(0.3), NoiseSchedule(0.3, "exponential", 0.7), NoiseSchedule(0.3, "linear", 0.8),
             NoiseSchedule(0.3, "piecewise", breakpoints=[[0, 1.0], [0.5, 0.2], [1.2, 2.0]])]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.schedule)
def test_schedule_integral_is_the_integral_of_nu(schedule):
    for t0, t1 in [(0.0, 0.3), (0.2, 0.9), (0.45, 1.7), (1.0, 1.0 + 1e-9), (2.0, 5.0)]:
        exact, _ = quad(schedule, t0, t1, points=[0.5, 0.8, 1.2], limit=200, epsabs=1e-15, epsrel=1e-13)
        assert schedule.integral(t0, t1) == pytest.approx(exact, rel=1e-10, abs=1e-18)
    assert schedule(0.0) == pytest.approx(0.3)
    # additive over a split of the interval
    assert schedule.integral(0.1, 1.5) == pytest.approx(schedule.integral(0.1, 0.6) + schedule.integral(0.6, 1.5))


def test_schedule_values_and_refusals():
    assert NoiseSchedule(0.3, "linear", 0.8)(1.0) == 0.0 and NoiseSchedule(0.3, "linear", 0.8).integral(0.9, 2) == 0
    assert NoiseSchedule(0.3, "exponential", 0.5)(1.0) == pytest.approx(0.3 * math.exp(-2))
    assert NoiseSchedule(0.0).is_zero and NoiseSchedule(1.0, "piecewise", breakpoints=[[0, 0.0]]).is_zero
    assert not NoiseSchedule(1e-12).is_zero
    for args, word in [((-1.0,), "level"), ((math.nan,), "level"), ((1.0, "cosine"), "schedule"),
                       ((1.0, "exponential"), "time"), ((1.0, "linear", 0.0), "time"),
                       ((1.0, "piecewise", None, [[0.1, 1.0]]), "first time"),
                       ((1.0, "piecewise", None, [[0, 1.0], [0, 2.0]]), "increase"),
                       ((1.0, "piecewise", None, [[0, -1.0]]), "factors")]:
        with pytest.raises(ValueError, match=word):
            NoiseSchedule(*args)


# ------------------------------------------------------------------ the mesh operator
def test_rates_are_symmetric_positive_and_conservative(diffusion_factory):
    for nside in (1, 2, 8):
        D = diffusion_factory(nside)
        L = D.matrix()
        assert abs(L - L.T).max() == 0  # exactly symmetric
        off = L - np.diag(L.diagonal())
        assert off.min() >= 0 and (D.rates >= 0).all()
        ones = np.ones(D.mesh.npix)
        assert np.abs(L @ ones).max() < 1e-12 * D.max_rate  # constants are steady
        assert np.abs(ones @ L).max() < 1e-12 * D.max_rate  # mass is kept
        # every cell is coupled to its four edge neighbours (no decoupled sub-lattice)
        assert (D.rates[:, [0, 2, 4, 6]] > 0).all() or nside > 64


def test_one_sided_rates_solve_the_moment_problem_with_least_norm(mesh_factory):
    """The active-set solution against SLSQP on the same quadratic program, at cells all over
    the sphere (poles, |z| = 2/3, face corners with 7 neighbours)."""
    mesh = mesh_factory(8)
    cells = np.array([0, 5, 63, 64, 191, 300, 383, 500, 767])
    w, residual = _one_sided_rates(mesh, cells)
    assert residual < 1e-12 and (w >= 0).all()
    from spherepde.transport.diffusion import _tangent_frame

    e1, e2 = _tangent_frame(mesh.centroids[cells])
    h = math.sqrt(mesh.area)
    for row, c in enumerate(cells):
        nbr = mesh.neighbours[c]
        valid = nbr != c
        x = mesh.centroids[c]
        y = mesh.centroids[nbr[valid]]
        angle = np.arccos(np.clip(y @ x, -1, 1))
        t = y - (y @ x)[:, None] * x
        d = t / np.linalg.norm(t, axis=1, keepdims=True) * angle[:, None]
        dx, dy = d @ e1[row], d @ e2[row]
        A = np.stack([h * dx, h * dy, dx * dx, dx * dy, dy * dy])
        target = np.array([0, 0, 2.0, 0, 2.0])
        sigma = 1.0 / (dx * dx + dy * dy) ** 2
        start = minimize(lambda v: np.sum(v**2 / sigma), np.full(valid.sum(), 1.0 / mesh.area),
                         jac=lambda v: 2 * v / sigma,
                         constraints=[{"type": "eq", "fun": lambda v: A @ v - target, "jac": lambda v: A}],
                         bounds=[(0, None)] * valid.sum(), method="SLSQP", options={"ftol": 1e-15, "maxiter": 500})
        assert start.success
        np.testing.assert_allclose(w[row, valid], start.x, rtol=1e-5, atol=1e-6 * w[row].max())
        np.testing.assert_allclose(A @ w[row, valid], target, atol=1e-12)


def test_kernels_equal_numpy_references(diffusion_factory):
    D = diffusion_factory(8)
    f = np.random.default_rng(1).random(D.mesh.npix)
    out = np.empty_like(f)
    kernels.graph_laplacian(f, D.neighbours, D.rates, out)
    np.testing.assert_allclose(out, ref.graph_laplacian(f, D.neighbours, D.rates), rtol=1e-12, atol=1e-9)
    for amount in (1e-5, 3e-3):
        p = poisson_weights(D.max_rate * amount)
        serial = D.propagate(f, amount)
        np.testing.assert_allclose(serial, ref.uniformization(f, D.neighbours, D.rates, p), rtol=1e-12)
        threaded = np.empty_like(f)
        kernels.uniformization(f, D.neighbours, D.rates, D.diagonal, 1 / D.max_rate, p, threaded,
                               np.empty_like(f), np.empty_like(f))
        np.testing.assert_array_equal(threaded, serial)  # no reduction across cells: the same bits
    x = np.random.default_rng(2).normal(size=(50, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    xi = np.random.default_rng(3).normal(size=(50, 3))
    np.testing.assert_allclose(geodesic_noise_step(x, 0.7, xi), ref.rotation_noise_step(x, 0.7, xi), atol=1e-14)


def test_heat_flow_is_exact_positive_and_conservative(diffusion_factory):
    """Uniformisation equals expm_multiply to round-off; a spike stays ≥ 0 and keeps its mass for
    steps far beyond the explicit stability limit."""
    D = diffusion_factory(8)
    f = np.random.default_rng(4).random(D.mesh.npix)
    for amount in (1e-4, 0.05):
        np.testing.assert_allclose(D.propagate(f, amount), expm_multiply(amount * D.matrix(), f), rtol=1e-12)
    spike = np.zeros(D.mesh.npix)
    spike[123] = 1.0 / D.mesh.area
    for amount in (1e-6, 1e-3, 0.3):  # explicit Euler is stable below 2/Λ ≈ 1e-5 here
        g = D.propagate(spike, amount)
        assert g.min() >= 0
        assert D.mesh.integrate(g) == pytest.approx(1.0, abs=1e-14)
    assert np.allclose(D.propagate(spike, 50.0), 1 / (4 * math.pi), rtol=1e-9)  # the uniform limit


def pure_heat_errors(mesh, nu, ell, t_end, steps=4):
    """Run the Eulerian solver with V = 0 (pure diffusion) from uniform + P_ℓ: the relative L²
    error of the perturbation against e^{−νℓ(ℓ+1)t}P_ℓ and the fitted decay rate."""
    model = AttentionModel(np.eye(3), np.zeros((3, 3)), 1.0)
    P = legendre_cells(mesh, ell)
    f0 = (1 + 0.5 * P) / (4 * math.pi)
    ds = EulerianSolver(mesh, model, noise=NoiseSchedule(nu)).run(f0, t_end, t_end / steps)
    pert = ds.density.values * 4 * math.pi - 1
    exact = 0.5 * np.exp(-nu * ell * (ell + 1) * ds.time.values)[:, None] * P
    err = np.sqrt(np.sum((pert[-1] - exact[-1]) ** 2) / np.sum(exact[-1] ** 2))
    rate = np.polyfit(ds.time.values, np.log(pert @ P), 1)[0]
    return err, rate, ds


def test_heat_equation_decay_and_order(mesh_factory):
    """Y_ℓ decays like e^{−νℓ(ℓ+1)t}: at e^{−1}, the decay rate error falls at order ≈ 2 and
    the solution error at order > 1.2 from nside 8 to 16; mass to round-off, f ≥ 0."""
    nu = 0.1
    for ell in (2, 4):
        results = {n: pure_heat_errors(mesh_factory(n), nu, ell, 1.0 / (nu * ell * (ell + 1))) for n in (8, 16)}
        exact = -nu * ell * (ell + 1)
        rate_err = {n: abs(r[1] / exact - 1) for n, r in results.items()}
        assert rate_err[16] < 0.01 and math.log2(rate_err[8] / rate_err[16]) > 1.6, rate_err
        sol = {n: r[0] for n, r in results.items()}
        assert sol[16] < 0.012 and math.log2(sol[8] / sol[16]) > 1.2, sol
        ds = results[16][2]
        assert np.abs(ds.mass.values - 1).max() < 1e-13 and ds.density.values.min() > 0


def test_growth_rates_with_noise_funk_hecke(mesh_factory):
    """V = B = I, β = 6, ν making ℓ = 2 neutral: rates ℓ(ℓ+1)(i_ℓ(β)/(β i₀(β)) − ν) within 1 %
    of max(|rate|, attention rate) at nside 16 (spherepde/validation/noise.py: ℓ = 1 … 6, β = 1, 6, nside 32)."""
    beta = 6.0
    nu = spherical_in(2, beta) / (beta * spherical_in(0, beta))
    mesh = mesh_factory(16)
    solver = EulerianSolver(mesh, AttentionModel(np.eye(3), np.eye(3), beta), noise=NoiseSchedule(nu))
    base = solver.run(np.full(mesh.npix, 1 / (4 * math.pi)), 0.2, 0.02).density.values
    for ell in (1, 2, 3):
        P = legendre_cells(mesh, ell)
        ds = solver.run((1 + 1e-4 * P) / (4 * math.pi), 0.2, 0.02)
        amplitude = (ds.density.values - base) @ P
        rate = np.polyfit(ds.time.values, np.log(np.abs(amplitude)), 1)[0]
        attention = linear_growth_rate(beta, ell)
        exact = attention - nu * ell * (ell + 1)
        assert abs(rate - exact) < 0.01 * max(abs(exact), attention), (ell, rate, exact)
    assert abs(linear_growth_rate(beta, 2) - 6 * nu) < 1e-14  # the neutral mode is neutral


@pytest.mark.slow
def test_growth_rates_with_noise_nside_32(mesh_factory):
    """The validation's case: ℓ = 1 … 6, β = 1 and 6, ν = 0 and the ν that makes ℓ = 3 neutral,
    within 1 % at nside 32."""
    from spherepde.validation.noise import growth_rates_with_noise

    rows = growth_rates_with_noise(mesh_factory(32), betas=(1.0, 6.0), ells=range(1, 7))
    for row in rows:
        assert row["error"] < 0.01, row


def test_time_order_of_the_coupled_step(mesh_factory):
    """Transport and diffusion together (paper matrices, β = 5, ν = 0.05), fixed steps dt, dt/2,
    dt/4 against dt/16 on one mesh: the integrating-factor SSP-RK2 step is second order."""
    mesh = mesh_factory(4)
    model = AttentionModel(PAPER_B, PAPER_V, 5.0)
    solver = EulerianSolver(mesh, model, scheme="upwind", cfl=1.0, noise=NoiseSchedule(0.05))
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 2.0).cell_averages(mesh)
    t_end = 0.4

    def integrate(dt):
        f, t = f0.copy(), 0.0
        for _ in range(int(round(t_end / dt))):
            f, taken = solver.stepper.step(f, t, dt)
            assert taken == dt
            t += dt
        return f

    reference = integrate(0.4 / 128)
    errors = [np.abs(integrate(dt) - reference).max() for dt in (0.4 / 8, 0.4 / 16, 0.4 / 32)]
    orders = [math.log2(a / b) for a, b in zip(errors, errors[1:])]
    assert min(orders) > 1.8, (errors, orders)


def test_mass_and_positivity_of_a_concentrating_noisy_run(mesh_factory):
    """Paper matrices at β = 10 from a sharp vMF (κ = 60) with ν = 0.02, MUSCL: f ≥ 0, mass
    to round-off, and the density lower bound ℓ₀ exp(−∫ sup div v) still holds (diffusion
    only raises the minimum)."""
    mesh = mesh_factory(8)
    f0 = VonMisesFisher([0.0, 0.6, 0.8], 60.0).cell_averages(mesh)
    ds = EulerianSolver(mesh, AttentionModel(PAPER_B, PAPER_V, 10.0), noise=NoiseSchedule(0.02)).run(f0, 1.0, 0.25)
    assert ds.density.values.min() >= 0
    assert np.abs(ds.mass.values - 1).max() < 1e-13
    assert np.all(ds.min_density.values >= ds.lower_bound_aposteriori.values)
    assert ds.attrs["noise"] == "nu(t) = 0.02" and ds.heat_products.values[-1] > 0


def test_zero_noise_is_the_noiseless_run_bit_for_bit(mesh_factory):
    mesh = mesh_factory(4)
    model = AttentionModel(PAPER_B, PAPER_V, 5.0)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 2.0).cell_averages(mesh)
    plain = EulerianSolver(mesh, model).run(f0, 0.3, 0.1)
    zero = EulerianSolver(mesh, model, noise=NoiseSchedule(0.0)).run(f0, 0.3, 0.1)
    np.testing.assert_array_equal(plain.density.values, zero.density.values)
    # a schedule that has ended: the stepper takes the plain path after t = τ
    late = EulerianSolver(mesh, model, noise=NoiseSchedule(0.5, "linear", 0.05))
    plain_solver = EulerianSolver(mesh, model)
    a, _ = late.stepper.step(f0, 0.1, 0.01)
    b, _ = plain_solver.stepper.step(f0, 0.1, 0.01)
    np.testing.assert_array_equal(a, b)
    c, _ = late.stepper.step(f0, 0.0, 0.01)
    assert np.abs(c - b).max() > 1e-8  # and noise before it changes the step
    x0 = np.random.default_rng(5).normal(size=(30, 3))
    w = np.full(30, 1 / 30)
    runs = [list(ParticleSolver(model, "euler", 0.05, **kw).snapshots(x0, w, [0.0, 0.1, 0.2]))
            for kw in ({}, {"noise": NoiseSchedule(0.0), "seed": 4})]
    for (_, _, xa, _), (_, _, xb, _) in zip(*runs):
        np.testing.assert_array_equal(xa, xb)


# ------------------------------------------------------------------ particles
def brownian_ensemble(nu, t_end, dt, seeds, n=2000):
    """x₀ = e_z for every token, V = 0 (no drift): positions at t_end over independent seeds."""
    model = AttentionModel(np.eye(3), np.zeros((3, 3)), 1.0)
    x0 = np.tile([0.0, 0.0, 1.0], (n, 1))
    out = []
    for seed in seeds:
        solver = ParticleSolver(model, "euler", dt, noise=NoiseSchedule(nu), seed=seed)
        *_, (_, t, x, _) = solver.snapshots(x0, np.full(n, 1.0 / n), [0.0, t_end])
        assert t == t_end
        out.append(x)
    return np.concatenate(out)


def test_brownian_tokens_mean_within_confidence_interval():
    """E[x_t] = e^{−2νt}x₀ (Brownian motion on S² with generator νΔ_S) within the confidence
    interval of 20 000 tokens at dt = 0.005, where the scheme's bias (2/3)ν²t dt·e^{−2νt} = 2.5e-4
    is 10× below the interval's half width (99 % per component, so ≥ 97 % for the three at once);
    at dt = 0.25 the ensemble follows the scheme's exact mean m(s)^{t/dt} instead, 0.04 away."""
    nu, t = 0.5, 0.5
    z99 = 2.576
    x = brownian_ensemble(nu, t, 0.005, seeds=range(10))
    assert np.abs(np.linalg.norm(x, axis=1) - 1).max() < 1e-14
    for k, expected in enumerate([0.0, 0.0, math.exp(-2 * nu * t)]):
        half = z99 * x[:, k].std(ddof=1) / math.sqrt(len(x))
        assert abs(x[:, k].mean() - expected) < half, (k, x[:, k].mean(), expected, half)
    coarse = brownian_ensemble(1.0, t, 0.25, seeds=range(10, 20))[:, 2]
    half = z99 * coarse.std(ddof=1) / math.sqrt(len(coarse))
    scheme = noise_mean_factor(math.sqrt(2 * 1.0 * 0.25)) ** 2
    assert abs(coarse.mean() - scheme) < half and abs(coarse.mean() - math.exp(-1.0)) > 3 * half


def test_seeds_give_reproducible_and_independent_streams():
    model = AttentionModel(np.eye(3), np.eye(3), 2.0)
    x0 = np.random.default_rng(0).normal(size=(20, 3))
    w = np.full(20, 0.05)

    def path(seed):
        solver = ParticleSolver(model, "rk4", 0.05, noise=NoiseSchedule(0.1), seed=seed)
        return np.array([x for _, _, x, _ in solver.snapshots(x0, w, [0.0, 0.1, 0.2, 0.3])])

    np.testing.assert_array_equal(path(3), path(3))
    assert np.abs(path(3) - path(4)).max() > 1e-3
    # resumed from snapshot 1 with the saved positions: the same path
    solver = ParticleSolver(model, "rk4", 0.05, noise=NoiseSchedule(0.1), seed=3)
    full = path(3)
    resumed = [x for _, _, x, _ in solver.snapshots(full[1], w, [0.0, 0.1, 0.2, 0.3], resume_from=1)]
    np.testing.assert_array_equal(np.array(resumed), full[2:])


def test_particle_solver_refuses_carried_density_with_noise():
    model = AttentionModel(np.eye(3), np.eye(3), 2.0)
    with pytest.raises(ValueError, match="carried densities"):
        ParticleSolver(model, carry_density=True, noise=NoiseSchedule(0.1))
    with pytest.raises(ValueError, match="seed"):
        ParticleSolver(model, noise=NoiseSchedule(0.1), seed=-1)


def test_eulerian_solver_refuses_atoms_and_rk3_with_noise(mesh_factory):
    mesh = mesh_factory(2)
    model = AttentionModel(np.eye(3), np.eye(3), 2.0)
    with pytest.raises(ValueError, match="atoms"):
        EulerianSolver(mesh, model, atoms={}, noise=NoiseSchedule(0.1))
    with pytest.raises(ValueError, match="rk_order 2"):
        EulerianSolver(mesh, model, rk_order=3, noise=NoiseSchedule(0.1))
    with pytest.raises(ValueError, match="rk order 2"):
        SSPStepper(FluxDivergence(mesh), None, order=3, diffusion=MeshDiffusion(mesh), noise=NoiseSchedule(0.1))


# ------------------------------------------------------------------ config, run file, resume, sweep
CONFIG = PAPER_VMF_CONFIG + """
[eulerian]
nside = 4

[time]
t_end = 0.4
save_every = 0.1
"""
NOISE = "noise = 0.05\n"
TOKENS = '\n[particles]\nmode = "tokens"\nn = 40\nseed = 3\ndt = 0.05\n'


def with_model_keys(text, keys):
    return text.replace("[initial]", keys + "\n[initial]", 1)


BAD = [
    ("noise = -0.1", ["[model] noise", ">= 0"]),
    ("noise = nan", ["[model] noise", "finite"]),
    ("noise = inf", ["[model] noise", "finite"]),
    ('noise = "strong"', ["[model] noise", "a number"]),
    ("noise = 5000.0", ["[model] noise", "<= 1000"]),
    ('noise = 0.1\nnoise_schedule = "cosine"', ["[model] noise_schedule", "cosine"]),
    ('noise = 0.1\nnoise_schedule = "exponential"', ["[model] noise_time", "required"]),
    ('noise = 0.1\nnoise_schedule = "linear"\nnoise_time = 0.0', ["[model] noise_time", "> 0"]),
    ('noise = 0.1\nnoise_schedule = "piecewise"', ["[model] noise_breakpoints", "required"]),
    ('noise = 0.1\nnoise_schedule = "piecewise"\nnoise_breakpoints = [[0.5, 1.0]]', ["[model] noise_breakpoints[0][0]", "0"]),
    ('noise = 0.1\nnoise_schedule = "piecewise"\nnoise_breakpoints = [[0, 1.0], [0.0, 2.0]]', ["[model] noise_breakpoints[1][0]", "increase"]),
    ('noise = 0.1\nnoise_schedule = "piecewise"\nnoise_breakpoints = [[0, -1.0]]', ["[model] noise_breakpoints[0][1]", ">= 0"]),
    ('noise = 0.1\nnoise_schedule = "piecewise"\nnoise_breakpoints = [[0, 1.0, 2.0]]', ["[model] noise_breakpoints[0]", "pair"]),
    ('noise = 0.1\nnoise_schedule = "piecewise"\nnoise_breakpoints = [[0, 1e5]]', ["[model] noise_breakpoints", "<= 1000"]),
]


@pytest.mark.parametrize("keys,words", BAD, ids=[b[0] for b in BAD])
def test_bad_noise_config_exits_2_naming_the_key(tmp_path, capsys, keys, words):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(with_model_keys(CONFIG, keys))
    out = tmp_path / "run.nc"
    assert main(["run", str(cfg), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("extra,words", [
    ("\n[eulerian]\natoms = true\n", ["[eulerian] atoms", "noise"]),
    ("\n[eulerian]\nrk_order = 3\n", ["[eulerian] rk_order", "2"]),
])
def test_noise_refuses_atoms_and_rk3_in_the_config(tmp_path, capsys, extra, words):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(with_model_keys(CONFIG, NOISE).replace("[eulerian]\nnside = 4\n", "") + extra)
    assert main(["run", str(cfg), "-o", str(tmp_path / "run.nc")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    cfg.write_text(CONFIG.replace("nside = 4", "nside = 4" + extra.split("]")[1]))  # fine without noise
    assert main(["run", str(cfg), "-o", str(tmp_path / "run.nc"), "--check"]) == 0


def test_resolved_noise_keys_and_old_configs():
    raw = {"model": {"beta": 1.0, "B": np.eye(3).tolist(), "V": np.eye(3).tolist()},
           "time": {"t_end": 1.0, "save_every": 0.5}}
    plain = resolve(raw)
    assert plain["model"]["noise"] == 0.0 and plain["eulerian"]["atoms"] is True
    noisy = resolve({**raw, "model": {**raw["model"], "noise": 0.1, "noise_schedule": "constant", "noise_time": 3}})
    assert noisy["model"]["noise_time"] is None and noisy["eulerian"]["atoms"] is False
    # a file written before noise existed: its config lacks the keys and still matches a config
    # with the atom rule of its time (no stalled peaks, no join)
    old = json.loads(json.dumps(plain))
    for section, key in ADDED_KEYS:
        if old.get(section) is not None:  # [particles] is None without particles
            old[section].pop(key)
    assert difference(old, json.loads(json.dumps(plain))) == "[eulerian] atom_join: 0.0 in the file, 4.0 now"
    rule_of_then = {"eulerian": {"atom_stalled_width": 0.0, "atom_join": 0.0}}
    plain = resolve({**raw, **rule_of_then})
    assert difference(old, json.loads(json.dumps(plain))) is None
    noisy = resolve({**raw, **rule_of_then, "model": {**raw["model"], "noise": 0.1}})
    assert difference(old, json.loads(json.dumps(noisy))) == "[eulerian] atoms: True in the file, False now"
    noisy_without_atoms = json.loads(json.dumps(noisy))
    noisy_without_atoms["eulerian"]["atoms"] = True
    assert difference(old, noisy_without_atoms) == "[model] noise: 0.0 in the file, 0.1 now"
    with pytest.raises(ConfigError, match=r"\[model\] noise_time: must be > 0"):
        resolve({**raw, "model": {**raw["model"], "noise_time": -1.0}})


def test_a_file_written_before_noise_existed_resumes(tmp_path, capsys):
    """A run file whose config has no noise keys (written by an older spherepde: no layout
    digests either), interrupted after 2 snapshots: --resume continues it and ends equal to the
    uninterrupted run. The config states the atom rule of then (an old file implies it, and a
    resume with a different rule is refused)."""
    cfg = tmp_path / "old.toml"
    cfg.write_text(CONFIG.replace("nside = 4", "nside = 2\natom_stalled_width = 0.0\natom_join = 0.0"))
    full, old = tmp_path / "full.nc", tmp_path / "old.nc"
    assert main(["run", str(cfg), "-o", str(full)]) == 0
    interrupt_after(cfg, old, 2)  # asserts exit status 130
    with netCDF4.Dataset(old, "a") as nc:
        config = json.loads(nc.getncattr("config"))
        for section, key in ADDED_KEYS:
            if config.get(section) is not None:  # [particles] is None without particles
                config[section].pop(key)
        nc.setncattr("config", json.dumps(config))
        for name in ("layout_digest", "end_digest"):
            if name in nc.ncattrs():
                nc.delncattr(name)
    assert main(["run", str(cfg), "-o", str(old), "--resume"]) == 0
    assert "resumed from snapshot 1" in open_run(old).attrs["history"]
    assert run_difference(old, full) <= ROUND_OFF


def test_noise_zero_in_the_config_is_the_noiseless_run_file(tmp_path):
    plain, zero = tmp_path / "plain.toml", tmp_path / "zero.toml"
    plain.write_text(CONFIG + TOKENS)
    zero.write_text(with_model_keys(CONFIG, 'noise = 0.0\nnoise_schedule = "linear"\nnoise_time = 1.0') + TOKENS)
    for cfg in (plain, zero):
        assert main(["run", str(cfg), "-o", str(tmp_path / f"{cfg.stem}.nc")]) == 0
    a, b = open_run(tmp_path / "plain.nc"), open_run(tmp_path / "zero.nc")
    np.testing.assert_array_equal(a.density.values, b.density.values)
    np.testing.assert_array_equal(a.positions.values, b.positions.values)
    assert "noise" not in a.variables and "noise" not in b.attrs


@pytest.mark.parametrize("particles", [TOKENS, TOKENS.replace('"tokens"', '"quadrature"')], ids=["tokens", "quadrature"])
def test_noisy_run_file_and_resume_equal_the_uninterrupted_run(tmp_path, particles):
    """Eulerian diffusion and Brownian particles through the CLI: the run file records ν; a run
    stopped after 3 snapshots and resumed equals the uninterrupted one; quadrature particles
    carry no density with noise."""
    cfg = tmp_path / "noisy.toml"
    cfg.write_text(with_model_keys(CONFIG, 'noise = 0.05\nnoise_schedule = "exponential"\nnoise_time = 0.3') + particles)
    full, cut = tmp_path / "full.nc", tmp_path / "cut.nc"
    assert main(["run", str(cfg), "-o", str(full)]) == 0
    interrupt_after(cfg, cut, 3)  # asserts exit status 130
    assert open_run(cut).sizes["time"] == 3
    assert main(["run", str(cfg), "-o", str(cut), "--resume"]) == 0
    assert run_difference(cut, full) <= ROUND_OFF
    ds = open_run(full)
    np.testing.assert_allclose(ds.noise.values, 0.05 * np.exp(-ds.time.values / 0.3), rtol=1e-14)
    assert ds.attrs["noise_schedule"] == "exponential" and "geodesic" in ds.attrs["particle_noise_scheme"]
    assert json.loads(ds.attrs["config"])["eulerian"]["atoms"] is False
    assert "particle_density" not in ds.variables and np.abs(ds.mass.values - 1).max() < 1e-13
    with netCDF4.Dataset(full) as nc:  # the drift alone would differ: noise moved the tokens
        assert np.isfinite(nc.variables["positions"][:]).all()


def test_sweep_over_noise(tmp_path):
    """A sweep over model.noise expands (atoms on without noise, off with it), its runs combine
    (ν NaN where there is none), and a bad value names the sweep key."""
    from spherepde.runner.sweep import SweepError, combine, expand, run_one

    base = tmp_path / "base.toml"
    base.write_text(CONFIG.replace("t_end = 0.4", "t_end = 0.2") + TOKENS)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[sweep]\nname = "nz"\nbase = "base.toml"\n\n[sweep.grid]\n"model.noise" = [0.0, 0.05]\n')
    specs = expand(sweep, tmp_path / "out")
    assert [s.config["model"]["noise"] for s in specs] == [0.0, 0.05]
    assert [s.config["eulerian"]["atoms"] for s in specs] == [True, False]
    assert specs[0].config["particles"]["seed"] != specs[1].config["particles"]["seed"]
    for spec in specs:
        spec.path.parent.mkdir(exist_ok=True)
        assert run_one({"run_id": spec.run_id, "config": spec.config, "action": "start"})["ok"]
    import xarray as xr

    ds = xr.open_dataset(combine(specs, tmp_path / "out" / "nz.nc", "nz"))
    assert list(ds.model_noise.values) == [0.0, 0.05]
    assert np.isnan(ds.noise.values[0]).all() and np.allclose(ds.noise.values[1], 0.05)
    sweep.write_text('[sweep]\nname = "nz"\nbase = "base.toml"\n\n[sweep.grid]\n"model.noise" = [0.0, -1.0]\n')
    with pytest.raises(SweepError, match=r'"model.noise" = -1.0: \[model\] noise: must be >= 0'):
        expand(sweep, tmp_path / "out")
