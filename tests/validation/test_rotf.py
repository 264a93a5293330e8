"""The rotf phase-diagram suite (spherepde.validation.rotf): two tokens against their exact link
time, the span reduction against the run in the full dimension, the pair counts against numpy,
the crossing times against hand-made series, and the suite end to end on a tiny grid."""

import numpy as np
import numpy_reference as ref
from run_helpers import one_numba_thread  # noqa: F401 (autouse: one numba thread)
from scipy.integrate import solve_ivp

from spherepde.analysis.systems import CLUSTER_THRESHOLD, clustered_pair_counts
from spherepde.validation.rotf import (
    crossing_times,
    fraction_series,
    phase_diagram,
    run_suite,
    span_coordinates,
    two_token_link_time,
    uniform_systems,
)


def test_two_token_link_time_solves_the_angle_ode():
    """The quadrature T(c₀) against integrating dc/dt = 2(1 − c²)/(1 + e^{β(1−c)}) with scipy
    until c = 0.999 (an independent route to the same closed form)."""
    for beta, c0 in ((0.5, -0.3), (4.0, 0.2), (12.0, 0.6)):
        def hit(t, c):
            return c[0] - CLUSTER_THRESHOLD
        hit.terminal = True
        sol = solve_ivp(lambda t, c, b=beta: 2 * (1 - c ** 2) / (1 + np.exp(b * (1 - c))), (0, 1e4), [c0],
                        events=hit, rtol=1e-11, atol=1e-13)
        assert abs(sol.t_events[0][0] - two_token_link_time(c0, beta)) < 1e-6 * sol.t_events[0][0]


def test_two_tokens_link_at_the_exact_time():
    """n = 2 tokens in d = 3 (the solver and the pair count of the suite): at every save time the
    pair is counted as clustered exactly when t is past the exact link time T(c₀) (saves within
    0.01 of T left out), for 12 systems with spread initial angles and β = 0.5 and 6."""
    rng = np.random.default_rng(4)
    e1 = np.array([1.0, 0.0, 0.0])
    times = np.linspace(0.0, 12.0, 241)
    for beta, c0 in ((0.5, np.linspace(-0.6, 0.9, 12)), (6.0, np.linspace(0.45, 0.95, 12))):
        x0 = np.empty((12, 2, 3))
        for k, c in enumerate(c0):  # a random orthonormal frame per system: c₀ = ⟨x₁, x₂⟩ exactly
            q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
            x0[k, 0] = q @ e1
            x0[k, 1] = q @ np.array([c, np.sqrt(1 - c * c), 0.0])
        series, _ = fraction_series(x0, beta, times, rtol=1e-8)
        exact = np.array([two_token_link_time(c, beta) for c in c0])
        assert 0.2 < exact.min() and exact.max() < 11.5 and np.ptp(exact) > 1.5  # links inside the window
        clear = np.abs(times[:, None] - exact[None, :]) > 0.01
        expected = (times[:, None] > exact[None, :]).astype(float)
        np.testing.assert_array_equal(series[clear], expected[clear])


def test_span_coordinates_keep_the_gram_matrix_and_the_run():
    """d = 40 > n = 6: the coordinates in the span (R^6) have the same Gram matrix, and the
    clustered fractions of a run in R^40 (the solver directly) equal those of the reduced run."""
    x = uniform_systems(5, 6, 40, seed=2)
    y = span_coordinates(x)
    assert y.shape == (5, 6, 6)
    np.testing.assert_allclose(np.einsum("kid,kjd->kij", y, y), np.einsum("kid,kjd->kij", x, x), atol=1e-13)
    times = np.linspace(0.0, 8.0, 17)
    reduced, _ = fraction_series(x, 1.0, times)
    from spherepde.models.attention import AttentionModel
    from spherepde.solvers.particles import ParticleSolver
    from spherepde.validation.rotf import clustered_fraction

    solver = ParticleSolver(AttentionModel(np.eye(40), np.eye(40), 1.0), "rk4", 0.01)
    full = np.array([clustered_fraction(xt) for _, _, xt, _ in solver.snapshots(x, np.full(6, 1 / 6), times)])
    assert full[-1].mean() > 0.5 and full[0].max() == 0  # the run clusters within the window
    np.testing.assert_array_equal(reduced, full)
    assert span_coordinates(uniform_systems(2, 6, 4, seed=1)).shape == (2, 6, 4)  # d ≤ n: unchanged


def test_clustered_pair_counts_against_numpy():
    """The kernel against the thresholded Gram matrix, on tight clusters and random tokens."""
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(3, 5))
    tight = centres[rng.integers(0, 3, 40)] + 0.005 * rng.normal(size=(40, 5))
    x = np.stack([tight, rng.normal(size=(40, 5)), np.tile(centres[:1], (40, 1))])
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    counts = np.empty(3, dtype=np.int64)
    clustered_pair_counts(x, CLUSTER_THRESHOLD, counts)
    np.testing.assert_array_equal(counts, ref.clustered_pair_counts(x, CLUSTER_THRESHOLD))
    assert counts[2] == 40 * 39 // 2 and 0 < counts[0] < counts[2]


def test_crossing_times_interpolate_and_censor():
    """Linear crossing between saves, 0 when already reached, inf when never."""
    times = np.array([0.0, 1.0, 2.0, 3.0])
    f = np.array([[0.0, 0.6, 0.0], [0.2, 0.7, 0.1], [0.8, 0.8, 0.2], [1.0, 1.0, 0.4]])
    np.testing.assert_allclose(crossing_times(times, f), [1.5, 0.0, np.inf])


def test_the_suite_on_a_tiny_grid(tmp_path):
    """The suite's functions on 24 systems, d = 2 and 8, β = 0.1 and 20, to t = 12: at β = 0.1
    (almost uniform weights: every token moves toward its system's mean) every system of d = 8
    is one cluster by t = 12, nearly every one of d = 2; at β = 20 the mean fraction is still below ½ then (each token attends
    mostly to itself); fractions lie in [0, 1]. run_suite writes the report and the figure."""
    result = phase_diagram(dimensions=(2, 8), betas=(0.1, 20.0), systems=24, saves=13, t_end=12.0)
    frac = result["fraction"]
    assert np.all((frac >= 0) & (frac <= 1)) and np.all(frac[:, 0, 0] == frac[:, 1, 0])  # same tokens per d
    assert frac[1, 0, 0] == 0 and frac[0, 0, 0] < 0.05  # on the circle a few pairs start within 2.56°
    assert frac[1, 0, -1] == 1.0 and frac[0, 0, -1] > 0.95  # d = 2: tokens spread round the circle are slower
    assert np.all(frac[:, 1, -1] < 0.5)
    t, lo, hi = result["half"][(8, 0.1)]
    assert 0 < lo <= t <= hi < 12
    assert np.isinf(result["half"][(8, 20.0)][0])

    from spherepde.validation import rotf

    small = {"systems": {2: 8, 8: 8, 128: 4}, "betas": (0.5, 20.0), "saves": 7}
    original = rotf.QUICK
    rotf.QUICK = small
    try:
        run_suite(tmp_path, quick=True, progress=False)
    finally:
        rotf.QUICK = original
    text = (tmp_path / "rotf.md").read_text()
    assert (tmp_path / "phase_diagram.png").stat().st_size > 10_000 and (tmp_path / "rotf.nc").is_file()
    assert text.count("| 128 | ") == 2 and "B = QᵀK = I and V = I" in text
    assert "## Time-step check" in text and "the same systems cross by t_end: yes" in text
