"""Extrapolated edge fluxes between exact velocity evaluations (spherepde.transport.extrapolated) and
the Eulerian solver that uses them: the extrapolation against polynomials in time, the
interval controller, and a solver run against the exact-stage run it approximates."""

import math

import numpy as np
import pytest

from spherepde.models.attention import AttentionModel
from spherepde.models.initial import VonMisesFisher
from spherepde.solvers.controller import SolverState
from spherepde.solvers.eulerian import EulerianSolver
from spherepde.transport.extrapolated import MAX_GROWTH, ExtrapolatedFlux

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def polynomial_flux(t, a, b, c, d=0.0):
    return a + b * t + c * t * t + d * t**3


def test_linear_fluxes_are_extrapolated_exactly():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 50, 2))
    lag = ExtrapolatedFlux(1e-3, a.shape, intervals=(0.1, 0.0), degree=1)
    lag.refresh(0.0, polynomial_flux(0.0, a, b, 0))
    assert not lag.warm and lag.due(0.05, 0.01)
    lag.refresh(0.1, polynomial_flux(0.1, a, b, 0))
    assert lag.warm and not lag.due(0.15, 0.05) and lag.due(0.15, 0.06)
    assert lag.usable(0.2) and not lag.usable(0.1 + 1.3 * 0.1)
    for tau in (0.1, 0.13, 0.2, 0.35):
        np.testing.assert_allclose(lag.predict(tau), polynomial_flux(tau, a, b, 0), rtol=0, atol=1e-14)
    # zero measured error: the interval grows by the largest factor
    assert lag.refresh(0.2, polynomial_flux(0.2, a, b, 0)) < 1e-14
    assert lag.interval == pytest.approx(MAX_GROWTH * 0.1)


def test_quadratic_error_and_interval_controller():
    """un = a + b t + c t²: linear extrapolation from t_a, t_b to t_b + s errs by c·s(s + t_b − t_a)
    exactly; the controller picks the interval that would have given ε/2 (error ∝ s²)."""
    rng = np.random.default_rng(1)
    a, b, c = rng.normal(size=(3, 40, 2))
    a += 10.0  # keep max|un| away from 0
    eps = 1e-3
    lag = ExtrapolatedFlux(eps, a.shape, intervals=(0.04, 0.0), degree=1)
    lag.refresh(0.0, polynomial_flux(0.0, a, b, c))
    lag.refresh(0.02, polynomial_flux(0.02, a, b, c))
    t, s, h = 0.05, 0.03, 0.02
    exact = polynomial_flux(t, a, b, c)
    expected = np.abs(c * s * (s + h)).max() / np.abs(exact).max()
    lag.predict(0.03)  # a stage used the extrapolation: its error goes on record
    error = lag.refresh(t, exact)
    assert error == pytest.approx(expected, rel=1e-9)
    wanted = s * math.sqrt(0.5 * eps / error)
    assert lag.interval == pytest.approx(min(2 * 0.04, max(0.25 * 0.04, wanted)))
    assert lag.intervals[1] == 0.0  # the quadratic's interval is untouched by a linear measurement
    assert lag.max_error == error
    lag.clear_error()
    assert lag.max_error == 0.0
    # an extrapolation no stage used is measured (it steers the interval) but not recorded
    assert lag.refresh(0.06, polynomial_flux(0.06, a, b, c)) > 0
    assert lag.max_error == 0.0


def test_quadratic_extrapolation_and_its_controller():
    """Degree 2: quadratic fluxes are extrapolated exactly; for cubic ones un = … + d t³ the
    error at t_c + s is d·s(s + t_c − t_b)(s + t_c − t_a) exactly, and the controller picks the
    interval that would have given ε/2 with e ∝ s³. Before its own interval is known the
    quadratic uses the linear one."""
    rng = np.random.default_rng(3)
    a, b, c, d = rng.normal(size=(4, 30, 2))
    a += 10.0
    lag = ExtrapolatedFlux(1e-3, a.shape, intervals=(0.05, 0.0))
    for t in (0.0, 0.03, 0.05):
        lag.refresh(t, polynomial_flux(t, a, b, c))
    assert lag.degree == 2 and lag.intervals[1] == 0.0 and lag.interval == lag.intervals[0] > 0
    for tau in (0.05, 0.08, 0.2):
        np.testing.assert_allclose(lag.predict(tau), polynomial_flux(tau, a, b, c), rtol=0, atol=1e-13)
    lag = ExtrapolatedFlux(1e-3, a.shape, intervals=(0.05, 0.1))
    for t in (0.0, 0.03, 0.05):
        lag.refresh(t, polynomial_flux(t, a, b, c, d))
    s, t = 0.04, 0.09
    exact = polynomial_flux(t, a, b, c, d)
    expected = np.abs(d * s * (s + 0.02) * (s + 0.05)).max() / np.abs(exact).max()
    lag.predict(0.07)
    linear = lag.intervals[0]
    error = lag.refresh(t, exact)
    assert error == pytest.approx(expected, rel=1e-8)
    wanted = s * (0.5e-3 / error) ** (1 / 3)
    assert lag.intervals[1] == pytest.approx(min(0.2, max(0.025, wanted)))
    assert lag.intervals[0] == linear  # a quadratic measurement leaves the linear interval
    assert lag.max_error == error


