"""Adaptive steps for particles and tokens (issue 38 item 4, spherepde.solvers.adaptive): the order
of the pairs' error estimates, exact solutions to the tolerance, convergence to a fine RK4 run as
rtol shrinks, steps that land on switch times, carried densities against the exact β = ∞ solution,
batched systems equal to single runs, resume equal to the uninterrupted run (solver and CLI), the
controller, and bad input."""

import math

import numpy as np
import pytest
import scipy.linalg
from run_configs import PAPER_VMF_CONFIG
from run_helpers import ROUND_OFF, interrupt_after, one_numba_thread, run_difference  # noqa: F401 (autouse: one numba thread)

from spherepde.analysis.exact import zero_temperature_density
from spherepde.cli import main
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import ProjectedNormal, Uniform, VonMisesFisher
from spherepde.models.schedule import Schedule
from spherepde.solvers.adaptive import PAIRS, StepControl, embedded_step
from spherepde.solvers.particles import ParticleSolver, quadrature_particles, token_systems, tokens_from_law
from spherepde.storage.runfile import open_run

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])
PAIR_NAMES = list(PAIRS)


def final(solver, x0, weights, t_end, log_f0=None):
    """(positions, log f) at t_end (snapshots at 0 and t_end)."""
    out = None
    for _, _, x, log_f in solver.snapshots(x0, weights, [0.0, t_end], log_f0):
        out = x, log_f
    return out


def two_tokens(d, angle):
    x = np.zeros((2, d))
    x[0, 0] = 1.0
    x[1, 0], x[1, 1] = math.cos(angle), math.sin(angle)
    return x


@pytest.mark.parametrize("name", PAIR_NAMES)
def test_the_error_estimate_and_the_local_error_have_the_pairs_orders(name):
    """One step from the same tokens (paper matrices, β = 5, d = 3) with h = 0.2, 0.1, 0.05: the
    estimate |x₁ − x̂₁| falls like h^(q+1) (q = p − 1; observed exponents within 0.4), the local
    error of x₁ against 64 RK4 steps of h/64 at least like h^(p+1), and below the estimate."""
    pair = PAIRS[name]
    model = AttentionModel(PAPER_B, PAPER_V, 5.0)
    x0, w = tokens_from_law(VonMisesFisher([0.6, 0.0, 0.8], 2.0), 40, 1)
    solver = ParticleSolver(model, "rk4", 1.0)

    def field(x):
        return solver.field(x[0], w)[0][None], None

    estimates, errors = [], []
    for h in (0.2, 0.1, 0.05):
        x1, x_hat, _, _, _ = embedded_step(pair, x0[None], None, np.array([h]), field)
        exact = x0
        for _ in range(64):
            exact = solver.step(exact, None, w, h / 64)[0]
        estimates.append(np.abs(x1[0] - x_hat[0]).max())
        errors.append(np.abs(x1[0] - exact).max())
    slopes = [math.log2(estimates[k] / estimates[k + 1]) for k in range(2)]
    assert all(abs(s - pair.embedded_order - 1) < 0.4 for s in slopes), (estimates, slopes)
    # the local error at least at the order: dopri5's h⁶ coefficient is small (its design), so h⁷
    # still shows at these h (slopes ~7), and below them the errors reach round-off
    slopes = [math.log2(errors[k] / errors[k + 1]) for k in range(2)]
    assert all(s > pair.order + 1 - 0.4 for s in slopes), (errors, slopes)
    assert all(e < est for e, est in zip(errors, estimates))  # the estimate bounds the error of x₁


@pytest.mark.parametrize("name, factor", [("dopri5", 1.0), ("bs32", 10.0)])
@pytest.mark.parametrize("d", [2, 4])
def test_two_tokens_without_attention_scores_close_to_the_tolerance(name, factor, d):
    """B = 0, V = I: tan(φ/2) = tan(φ₀/2) e^{−t} (as tests/solvers/test_tokens_any_d.py). The
    angle at t = 2 within factor·rtol for rtol = 1e-6 and 1e-9 (dopri5 within rtol; bs32's global
    error grows to a few rtol over its many steps), and fewer steps at the looser tolerance."""
    phi0 = 2.5
    model = AttentionModel(np.zeros((d, d)), np.eye(d), 3.0)
    exact = 2 * math.atan(math.tan(phi0 / 2) * math.exp(-2.0))
    steps = []
    for rtol in (1e-6, 1e-9):
        solver = ParticleSolver(model, name, 0.01, rtol=rtol)
        x, _ = final(solver, two_tokens(d, phi0), np.full(2, 0.5), 2.0)
        phi = math.acos(np.clip(x[0] @ x[1], -1, 1))
        assert abs(phi - exact) <= factor * rtol, (rtol, abs(phi - exact))
        np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-15)
        steps.append(int(solver.step_state()["steps"][0]))
    assert steps[0] < steps[1]


