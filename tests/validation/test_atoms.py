"""The atoms validation suite (spherepde/validation/atoms.py): the coarsened W₂ and its certified bound
against exact OT, the departure time on series with a known answer, the two-atom rate against
its closed form, the sweep files, and the whole report on tiny runs."""

import math

import numpy as np
import pytest
import xarray as xr

from spherepde.models.attention import AttentionModel
from spherepde.validation import atoms
from spherepde.validation.lagrangian import w2_exact

PAPER_V = np.diag([-1.0, 1.0, -2.0])
PAPER_B = np.diag([-1.0, -1.0, 1.0])


def _cloud(rng, n, centre, spread):
    x = np.asarray(centre, dtype=float) + spread * rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_coarsening_keeps_mass_and_first_moment_and_its_cost_is_the_exact_spread():
    rng = np.random.default_rng(3)
    x = np.concatenate([_cloud(rng, 700, [1, 0, 0], 0.05), _cloud(rng, 300, [0, -1, 0], 0.3)])
    w = rng.random(len(x))
    bary, mass, cost = atoms.coarsen(x, w, max_bins=60)
    assert len(mass) <= 60
    np.testing.assert_allclose(mass.sum(), w.sum(), rtol=1e-13)
    np.testing.assert_allclose(mass @ bary, w @ x, rtol=1e-12, atol=1e-12)
    # c = Σ_i w_i |x_i − x̄_b(i)|²: recompute it from an independent assignment of points to bins
    # (each point's nearest barycentre is not its bin in general, so recompute via the second moments)
    spread_total = float(w @ np.einsum("ij,ij->i", x, x) - np.einsum("i,ij,ij->", mass, bary, bary))
    np.testing.assert_allclose(cost, spread_total, rtol=1e-9)
    # a finer partition moves mass less
    assert atoms.coarsen(x, w, max_bins=400)[2] < cost


def test_coarsened_w2_is_within_its_bound_of_exact_ot():
    rng = np.random.default_rng(7)
    xa = np.concatenate([_cloud(rng, 500, [1, 0, 0], 0.03), _cloud(rng, 200, [-1, 0.2, 0], 0.2)])
    xb = np.concatenate([_cloud(rng, 400, [1, 0.05, 0], 0.02), _cloud(rng, 350, [-1, 0, 0.1], 0.1)])
    wa, wb = rng.random(len(xa)), rng.random(len(xb))
    exact = w2_exact(xa, wa, xb, wb)
    for bins in (30, 120, 600):
        value, bound = atoms.w2_coarsened(xa, wa, xb, wb, max_bins=bins)
        assert abs(value - exact) <= bound + 1e-12
    # enough bins for every point: exact
    value, bound = atoms.w2_coarsened(xa, wa, xb, wb, max_bins=5000)
    assert bound < 1e-3 and abs(value - exact) <= bound + 1e-12


def test_point_masses_are_never_split():
    x = np.array([[1.0, 0, 0]] * 5 + [[0, 1.0, 0]] * 3)
    bary, mass, cost = atoms.coarsen(x, np.ones(8), max_bins=100)
    assert cost < 1e-24 and sorted(mass.tolist()) == [3.0, 5.0]


def test_departure_time_is_the_crossing_after_the_maximum():
    t = np.linspace(0, 10, 101)
    e = np.where(t < 3, 0.5 + t / 6, 1.0 - 0.05 * (t - 3) ** 2)  # max 1 at t = 3, 0.9 at t = 3 + √2
    ds = xr.Dataset({"alignment_E": ("time", e)}, coords={"time": t})
    assert atoms.departure_time(ds, 0.9) == pytest.approx(3 + math.sqrt(2), abs=2e-3)
    assert math.isnan(atoms.departure_time(ds, -2.0))  # never that low


@pytest.mark.parametrize("beta", [3.0, 10.0])
def test_two_atom_rate_is_the_closed_form(beta):
    model = AttentionModel(PAPER_B, PAPER_V, beta)
    assert atoms.two_atom_rate(model) == pytest.approx(math.tanh(beta) * (PAPER_V[0, 0] - PAPER_V[2, 2]), rel=1e-6)


def test_exact_zero_temperature_measure_is_the_push_forward():
    from spherepde.models.initial import Uniform

    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    x, w = atoms.exact_zero_temperature(model, Uniform(), 0.0, n_s=20, n_phi=16)
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
    y, _ = atoms.exact_zero_temperature(model, Uniform(), 3.0, n_s=20, n_phi=16)
    # x ↦ e^{tM}x/|·| with M = diag(1, −1, −2): x₂/x₁ scales by e^{−2t}, x₃/x₁ by e^{−3t}
    keep = np.abs(x[:, 0]) > 0.1
    np.testing.assert_allclose(y[keep, 1] / y[keep, 0], np.exp(-6.0) * x[keep, 1] / x[keep, 0], rtol=1e-10)
    np.testing.assert_allclose(y[keep, 2] / y[keep, 0], np.exp(-9.0) * x[keep, 2] / x[keep, 0], rtol=1e-10)


