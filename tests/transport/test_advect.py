"""Transport core: conservation, positivity, free-stream preservation, convergence."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from spherepde.transport import FluxDivergence, SSPStepper, advect, velocity_edge_flux


def linear_field(A, b=None, C=None):
    """Divergent, time-dependent test flow v(t, x) = P_x((A + sin(2t) C) x + b)."""
    b = np.zeros(3) if b is None else b
    C = np.zeros((3, 3)) if C is None else C

    def velocity(t, x):
        u = x @ (A + math.sin(2 * t) * C).T + b
        return u - np.sum(u * x, axis=1, keepdims=True) * x

    return velocity


def rotated_gaussian(axis, angle, centre, width):
    """Exact solution of solid-body rotation of a Gaussian bump: the bump at the rotated centre."""
    axis = axis / np.linalg.norm(axis)
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    R = np.eye(3) + math.sin(angle) * K + (1 - math.cos(angle)) * K @ K
    c = R @ centre
    return lambda x: np.exp(-np.sum((x - c) ** 2, axis=1) / width**2)


@pytest.mark.parametrize("scheme", ["upwind", "muscl"])
def test_mass_conserved_over_1000_steps(mesh_factory, scheme):
    m = mesh_factory(8)
    rng = np.random.default_rng(0)
    A = rng.normal(size=(3, 3))
    f = rng.random(m.npix)
    mass0 = m.integrate(f)
    stepper = SSPStepper(FluxDivergence(m, scheme), velocity_edge_flux(m, linear_field(A)), order=3)
    t = 0.0
    for _ in range(1000):
        f, dt = stepper.step(f, t, 1.0)
        t += dt
    assert stepper.steps == 1000
    assert abs(m.integrate(f) - mass0) < 1e-13 * mass0
    assert f.min() >= -1e-14 * f.max()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    scheme=st.sampled_from(["upwind", "muscl"]),
    cfl=st.sampled_from([0.5, 0.25]),
    rk_order=st.sampled_from([2, 3]),
    zero_fraction=st.floats(0.0, 0.9),
)
def test_positivity_random_divergent_flows(mesh_factory, seed, scheme, cfl, rk_order, zero_fraction):
    m = mesh_factory(4)
    rng = np.random.default_rng(seed)
    A, C = rng.normal(size=(3, 3)) * 3, rng.normal(size=(3, 3))
    b = rng.normal(size=3)
    f0 = rng.random(m.npix) ** 4 * 10 ** rng.uniform(-3, 3)
    f0[rng.random(m.npix) < zero_fraction] = 0.0
    res = advect(m, f0, linear_field(A, b, C), 0.5, scheme=scheme, cfl=cfl, rk_order=rk_order,
                 full_output=True)
    f = res.density
    assert f.min() >= -1e-14 * max(f.max(), 1e-300)
    assert abs(m.integrate(f) - m.integrate(f0)) <= 1e-13 * m.integrate(f0) + 1e-300
    assert res.max_courant <= max(cfl, 0.5 if scheme == "muscl" else 1.0) * (1 + 1e-12)


@pytest.mark.parametrize("scheme", ["upwind", "muscl"])
def test_free_stream_with_stream_function(mesh_factory, scheme):
    """A solenoidal flow through exact edge fluxes ψ(A) − ψ(B): a constant stays constant."""
    m = mesh_factory(16)
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=3), rng.normal(size=3)

    def psi(t, x):  # time-dependent, non-zonal stream function
        return np.sin(3 * x @ a + t) + (x @ b) ** 2 * np.cos(t)

    f = advect(m, np.full(m.npix, 2.5), None, 0.3, scheme=scheme, stream_function=psi)
    assert np.abs(f - 2.5).max() < 1e-13


def test_free_stream_solid_body_rotation_velocity(mesh_factory):
    """Through the velocity path the discrete divergence is the edge-quadrature error only: it is
    largest at the pixels next to the poles (about 2e-4 relative per edge with two points) and
    falls quickly with more points."""
    omega = np.array([0.3, -1.0, 2.0])
    dev = {}
    for nq in (2, 3):
        m = mesh_factory(16, nq)
        f = advect(m, np.ones(m.npix), lambda t, x: np.cross(omega, x), 0.5, scheme="muscl")
        dev[nq] = np.abs(f - 1)
    assert dev[2].max() < 2e-3 and np.median(dev[2]) < 1e-7
    assert dev[3].max() < dev[2].max() / 10


def test_stream_function_matches_velocity_path(mesh_factory):
    """ψ = −ω·x is solid-body rotation v = ω × x: both inputs give the same solution."""
    m = mesh_factory(16)
    omega = np.array([0.0, 1.0, 1.0]) * math.pi
    centre = np.array([1.0, 0, 0])
    f0 = m.cell_average(rotated_gaussian(omega, 0.0, centre, 0.4))
    exact = m.cell_average(rotated_gaussian(omega, 0.4 * np.linalg.norm(omega), centre, 0.4))
    fv = advect(m, f0, lambda t, x: np.cross(omega, x), 0.4)
    fs = advect(m, f0, None, 0.4, stream_function=lambda t, x: -(x @ omega))
    err_v, err_s = np.abs(fv - exact).max(), np.abs(fs - exact).max()
    # the two differ by how the flux is split among the Gauss points: far below the scheme error
    assert np.abs(fv - fs).max() < 0.1 * min(err_v, err_s)
    assert err_v < 0.1 * f0.max() and err_s < 0.1 * f0.max()


def rotation_error(m, scheme):
    axis = np.array([0.2, 0.5, 1.0])
    omega = axis / np.linalg.norm(axis) * 2 * math.pi
    centre = np.array([1.0, 0.0, 0.0])
    t_end = 0.25
    f0 = m.cell_average(rotated_gaussian(axis, 0.0, centre, 0.5))
    exact = m.cell_average(rotated_gaussian(axis, 2 * math.pi * t_end, centre, 0.5))
    f = advect(m, f0, lambda t, x: np.cross(omega, x), t_end, scheme=scheme, rk_order=3)
    return math.sqrt(np.sum((f - exact) ** 2) / np.sum(exact**2))


def test_convergence_orders(mesh_factory):
    """Smooth wide bump, quarter revolution: observed l₂ orders ≈ 1 (upwind) and ≈ 2 (MUSCL)."""
    e = {(s, n): rotation_error(mesh_factory(n), s) for s in ("upwind", "muscl") for n in (8, 16, 32)}
    up = math.log2(e["upwind", 16] / e["upwind", 32])
    mu = math.log2(e["muscl", 16] / e["muscl", 32])
    assert 0.7 < up < 1.3, e
    assert mu > 1.5, e
    assert e["muscl", 32] < 0.2 * e["upwind", 32]


def test_lands_on_t_end_and_reports(mesh_factory):
    m = mesh_factory(4)
    seen = []
    res = advect(m, np.ones(m.npix), linear_field(np.eye(3)), 0.3, callback=lambda t, f: seen.append(t),
                 full_output=True)
    assert seen[-1] == 0.3 and res.time == 0.3
    assert len(seen) == res.steps
    assert all(b > a for a, b in zip(seen, seen[1:]))


def test_bad_arguments(mesh_factory):
    m = mesh_factory(2)
    v = linear_field(np.eye(3))
    with pytest.raises(ValueError, match="scheme"):
        advect(m, np.ones(m.npix), v, 1.0, scheme="weno")
    with pytest.raises(ValueError, match="f0"):
        advect(m, np.ones(5), v, 1.0)
    with pytest.raises(ValueError, match="exactly one"):
        advect(m, np.ones(m.npix), v, 1.0, stream_function=lambda t, x: x[:, 0])
    with pytest.raises(ValueError, match="cfl"):
        advect(m, np.ones(m.npix), v, 1.0, cfl=0.0)
    with pytest.raises(ValueError, match="rk order"):
        advect(m, np.ones(m.npix), v, 1.0, rk_order=4)