@pytest.mark.parametrize("name", PAIR_NAMES)
def test_tokens_converge_to_fine_rk4_as_rtol_shrinks(name):
    """Paper matrices, β = 10, 30 tokens to t = 3 against RK4 with dt = 1e-3: the largest position
    error falls with rtol (each tenfold step of rtol by more than 3×) and is below 20·rtol."""
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    x0, w = tokens_from_law(ProjectedNormal([0.3, 0.2, 0.1], np.diag([1.0, 0.8, 0.6])), 30, 2)
    reference, _ = final(ParticleSolver(model, "rk4", 1e-3), x0, w, 3.0)
    errors = []
    for rtol in (1e-4, 1e-5, 1e-6, 1e-7):
        x, _ = final(ParticleSolver(model, name, 0.01, rtol=rtol), x0, w, 3.0)
        errors.append(np.abs(x - reference).max())
        assert errors[-1] < 20 * rtol, (rtol, errors)
    assert all(errors[k + 1] < errors[k] / 3 for k in range(3)), errors


def test_steps_land_on_the_switch_of_layer():
    """Two layers switching at t = 0.537: the adaptive run (rtol 1e-9) agrees with RK4 at dt = 1e-3
    (whose steps land there) to 1e-8; a step across the switch would err by O(h) ~ 1e-2."""
    layers = Schedule([0.0, 0.537], [AttentionModel(PAPER_B, PAPER_V, 5.0),
                                     AttentionModel(np.eye(3), np.diag([1.0, -1.0, 0.5]), 5.0)])
    x0, w = tokens_from_law(Uniform(), 25, 4)
    reference, _ = final(ParticleSolver(layers, "rk4", 1e-3), x0, w, 1.2)
    for name in PAIR_NAMES:
        x, _ = final(ParticleSolver(layers, name, 0.3, rtol=1e-9), x0, w, 1.2)
        assert np.abs(x - reference).max() < 1e-8, name


def test_carried_density_at_zero_temperature_to_the_tolerance(mesh_factory):
    """β = ∞, quadrature particles in the local limit, B orthogonal: X_t = e^{tM}x₀/|e^{tM}x₀| and
    f(X_t) the exact push-forward density (as tests/solvers/test_particles.py); dopri5 at rtol 1e-8:
    positions within 1e-7 and log f within 1e-7 at t = 0.8 (the error norm includes log f)."""
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    law = ProjectedNormal([0.2, 0.1, 0.0], np.diag([1.0, 0.7, 0.5]))
    x0, w, logf0 = quadrature_particles(mesh_factory(4), law)
    t = 0.8
    y = x0 @ scipy.linalg.expm(t * model.M).T
    exact_x = y / np.linalg.norm(y, axis=1, keepdims=True)
    exact_log_f = np.log(zero_temperature_density(model, law, t)(exact_x))
    x, log_f = final(ParticleSolver(model, "dopri5", 0.01, carry_density=True, rtol=1e-8), x0, w, t, logf0)
    assert np.abs(x - exact_x).max() < 1e-7
    assert np.abs(log_f - exact_log_f).max() < 1e-7


@pytest.mark.parametrize("name", PAIR_NAMES)
def test_batched_systems_equal_single_runs(name):
    """d = 5, three systems batched: each with its own steps (their step counts differ), system k
    equals the single run of its tokens bitwise, through two layers (the switch a step lands on)."""
    d = 5
    rng = np.random.default_rng(7)
    layers = Schedule([0.0, 0.4], [AttentionModel(rng.normal(size=(d, d)), rng.normal(size=(d, d)), 4.0),
                                   AttentionModel(np.eye(d), rng.normal(size=(d, d)), 6.0)])
    x0, w = token_systems(VonMisesFisher(np.ones(d), 1.0), 30, 3, seed=2)
    batch = ParticleSolver(layers, name, 0.05, rtol=1e-7)
    out = list(batch.snapshots(x0, w, [0.0, 0.5, 1.0]))
    steps = batch.step_state()["steps"]
    assert len(set(steps.tolist())) > 1, steps
    for k in range(3):
        one = ParticleSolver(layers, name, 0.05, rtol=1e-7)
        single = list(one.snapshots(x0[k], w, [0.0, 0.5, 1.0]))
        for (_, _, xb, _), (_, _, xs, _) in zip(out, single):
            np.testing.assert_array_equal(xb[k], xs)
        assert one.step_state()["steps"][0] == steps[k]