def test_unmeasured_edges_are_left_out_of_the_error():
    """Edges whose fluxes the solver overwrites (unmeasured) do not enter e: a cubic term on them
    alone gives e = 0 and the largest growth of the interval; measured, it gives the cubic's error."""
    rng = np.random.default_rng(5)
    a, b, c = rng.normal(size=(3, 30, 2))
    a += 10.0
    d = np.zeros_like(a)
    d[:5] = 50.0  # a kink-like change on the first five edges only
    unmeasured = np.zeros(30, dtype=bool)
    unmeasured[:5] = True
    errors = {}
    for mask in (None, unmeasured):
        lag = ExtrapolatedFlux(1e-3, a.shape, intervals=(0.05, 0.1))
        for t in (0.0, 0.03, 0.05):
            lag.refresh(t, polynomial_flux(t, a, b, c, d))
        lag.predict(0.07)
        errors[mask is None] = lag.refresh(0.09, polynomial_flux(0.09, a, b, c, d), unmeasured=mask)
        interval = lag.intervals[1]
    exact = polynomial_flux(0.09, a, b, c, d)
    assert errors[True] == pytest.approx(50.0 * 0.04 * 0.06 * 0.09 / np.abs(exact).max(), rel=1e-8)
    assert errors[False] < 1e-13 and interval == pytest.approx(MAX_GROWTH * 0.1)


def test_cold_start_takes_one_stage():
    """With one refresh held, the first exact stage after it starts the linear extrapolation;
    later stages (and stages not after the refresh) do not enter the history."""
    lag = ExtrapolatedFlux(1e-3, (2,), intervals=(0.1, 0.2))
    lag.refresh(1.0, np.array([1.0, 2.0]))
    assert not lag.warm and lag.interval == 0.0
    lag.record_stage(1.0, np.array([5.0, 5.0]))  # not after the refresh: ignored
    assert not lag.warm
    lag.record_stage(1.01, np.array([1.1, 2.0]))
    assert lag.warm and lag.degree == 1 and lag.interval == 0.1
    lag.record_stage(1.02, np.array([9.0, 9.0]))  # warm: ignored
    np.testing.assert_allclose(lag.predict(1.05), [1.5, 2.0], rtol=1e-12)
    # the next refresh replaces the stage point: the quadratic is only ever fitted to refreshes
    lag.refresh(1.1, np.array([2.0, 2.0]))
    assert lag.degree == 1 and lag.last_time == 1.1
    np.testing.assert_allclose(lag.predict(1.2), [3.0, 2.0], rtol=1e-12)


def test_reset_keeps_the_latest_refresh():
    lag = ExtrapolatedFlux(1e-3, (3,))
    for t in (0.0, 0.1, 0.2):
        lag.refresh(t, np.full(3, t))
    lag.reset()
    assert not lag.warm and lag.last_time == 0.2
    np.testing.assert_array_equal(lag.latest, np.full(3, 0.2))
    with pytest.raises(ValueError, match="tolerance"):
        ExtrapolatedFlux(0.0, (3,))
    with pytest.raises(ValueError, match="degree"):
        ExtrapolatedFlux(1e-3, (3,), degree=3)


@pytest.fixture(scope="module")
def lag_runs(mesh_factory):
    """The paper's matrices at β = 20 from a vMF start, nside 8 to t = 1 at Courant number 0.1
    (130 steps: refresh intervals span several steps, as on fine meshes): exact stages and
    extrapolated fluxes at three tolerances, and linear extrapolation at ε = 1e-3 (key
    (1e-3, 1)), each with its number of exact edge evaluations."""
    m = mesh_factory(8)
    model = AttentionModel(PAPER_B, PAPER_V, 20.0)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 3.0).cell_averages(m)
    runs = {}
    for key in (0.0, 1e-2, 1e-3, 1e-4, (1e-3, 1)):
        eps, degree = key if isinstance(key, tuple) else (key, 2)
        solver = EulerianSolver(m, model, cfl=0.1, velocity_tolerance=eps)
        if eps:
            solver.velocity.lag.max_degree = degree
        calls = [0]
        field = solver.velocity.edge_field

        def counted(f, field=field, calls=calls, **options):
            calls[0] += 1
            return field(f, **options)

        counted.forget_route = field.forget_route
        solver.velocity.edge_field = counted
        runs[key] = (solver.run(f0, 1.0, 0.25), calls[0])
    return m, model, f0, runs


def test_extrapolated_run_conserves_mass_and_positivity(lag_runs):
    _, _, _, runs = lag_runs
    for eps in (1e-2, 1e-3):
        ds, _ = runs[eps]
        assert np.abs(ds.mass.values - 1.0).max() < 1e-13
        assert ds.density.values.min() >= 0
        assert np.all(ds.velocity_interval.values[1:] > 0)
        assert np.all(ds.velocity_interval_linear.values[1:] > 0)
        assert ds.attrs["velocity_tolerance"] == eps
    exact, _ = runs[0.0]
    assert np.all(exact.velocity_interval.values == 0) and np.all(exact.velocity_lag_error.values == 0)


