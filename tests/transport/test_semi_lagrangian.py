"""Semi-Lagrangian transport of log f (spherepde.transport.semi_lagrangian): the interpolation
kernel against its NumPy reference and at third order on a smooth function; the transport
against the exact β = ∞ solution of the paper's matrices (docs/theory.md, formulas)."""

import math

import numpy as np
import numpy_reference as ref
import pytest
import scipy.linalg

from spherepde.transport.semi_lagrangian import PolynomialInterpolant, advance_log_density, polynomial_interpolate, trace_back

M = np.diag([-1.0, 1.0, -2.0]) @ np.diag([-1.0, -1.0, 1.0]).T  # V Bᵀ of the paper's matrices


def random_points(n, seed):
    x = np.random.default_rng(seed).normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def smooth(x):
    return np.sin(3 * x[:, 0]) + x[:, 1] * x[:, 2] - 2 * x[:, 2] ** 2


@pytest.mark.parametrize("limited", [False, True])
@pytest.mark.parametrize("degree", [2, 3])
def test_kernel_equals_the_numpy_reference(mesh_factory, limited, degree):
    mesh = mesh_factory(8)
    interp = PolynomialInterpolant(mesh, degree=degree, limited=limited)
    values = np.random.default_rng(1).normal(size=mesh.npix)
    points = random_points(500, 2)
    cells = interp.cells_of(points)
    out = np.empty(500)
    polynomial_interpolate(values, interp.stencil, interp.fits, np.ascontiguousarray(interp._monomials_at(points, cells)),
                           cells, limited, out)
    expect = ref.polynomial_interpolate(values, interp.stencil, interp.fits, interp.e1, interp.e2, interp.centroids,
                                        cells, points, degree, limited)
    np.testing.assert_allclose(out, expect, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(interp(values, points), expect, rtol=1e-12, atol=1e-12)


def test_the_stencils_are_the_cell_and_its_rings_of_neighbours(mesh_factory):
    """Degree 2: the cell and its 8 neighbours (7 at the 24 cells beside a vertex of 3 base faces);
    degree 3: two rings, 25 distinct cells (fewer there); every entry a distinct cell."""
    import healpy as hp

    mesh = mesh_factory(8)
    two, three = PolynomialInterpolant(mesh), PolynomialInterpolant(mesh, degree=3)
    assert two.stencil.shape == (mesh.npix, 9) and three.fits.shape[1:] == (10, three.stencil.shape[1])
    assert np.sum(two.stencil < 0) == 24
    counts = np.sum(three.stencil >= 0, axis=1)
    assert counts.max() == 25 and np.sum(counts < 25) > 0
    for c in (0, 77, 400):
        row = three.stencil[c][three.stencil[c] >= 0]
        ring = set(hp.get_all_neighbours(8, c, nest=True)) - {-1}
        second = set(hp.get_all_neighbours(8, np.array(sorted(ring)), nest=True).ravel()) - {-1}
        assert row[0] == c and len(set(row)) == len(row) and set(row) == ring | second | {c}
    with pytest.raises(ValueError, match="degree must be 2 or 3"):
        PolynomialInterpolant(mesh, degree=4)


def test_the_limited_interpolant_makes_no_new_extremum_at_a_cut(mesh_factory):
    """A step in g (a cell lowered by ten decades, as an atom's creation may leave it): the
    unlimited quadratic overshoots beyond the values around it, the limited one stays in range."""
    mesh = mesh_factory(8)
    g = np.zeros(mesh.npix)
    g[100] = -23.0
    points = random_points(20000, 4)
    unlimited, limited = PolynomialInterpolant(mesh)(g, points), PolynomialInterpolant(mesh, limited=True)(g, points)
    assert unlimited.max() > 1.0  # e^{g} overshoots the plateau f = 1 by a factor e
    assert limited.max() <= 0.0 and limited.min() >= -23.0
    averages = PolynomialInterpolant(mesh, limited=True).cell_averages_of_exp(g)
    assert averages.max() <= 1.0 + 1e-12


def test_interpolation_of_a_smooth_function_is_third_order(mesh_factory):
    points = random_points(2000, 3)
    errors = []
    for nside in (16, 32):
        interp = PolynomialInterpolant(mesh_factory(nside))
        errors.append(np.abs(interp(smooth(interp.centroids), points) - smooth(points)).max())
    assert math.log2(errors[0] / errors[1]) > 2.7, errors


def test_interpolation_of_degree_3_is_fourth_order_and_beats_degree_2(mesh_factory):
    points = random_points(2000, 3)
    errors = []
    for nside in (16, 32):
        interp = PolynomialInterpolant(mesh_factory(nside), degree=3)
        errors.append(np.abs(interp(smooth(interp.centroids), points) - smooth(points)).max())
    quadratic = PolynomialInterpolant(mesh_factory(32))
    assert math.log2(errors[0] / errors[1]) > 3.5, errors
    assert errors[1] < 0.5 * np.abs(quadratic(smooth(quadratic.centroids), points) - smooth(points)).max()


def field(s, x):
    """The β = ∞ field of the paper's matrices (B orthogonal): v = P_x(Mx), div_S v = tr M − 3xᵀMx."""
    u = x @ M.T
    return u - np.sum(u * x, axis=1, keepdims=True) * x, np.trace(M) - 3 * np.sum(x * u, axis=1)


def transported_error(mesh, dt, t_end):
    """(median, 90th percentile of |f_h/f − 1| over the tail, min f_h / min f) at t_end from the
    uniform law, against f_t(y) = e^{2t}/(4π|e^{−tM}y|³) at the centroids."""
    interp = PolynomialInterpolant(mesh)
    g = np.full(mesh.npix, -math.log(4 * math.pi))
    for k in range(int(round(t_end / dt))):
        g = advance_log_density(interp, g, field, k * dt, dt)
    z = mesh.centroids @ scipy.linalg.expm(-t_end * M).T
    exact = 2 * t_end - math.log(4 * math.pi) - 3 * np.log(np.linalg.norm(z, axis=1))
    tail = exact < exact.max() + math.log(1e-3)
    rel = np.abs(np.expm1(g - exact))[tail]
    return np.median(rel), np.percentile(rel, 90), math.exp(g.min() - exact.min())


def test_transport_against_the_exact_solution(mesh_factory):
    """t = 4, Δt = 0.2: the tail's 90th percentile falls ≥ 8× from nside 16 to 32 (third order or
    better) and is below 1 % at nside 32; min f within 1e-3. The finite volumes are at 1.9 / 0.30
    there (validation/reports/tails/tails.md)."""
    coarse = transported_error(mesh_factory(16), 0.2, 4.0)
    fine = transported_error(mesh_factory(32), 0.2, 4.0)
    assert fine[1] < coarse[1] / 8 and fine[1] < 0.01, (coarse, fine)
    assert fine[0] < 1e-3 and abs(fine[2] - 1) < 1e-3 and abs(coarse[2] - 1) < 1e-3


def test_the_paths_are_fourth_order_in_time(mesh_factory):
    """On a fine mesh the error of the median is the paths' and Simpson's: halving Δt divides it
    by ≥ 8 (t = 2, nside 64 so that the interpolation error is far below)."""
    mesh = mesh_factory(64)
    a = transported_error(mesh, 0.4, 2.0)[0]
    b = transported_error(mesh, 0.2, 2.0)[0]
    assert a / b > 8, (a, b)


def path_errors(x, dt, steps, scheme):
    """Largest errors of trace_back's departure points and divergence integrals over dt in `steps`
    steps against the exact flow x₀ = e^{−dt M}y/|e^{−dt M}y| and ∫div = 3 ln|e^{−dt M}y| − 2dt
    (the uniform law's log density, which starts constant), and the calls of the field."""
    calls = []

    def counted(s, points):
        calls.append(s)
        return field(s, points)

    feet, integral = trace_back(x, counted, 0.0, dt, steps, scheme)
    z = x @ scipy.linalg.expm(-dt * M).T
    exact_feet = z / np.linalg.norm(z, axis=1, keepdims=True)
    exact_integral = 3 * np.log(np.linalg.norm(z, axis=1)) - 2 * dt
    return np.abs(feet - exact_feet).max(), np.abs(integral - exact_integral).max(), len(calls)


@pytest.mark.parametrize("scheme, stages", [("rk4", 3), ("heun", 1)])
def test_a_velocity_alone_serves_the_stages_whose_div_no_rule_uses(scheme, stages):
    """trace_back with velocity given: the stages whose div v neither Simpson's rule nor the
    trapezoidal rule uses (RK4's second to fourth, Heun's predictor) call it instead of the field,
    and the paths are those without it to the bit when it returns the field's v; a velocity off by
    a constant rotation moves the departure points, so it is the one used."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    fields, velocities = [], []

    def counted(s, points):
        fields.append(s)
        return field(s, points)

    def velocity(s, points):
        velocities.append(s)
        return field(s, points)[0]

    plain = trace_back(x, field, 0.0, 0.4, 4, scheme)
    given = trace_back(x, counted, 0.0, 0.4, 4, scheme, velocity)
    assert np.array_equal(plain[0], given[0]) and np.array_equal(plain[1], given[1])
    # 5n + 1 calls for n RK4 steps, 2n + 1 by the trapezoidal rule, as without it
    assert len(velocities) == stages * 4 and len(fields) + len(velocities) == (5 if scheme == "rk4" else 2) * 4 + 1
    spin = trace_back(x, field, 0.0, 0.4, 4, scheme, lambda s, p: field(s, p)[0] + 0.1 * np.cross([0.0, 0.0, 1.0], p))
    assert np.abs(spin[0] - plain[0]).max() > 1e-3


@pytest.mark.parametrize("scheme, order, calls", [("rk4", 4, 6), ("heun", 2, 3)])
def test_path_schemes_converge_at_their_order(scheme, order, calls):
    """trace_back over Δt = 0.4 in 2, 4, 8 steps: the observed orders of the departure points and
    of ∫div v are those of RK4 with Simpson (4) and of the trapezoidal rule (2), within 0.5 of it;
    the trapezoidal rule calls the field at the ends of each step only, 2 times a step against 5
    (and once more at the arrival)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    errors = [path_errors(x, 0.4, steps, scheme) for steps in (2, 4, 8)]
    for k in range(2):  # departure points, integrals
        observed = [math.log2(a[k] / b[k]) for a, b in zip(errors, errors[1:])]
        assert all(abs(p - order) < 0.5 for p in observed), (scheme, k, observed)
    # the field at a step's departure points starts the next step: one call fewer per step after the first
    assert [e[2] for e in errors] == [(calls - 1) * n + 1 for n in (2, 4, 8)]
    with pytest.raises(ValueError, match="scheme"):
        trace_back(x, field, 0.0, 0.4, 1, "euler")


def test_paths_through_given_step_boundaries():
    """trace_back through step boundaries: equal ones are the equal steps (to round-off); graded
    ones (each step 1.5× the last), halved, converge at RK4's order against the exact flow; ones
    that do not span [t, t + dt] in increasing order are refused."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    equal = trace_back(x, field, 0.0, 0.4, 4)
    given = trace_back(x, field, 0.0, 0.4, np.linspace(0.0, 0.4, 5))
    assert np.abs(equal[0] - given[0]).max() < 1e-14 and np.abs(equal[1] - given[1]).max() < 1e-14
    z = x @ scipy.linalg.expm(-0.4 * M).T
    exact = z / np.linalg.norm(z, axis=1, keepdims=True), 3 * np.log(np.linalg.norm(z, axis=1)) - 0.8
    errors = []
    widths = 1.5 ** np.arange(3)
    edges = np.concatenate([[0.0], np.cumsum(widths)]) * 0.4 / widths.sum()
    for _ in range(3):
        feet, integral = trace_back(x, field, 0.0, 0.4, edges)
        errors.append((np.abs(feet - exact[0]).max(), np.abs(integral - exact[1]).max()))
        edges = np.sort(np.concatenate([edges, 0.5 * (edges[1:] + edges[:-1])]))  # every step halved
    for k in range(2):
        observed = [math.log2(a[k] / b[k]) for a, b in zip(errors, errors[1:])]
        assert all(p > 3.3 for p in observed), (k, observed, errors)
    for bad in ([0.0, 0.3, 0.2, 0.4], [0.0, 0.4, 0.4], [0.1, 0.4], [0.0, 0.3], [[0.0, 0.4]]):
        with pytest.raises(ValueError, match="step boundaries"):
            trace_back(x, field, 0.0, 0.4, np.array(bad))


def test_cell_averages_of_exp_match_the_exact_cell_averages(mesh_factory):
    """From the exact log f at the centroids (t = 4), the cell averages of e^{fit} match the exact
    cell averages (adaptive quadrature) over the tail: median below 2e-4 and falling ≥ 8× from
    nside 16 to 32 (third order or better)."""
    from spherepde.analysis.exact import zero_temperature_density
    from spherepde.models.attention import AttentionModel
    from spherepde.models.initial import Uniform
    from spherepde.validation import tails

    model = AttentionModel(tails.PAPER_B, tails.PAPER_V, math.inf)
    medians = []
    for nside in (16, 32):
        mesh = mesh_factory(nside)
        z = mesh.centroids @ scipy.linalg.expm(-4.0 * M).T
        g = 8.0 - math.log(4 * math.pi) - 3 * np.log(np.linalg.norm(z, axis=1))
        exact = tails.exact_cell_averages(mesh, zero_temperature_density(model, Uniform(), 4.0))
        medians.append(tails.tail_errors(mesh, PolynomialInterpolant(mesh).cell_averages_of_exp(g), exact)["median"])
    assert medians[0] < 2e-4 and medians[0] / medians[1] > 8, medians


def test_slopes_of_a_linear_function_converge_at_second_order(mesh_factory):
    """g(y) = ⟨w, y⟩ has the tangent gradient w − ⟨w, y⟩y: each cell's fit gives it at the centroid
    with an error O(h²) (the quadratic fit of a function with cubic terms in the gnomonic
    coordinates); the limiter leaves it alone away from g's extrema."""
    w = np.array([0.3, -1.2, 0.7])
    errors = []
    for nside in (8, 16):
        interp = PolynomialInterpolant(mesh_factory(nside))
        c = interp.centroids
        exact = w - (c @ w)[:, None] * c
        g = c @ w
        free = np.abs(g) < 0.8 * np.linalg.norm(w)  # away from the extrema of g
        plain, limited = interp.slopes(g, limited=False), interp.slopes(g)
        np.testing.assert_array_equal(limited[free], plain[free])
        errors.append(np.abs(plain - exact).max() / np.linalg.norm(w))
    assert errors[0] < 0.03  # ~ h² = 0.016 at nside 8
    assert math.log2(errors[0] / errors[1]) > 1.7  # 1.75 from 8 to 16, 1.88 from 16 to 32


def test_limited_slopes_make_no_new_extremum_at_a_cut(mesh_factory):
    """A jump of 10 in g across a great circle: the limited profile g_c + ⟨γ, y − y_c⟩ stays at
    every vertex of every cell within its stencil's range (the unlimited one overshoots), and a
    stencil with −inf (f = 0) gives a zero slope."""
    import healpy as hp

    mesh = mesh_factory(8)
    interp = PolynomialInterpolant(mesh)
    g = np.where(interp.centroids[:, 0] > 0.1, 0.0, -10.0)
    corners = np.transpose(hp.boundaries(8, np.arange(mesh.npix), step=1, nest=True), (0, 2, 1))
    stencil = np.where(interp.stencil >= 0, g[np.maximum(interp.stencil, 0)], g[:, None])
    for limited, overshoots in ((True, False), (False, True)):
        slopes = interp.slopes(g, limited=limited)
        at_vertices = g[:, None] + np.einsum("cvk,ck->cv", corners - interp.centroids[:, None, :], slopes)
        beyond = max((at_vertices - stencil.max(axis=1)[:, None]).max(),
                     (stencil.min(axis=1)[:, None] - at_vertices).max())
        assert (beyond > 1e-9) == overshoots
    g[0] = -np.inf
    slopes = interp.slopes(g)
    assert np.all(slopes[(interp.stencil == 0).any(axis=1)] == 0.0)


LAYER_AXIS = np.array([0.0, 0.0, 1.0])
LAYER_PUSH = np.array([0.6, 0.0, 0.8])


def layer_field(s, points, sharpness=20.0):
    """A tangent field with a switching layer at the equator, as between two clusters:
    v = tanh(k x·e) P_x a (P_x = I − x xᵀ; e the layer's axis, a the push), and its surface
    divergence div_S v = −2 tanh(k x·e) a·x + k sech²(k x·e) (e·a − (x·e)(x·a)), exact."""
    z = points @ LAYER_AXIS
    along = points @ LAYER_PUSH
    switch = np.tanh(sharpness * z)
    v = switch[:, None] * (LAYER_PUSH[None, :] - along[:, None] * points)
    div = -2.0 * switch * along + sharpness * (1.0 - switch ** 2) * (LAYER_PUSH @ LAYER_AXIS - z * along)
    return v, div


def test_a_step_tolerance_halves_the_steps_that_cross_a_switching_layer():
    """trace_back with a tolerance through a layer 1/20 rad wide (about a step's displacement):
    steps of 0.1 whose Simpson − trapezoid on div v exceeds tolerance × step are halved, and ∫div v
    then stays within tolerance × Δt of the exact one (steps of 0.0025) where the fixed steps do
    not, through fewer points than uniform halving (the sum of the points of every call);
    tolerance ∞ is the fixed steps to the bit, tolerance 0 the halved steps (to round-off)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(400, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    points = []

    def counted(s, p):
        points.append(len(p))
        return layer_field(s, p)

    tolerance, dt = 0.01, 0.4
    exact = trace_back(x, layer_field, 0.0, dt, 160)
    coarse = trace_back(x, layer_field, 0.0, dt, 4)
    halved = trace_back(x, counted, 0.0, dt, 8)
    halved_points, points[:] = sum(points), []
    adaptive = trace_back(x, counted, 0.0, dt, 4, tolerance=tolerance)
    adaptive_points = sum(points)
    assert np.abs(coarse[1] - exact[1]).max() > 2 * tolerance * dt  # the fixed steps miss the target
    assert np.abs(adaptive[1] - exact[1]).max() < tolerance * dt
    assert np.abs(adaptive[0] - exact[0]).max() < 0.2 * np.abs(coarse[0] - exact[0]).max()
    assert adaptive_points < 0.9 * halved_points, (adaptive_points, halved_points)
    never = trace_back(x, layer_field, 0.0, dt, 4, tolerance=math.inf)
    assert np.array_equal(never[0], coarse[0]) and np.array_equal(never[1], coarse[1])
    always = trace_back(x, layer_field, 0.0, dt, 4, tolerance=0.0)
    assert np.abs(always[0] - halved[0]).max() < 1e-13 and np.abs(always[1] - halved[1]).max() < 1e-12
    for scheme, bad in (("heun", 0.1), ("rk4", -1.0)):
        with pytest.raises(ValueError, match="tolerance"):
            trace_back(x, layer_field, 0.0, dt, 4, scheme, tolerance=bad)