@pytest.mark.parametrize("layered", [False, True])
def test_resumed_solver_equals_the_uninterrupted_one(layered):
    """Snapshots 0.25 apart to t = 1; resuming from snapshot 2 with the positions and the
    controller's state saved there repeats the rest bitwise, and the field evaluations add up to
    the uninterrupted run's (its first stage there was counted before). With layers switching at
    t = 0.5 (a snapshot: the new layer's first stage is a new evaluation in both)."""
    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    if layered:
        model = Schedule([0.0, 0.5], [model, AttentionModel(np.eye(3), PAPER_V, 7.0)])
    x0, w = tokens_from_law(VonMisesFisher([0.6, 0.0, 0.8], 3.0), 50, 3)
    times = [0.0, 0.25, 0.5, 0.75, 1.0]
    whole = ParticleSolver(model, "dopri5", 0.01, rtol=1e-6)
    states, evaluations = {}, {}
    snaps = []
    for k, _, x, _ in whole.snapshots(x0, w, times):
        snaps.append(x)
        states[k], evaluations[k] = whole.step_state(), whole.evaluations
    part = ParticleSolver(model, "dopri5", 0.01, rtol=1e-6)
    part.evaluations = evaluations[2]
    rest = list(part.snapshots(snaps[2], w, times, resume_from=2, step_state=states[2]))
    assert [k for k, *_ in rest] == [3, 4]
    for k, _, x, _ in rest:
        np.testing.assert_array_equal(x, snaps[k])
    assert part.evaluations == whole.evaluations
    for name, value in part.step_state().items():
        np.testing.assert_array_equal(value, states[4][name])


def test_the_controller():
    """A rejected step (err > 1, or NaN) shrinks h by at most 5 and counts; an accepted step
    grows it by at most 10, not at all right after a rejection; a step shortened to land keeps
    the proposed h."""
    control = StepControl(PAIRS["dopri5"], 4, 0.1)
    idx = np.arange(4)
    dt = np.full(4, 0.1)
    err = np.array([2.0, np.nan, 1e-12, 1e-12])
    accepted = np.array([False, False, True, True])
    control.update(idx, dt, err, accepted, np.array([False, False, False, True]), np.zeros(4, bool))
    assert 0.02 <= control.h[0] < 0.1 and control.h[1] == pytest.approx(0.02)
    assert control.h[2] == pytest.approx(1.0) and control.h[3] == pytest.approx(0.1)
    np.testing.assert_array_equal(control.steps, [0, 0, 1, 1])
    np.testing.assert_array_equal(control.rejected, [1, 1, 0, 0])
    control.update(np.array([2]), np.array([0.01]), np.array([0.5]), np.array([True]), np.array([False]),
                   np.array([True]))
    assert control.h[2] == pytest.approx(1.0)  # shortened to land: the proposal stays


def test_the_adaptive_schemes_refuse_noise_hardmax_tokens_and_bad_tolerances():
    from spherepde.models.noise import NoiseSchedule

    model = AttentionModel(PAPER_B, PAPER_V, 10.0)
    with pytest.raises(ValueError, match="no noise"):
        ParticleSolver(model, "dopri5", noise=NoiseSchedule(0.1))
    with pytest.raises(ValueError, match="rtol"):
        ParticleSolver(model, "bs32", rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="smooth field"):
        ParticleSolver(AttentionModel(PAPER_B, PAPER_V, math.inf), "dopri5")


# ---------------------------------------------------------------------- runs
RUN = PAPER_VMF_CONFIG.replace("{", "{{").replace("}", "}}") + """
[eulerian]
enabled = false

[particles]
n = 40
seed = 5
scheme = "dopri5"
rtol = 1e-6
{extra}

[time]
t_end = 1.0
save_every = 0.2
"""


@pytest.mark.parametrize("extra", ["", "systems = 3"])
def test_interrupted_adaptive_run_resumes_to_the_uninterrupted_one(tmp_path, extra):
    """One system and three batched: the controller's state is in the file per snapshot (per
    system when batched) and --resume continues from it to the uninterrupted run's file."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(extra=extra))
    whole, out = tmp_path / "whole.nc", tmp_path / "out.nc"
    assert main(["run", str(cfg), "-o", str(whole)]) == 0
    ds = open_run(whole)
    assert ds["particle_step_size"].dims == (("time", "system") if extra else ("time",))
    assert float(ds["particle_steps"].values[-1].min()) > 0 and ds.attrs["particle_rtol"] == 1e-6
    interrupt_after(cfg, out, 3)
    assert main(["run", str(cfg), "-o", str(out), "--resume"]) == 0
    assert run_difference(out, whole) <= ROUND_OFF
    assert "resumed from snapshot 2" in open_run(out).attrs["history"]


BAD = [
    ('particles.scheme="dopri6"', "[particles] scheme"),
    ("particles.rtol=-1e-6", "[particles] rtol"),
    ("particles.atol=0.5", "[particles] atol"),
    ("particles.rtol=0.0", "[particles] rtol"),
    ("model.noise=0.1", "[particles] scheme"),
    ('model.beta="inf"', "[particles] scheme"),
]


@pytest.mark.parametrize("change, key", BAD)
def test_bad_adaptive_input_exits_2(tmp_path, capsys, change, key):
    """One line naming the key, exit 2, no file: an unknown scheme, a negative rtol, atol above
    0.1, rtol + atol = 0, noise with an adaptive scheme, hardmax tokens (β = inf)."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(RUN.format(extra=""))
    assert main(["run", str(cfg), "-o", str(tmp_path / "bad.nc"), "--set", change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err
    assert not (tmp_path / "bad.nc").exists()