def test_extrapolated_run_converges_to_the_exact_stage_run(lag_runs):
    """A run whose edge fluxes err by at most ~ε (relative) for t ≤ 1 moves the density by at most
    ~ε in L¹: asserted ≤ ε against the exact-stage run, with the difference shrinking ≥ 10×
    from ε = 1e-2 to 1e-4, while the solver evaluates the velocity far less often than twice
    per step. The quadratic needs fewer evaluations than the linear extrapolation for an error
    no larger than twice the linear one's."""
    m, _, _, runs = lag_runs
    exact, exact_calls = runs[0.0]
    f = exact.density.values

    def lag(key):
        return (np.abs(runs[key][0].density.values - f) * m.area).sum(axis=1).max()

    for eps in (1e-2, 1e-3, 1e-4):
        assert 0 < lag(eps) <= eps, (eps, lag(eps))
        # the measured flux errors are on record and near the tolerance the controller aims at
        lag_error = runs[eps][0].velocity_lag_error.values
        assert 0 < lag_error.max() < 5 * eps, lag_error
    assert lag(1e-2) / lag(1e-4) > 10
    steps = int(exact.steps.values[-1])
    assert exact_calls == 2 * steps
    assert runs[1e-2][1] < 0.25 * exact_calls, (runs[1e-2][1], exact_calls)
    assert runs[1e-3][1] < runs[(1e-3, 1)][1] and lag(1e-3) < 2 * lag((1e-3, 1))


def test_extrapolated_run_resumes_from_a_snapshot(lag_runs):
    """Continuing from snapshot 2 (history restarted, interval from the record) repeats the
    uninterrupted run."""
    m, model, f0, runs = lag_runs
    full, _ = runs[1e-2]
    record = {name: full[name].values[2] for name in full.data_vars if full[name].dims == ("time",)}
    start = SolverState.from_record(2, full.density.values[2], record)
    solver = EulerianSolver(m, model, cfl=0.1, velocity_tolerance=1e-2)
    resumed = list(solver.snapshots(f0, full.time.values, start=start))
    assert [k for k, *_ in resumed] == [3, 4]
    for k, t, f, rec in resumed:
        np.testing.assert_allclose(f, full.density.values[k], rtol=1e-12, atol=0)
        assert rec["steps"] == full.steps.values[k]
        for name in ("velocity_interval", "velocity_interval_linear"):
            assert rec[name] == pytest.approx(full[name].values[k], rel=1e-12)


def test_coarsening_of_the_lag_validation(mesh_factory):
    """spherepde.validation.velocity_lag compares meshes through NESTED coarsening: the mean of the four
    children's exact cell averages is the parent's exact cell average (equal areas)."""
    from spherepde.validation.velocity_lag import coarsen

    law = VonMisesFisher([0.3, -0.5, 0.8], 5.0)
    fine, coarse = mesh_factory(16), mesh_factory(8)
    np.testing.assert_allclose(coarsen(law.cell_averages(fine, order=8)), law.cell_averages(coarse, order=8),
                               rtol=1e-10)


def test_a_reused_solver_repeats_its_extrapolated_run(lag_runs):
    """The history and the interval belong to a run: a second run of the same solver starts
    afresh and repeats the first."""
    m, model, f0, runs = lag_runs
    solver = EulerianSolver(m, model, cfl=0.1, velocity_tolerance=1e-2)
    first = solver.run(f0, 1.0, 0.25)
    second = solver.run(f0, 1.0, 0.25)
    np.testing.assert_array_equal(first.steps.values, second.steps.values)
    np.testing.assert_allclose(first.density.values, second.density.values, rtol=1e-12, atol=0)
    np.testing.assert_allclose(second.density.values, runs[1e-2][0].density.values, rtol=1e-12, atol=0)


def test_routing_restarts_at_snapshots(mesh_factory):
    """With the harmonic sums routing handed-back targets between calls (AttentionField), a run
    resumed from a snapshot still repeats the uninterrupted run: the routes restart at every
    snapshot boundary, as the extrapolation history does."""
    m = mesh_factory(16)
    model = AttentionModel(PAPER_B, PAPER_V, 30.0)
    f0 = VonMisesFisher([0.6, 0.0, 0.8], 20.0).cell_averages(m) + 1e-9
    times = np.array([0.0, 0.1, 0.2])
    solver = EulerianSolver(m, model, summation="harmonic", velocity_tolerance=1e-2)
    full = list(solver.snapshots(f0, times))
    assert solver.velocity.edge_field.stats["handed_back"].any()  # the routing was in use
    start = SolverState.from_record(1, full[1][2], full[1][3])
    resumed = list(EulerianSolver(m, model, summation="harmonic", velocity_tolerance=1e-2).snapshots(
        f0, times, start=start))
    np.testing.assert_array_equal(resumed[0][2], full[2][2])
    assert resumed[0][3]["sup_div"] == full[2][3]["sup_div"]