def test_graded_quadrature_integrates_the_area_measure():
    axis = np.array([1.0, 2.0, 2.0]) / 3.0
    x, w = atoms.graded_quadrature(axis, n_s=200, n_phi=32)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(w.sum(), 4 * math.pi, rtol=1e-13)
    # ∫ (x·u)² dA = 4π/3 for any unit u; ∫ x₁⁴ dA = 4π/5
    for u in (axis, np.array([0.0, 0.6, 0.8])):
        np.testing.assert_allclose(w @ (x @ u) ** 2, 4 * math.pi / 3, rtol=1e-10)
    np.testing.assert_allclose(w @ x[:, 0] ** 4, 4 * math.pi / 5, rtol=1e-6)  # degree 4 in s: not exact
    # the band |x·u| < δ around the circle x·u = 0 is resolved: its area is 2π·2δ
    s = x @ axis
    np.testing.assert_allclose(w[np.abs(s) < 1e-9].sum(), 4 * math.pi * 1e-9, rtol=0.2)


def test_exact_zero_temperature_carries_the_far_mass_of_the_repelling_band():
    """At β = ∞, t = 8 the mean squared chord to the nearest of ±e₁, E 2(1 − |y₁|), comes from the
    band |x₁| ≲ e^{−2t} around the repelling circle; the graded reference gets it to 1e-3, checked
    against adaptive quadrature in (s, φ) (dA = ds dφ) with its breakpoints on that scale."""
    from scipy.integrate import quad

    from spherepde.models.initial import Uniform

    t = 8.0
    model = AttentionModel(PAPER_B, PAPER_V, math.inf)
    y, w = atoms.exact_zero_temperature(model, Uniform(), t)
    graded = float(w @ (2.0 * (1.0 - np.abs(y[:, 0]))))

    def inner(s):
        r = math.sqrt(1.0 - s * s)

        def chord(phi):
            a, b, c = math.exp(t) * s, math.exp(-t) * r * math.cos(phi), math.exp(-2 * t) * r * math.sin(phi)
            return 2.0 * (1.0 - abs(a) / math.sqrt(a * a + b * b + c * c))

        return quad(chord, 0.0, 2 * math.pi, limit=200)[0]

    breaks = [0.0] + list(np.geomspace(1e-12, 1.0, 60))
    exact = 2 * sum(quad(inner, lo, hi, limit=200)[0] for lo, hi in zip(breaks[:-1], breaks[1:])) / (4 * math.pi)
    assert exact > 1e-7  # the far mass is there: W₂ to the two atoms ≈ √exact ≈ 4e-4
    assert graded == pytest.approx(exact, rel=1e-3)


def test_sweep_files_expand():
    from spherepde.runner.sweep import expand

    assert len(expand(atoms.CONVERGENCE)) == 12
    assert len(expand(atoms.ZERO_TEMPERATURE)) == 3
    specs = expand(atoms.SYMMETRIC)
    assert len(specs) == 5
    for spec in specs[1:]:  # the perturbed laws: symmetric under x → −x and x₂ → −x₂
        comps = spec.config["initial"]["components"]
        np.testing.assert_allclose(comps[1]["mu"], -np.asarray(comps[2]["mu"]))
        assert comps[1]["mu"][1] == 0.0


def test_report_from_tiny_runs(tmp_path):
    """Every section of the report from nside-4 runs to t = 1 (the machinery, not the science)."""
    report = atoms.run_suite(tmp_path, quick=True, nsides=(4,), t_end=1.0, cost=False, progress=False)
    text = report.read_text()
    for heading in ("Mesh convergence", "The mass that crosses", "W₂(Eulerian + atoms, quadrature particles)",
                    "β = ∞ against the exact push-forward", "The symmetric case"):
        assert heading in text
    assert "| projected_normal | 10 | F-onset |" in text and "| vmf | 30 |" in text
    assert (report.parent / "atoms.png").is_file()


def test_onset_target_compares_nside_32_with_the_particles_on_the_finest_mesh():
    """The issue's 2 % target: the Eulerian onset at nside 32 against the particles' onset on the
    finest mesh of the same case (the gap is computed from the given numbers, so it can fail)."""
    from types import SimpleNamespace

    def case(nside, eul, part):
        return SimpleNamespace(law="vmf", beta=10.0, nside=nside,
                               metrics={"eulerian": {"onset": eul}, "particles": {"onset": part}})

    cases = [case(16, 6.0, 6.5), case(32, 6.181, 6.151), case(64, 6.233, 6.109)]
    row = atoms.onset_target_table(cases)[2]
    assert "6.181" in row and "6.109 (64)" in row and "+1.18 %" in row and row.endswith("| yes |")
    far = atoms.onset_target_table([case(32, 7.0, 6.0)])[2]
    assert "+16.67 %" in far and far.endswith("| no |")
