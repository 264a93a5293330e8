"""The log-partition function log Z(x) = ln Σ_j μ_j e^{β⟨Bᵀx, y_j⟩} from every summation path.

Independent references: a long-double log-sum-exp (tests/numpy_reference.log_partition), the
closed form of a vMF density, Z = (sinh|w|/|w|)/(sinh κ/κ) with w = βBᵀx + κμ (docs/theory.md#formulas-and-exact-solutions),
integrated by a product Gauss rule, and, with the near-field correction, a fine sub-square
quadrature of the kernel over the corrected cells (as tests/summation/test_near_field.py checks the
moments).
"""

import math

import numpy as np
import numpy_reference as ref
import pytest
from scipy.special import logsumexp

from spherepde.geometry.mesh import HealpixMesh
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import VonMisesFisher
from spherepde.summation import (
    AttentionField,
    NearField,
    attention_field,
    softmax_direct_reference,
)
from spherepde.summation.harmonic import sphere_quadrature

EPS = np.finfo(float).eps


def _unit(rng, n):
    x = rng.normal(size=(n, 3))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _masses(kind, n, rng):
    """Masses spanning many decades: log-uniform over 1e-320 … 1 (subnormals included), or one
    heavy source (1) over 1e-300 and gaps (zeros: empty cells)."""
    if kind == "decades":
        mu = 10.0 ** rng.uniform(-320.0, 0.0, n)
        mu[::7] = 0.0
        return mu
    mu = np.full(n, 1e-300)
    mu[::5] = 0.0
    mu[n // 3] = 1.0
    return mu


def _log_z(model, sources, masses, targets, **kwargs):
    out = np.full(len(targets), np.nan)
    attention_field(model, sources, masses, targets, log_partition=out, **kwargs)
    return out


def _model(beta, seed=0):
    rng = np.random.default_rng(seed)
    return AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)


def _allowed(reference, scale):
    """Rounding budget of a float64 sum: a few ε per unit of the largest exponent β|Bᵀx|."""
    return 64.0 * EPS * (1.0 + scale + np.abs(np.asarray(reference, dtype=float)))


@pytest.mark.parametrize("kind", ["decades", "heavy"])
@pytest.mark.parametrize("beta", [0.5, 3.0, 30.0, 1000.0])
@pytest.mark.parametrize("want_div", [False, True])
def test_direct_and_reference_kernels_against_long_double(beta, kind, want_div):
    rng = np.random.default_rng(1)
    model = _model(beta)
    y = _unit(rng, 3000)
    x = _unit(rng, 200)
    mu = _masses(kind, len(y), rng)
    want = ref.log_partition(x, model.B, beta, y, mu)
    scale = beta * np.linalg.norm(x @ model.B, axis=1)
    got = _log_z(model, y, mu, x, method="direct", want_div=want_div)
    assert np.all(np.abs(got - want.astype(float)) <= _allowed(want, scale))
    # the scalar reference kernel, natural base and the masses' own logs
    out = (np.empty((len(x), 3)), np.empty(len(x)), np.empty((len(x), 3)), np.full(len(x), np.nan))
    with np.errstate(divide="ignore"):
        log_mass = np.log(mu)
    softmax_direct_reference(x, np.ascontiguousarray(model.B.T), beta, y, log_mass, model.V, want_div, *out)
    assert np.all(np.abs(out[3] - want.astype(float)) <= _allowed(want, scale))
    # and the float64 scipy log-sum-exp agrees with the long-double one (the reference is sane)
    with np.errstate(divide="ignore"):
        plain = logsumexp(np.log(mu)[None, :] + beta * (x @ model.B) @ y.T, axis=1)
    assert np.all(np.abs(plain - want.astype(float)) <= _allowed(want, scale))


def test_masses_as_given_not_normalised():
    """Scaling the masses by c adds ln c (and c = 1e-300 stays finite)."""
    rng = np.random.default_rng(2)
    model = _model(5.0)
    y = _unit(rng, 500)
    x = _unit(rng, 50)
    mu = rng.random(500)
    base = _log_z(model, y, mu, x, method="direct")
    for c in (1e-300, 1e-3, 1e200):
        np.testing.assert_allclose(_log_z(model, y, c * mu, x, method="direct"), base + math.log(c),
                                   rtol=0, atol=1e-12 * (1 + abs(math.log(c))))


@pytest.mark.parametrize("kind", ["decades", "heavy"])
@pytest.mark.parametrize("beta", [30.0, 300.0, 1000.0])
@pytest.mark.parametrize("tol", [1e-6, 1e-10])
def test_tree_within_its_tolerance(beta, kind, tol):
    """The tree neglects at most tol·Z per target: |Δ log Z| ≤ tol (plus rounding)."""
    rng = np.random.default_rng(3)
    model = _model(beta, seed=4)
    y = _unit(rng, 12000)
    x = _unit(rng, 300)
    mu = _masses(kind, len(y), rng)
    want = ref.log_partition(x, model.B, beta, y, mu).astype(float)
    stats = {}
    got = _log_z(model, y, mu, x, method="tree", tol=tol, stats=stats)
    assert stats["method"] == "tree"
    scale = beta * np.linalg.norm(x @ model.B, axis=1)
    assert np.all(np.abs(got - want) <= tol + _allowed(want, scale))


def _harmonic_case(case, rng):
    """(model, sources, masses, targets) that send the harmonic sums down one path: the global
    expansion (smooth masses, moderate β), the tilted regions (a 1e-9 floor under a peak: the
    global budget fails where the density is small), the re-summation (β too large for regions;
    by the tree, or directly below TREE_MIN_SOURCES sources)."""
    y = _unit(rng, 2000 if case == "resummed-direct" else 6000)
    x = _unit(rng, 400)
    peak = np.exp(8.0 * (y @ np.array([0.0, 0.6, 0.8]) - 1.0))
    if case == "global":
        return _model(4.0, seed=5), y, 0.5 + rng.random(len(y)), x
    if case == "tilted":
        return AttentionModel(np.eye(3), np.eye(3), 12.0), y, peak + 1e-9, x
    return _model(400.0, seed=6), y, peak + 1e-12, x


@pytest.mark.parametrize("case", ["global", "tilted", "resummed", "resummed-direct"])
@pytest.mark.parametrize("want_div", [False, True])
def test_harmonic_every_path(case, want_div):
    rng = np.random.default_rng(7)
    model, y, mu, x = _harmonic_case(case, rng)
    tol = 1e-10
    want = ref.log_partition(x, model.B, model.beta, y, mu).astype(float)
    stats = {}
    got = _log_z(model, y, mu, x, method="harmonic", tol=tol, stats=stats, want_div=want_div)
    assert stats["method"] == "harmonic"
    served_global = len(x) - int(stats["handed_back"].sum())
    if case == "global":
        assert served_global == len(x)
    elif case == "tilted":
        assert stats["tilted"] > 50
    else:
        assert stats["fallbacks"] > len(x) // 2
        assert stats["fallback_method"] == ("direct" if case == "resummed-direct" else "tree")
    scale = model.beta * np.linalg.norm(x @ model.B, axis=1)
    assert np.all(np.abs(got - want) <= tol + _allowed(want, scale))
    # routed: the same values through the second call's route
    got2 = _log_z(model, y, mu, x, method="harmonic", tol=tol, stats={}, want_div=want_div,
                  route=stats["handed_back"])
    assert np.all(np.abs(got2 - want) <= tol + _allowed(want, scale))


@pytest.mark.parametrize("method", ["direct", "tree", "harmonic"])
@pytest.mark.parametrize("beta,kappa", [(0.5, 2.0), (6.0, 3.0), (20.0, 10.0)])
def test_vmf_closed_form(method, beta, kappa):
    """f = vMF(μ, κ): Z(x) = ∫ e^{β⟨Bᵀx, y⟩} f dA = (sinh|w|/|w|)/(sinh κ/κ), w = βBᵀx + κμ,
    against every method on a product Gauss rule (exact to degree 2n − 1)."""
    rng = np.random.default_rng(8)
    B = rng.normal(size=(3, 3)) / 2.0
    model = AttentionModel(B, np.eye(3), beta)
    law = VonMisesFisher(np.array([0.3, -0.4, 0.866]), kappa)
    y, w = sphere_quadrature(90)
    x = _unit(rng, 100)
    ww = np.linalg.norm(beta * x @ B + kappa * law.mu, axis=1)

    def log_sinhc(k):  # ln(sinh k / k), stable
        return k + np.log(-np.expm1(-2.0 * k) / (2.0 * k))

    want = log_sinhc(ww) - log_sinhc(kappa)
    got = _log_z(model, y, law.density(y) * w, x, method=method, tol=1e-12)
    assert np.all(np.abs(got - want) <= 1e-11 * (1 + np.abs(want)))


def _fine_cell_integral(mesh, cell, a, split=24, order=6):
    """∫_cell e^{⟨a, y⟩} dA (a = βBᵀx) by split × split sub-squares × an order² Gauss rule
    (spherepde.geometry.mesh, plain numpy), as ln of the integral (the kernel scaled by e^{−|a|})."""
    anorm = np.linalg.norm(a)
    total = 0.0
    size = 1.0 / split
    for i in range(split):
        for j in range(split):
            pts, w = mesh.square_quadrature(np.array([cell]), i * size, j * size, size, order)
            total += np.sum(np.exp(pts[0] @ a - anorm) * w) * mesh.area * size**2
    return math.log(total) + anorm


@pytest.mark.parametrize("method", ["direct", "tree"])
@pytest.mark.parametrize("beta", [2000.0, 30000.0])
def test_near_field_partition_includes_the_cell_integrals(method, beta):
    """With the near field Z = Σ_far μ_c e^{β⟨Bᵀx, y_c⟩} + Σ_near f_c ∫_cell e^{β⟨Bᵀx, y⟩} dA:
    a fine quadrature over the corrected cells, the centre terms elsewhere (and it differs from
    the uncorrected log Z by far more than the tolerance: the test can tell)."""
    rng = np.random.default_rng(9)
    model = _model(beta, seed=10)
    mesh = HealpixMesh(8)
    f = VonMisesFisher(np.array([1.0, 0.0, 0.0]), 3.0).cell_averages(mesh) * 1e-200
    f[::11] *= 1e-100  # many decades, as a late state
    x = _unit(rng, 12)
    near = NearField(mesh, model, x)
    assert near.active > 0
    masses = f * mesh.area
    got = _log_z(model, mesh.centroids, masses, x, method=method, near=near)
    plain = _log_z(model, mesh.centroids, masses, x, method=method)
    want = np.empty(len(x))
    for i in range(len(x)):
        a = beta * x[i] @ model.B
        cells = near.cells[i][near.cells[i] >= 0]
        far = np.setdiff1d(np.arange(mesh.npix), cells)
        terms = [np.log(masses[far]) + mesh.centroids[far] @ a]
        terms.append(np.log(f[cells]) + np.array([_fine_cell_integral(mesh, c, a) for c in cells]))
        want[i] = logsumexp(np.concatenate(terms))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 * np.abs(want).max())
    assert np.abs(plain - want).max() > 1e-3


def test_attention_field_object_with_atoms():
    """AttentionField passes log_partition through; atoms are point masses in Z."""
    rng = np.random.default_rng(11)
    model = _model(10.0, seed=12)
    mesh = HealpixMesh(4)
    f = 0.1 + rng.random(mesh.npix)
    x = _unit(rng, 30)
    points = _unit(rng, 2)
    pm = np.array([0.3, 1e-250])
    field = AttentionField(model, mesh, x, method="direct", near_field=False)
    got = np.empty(len(x))
    field(f, points=points, point_masses=pm, log_partition=got)
    sources = np.concatenate([mesh.centroids, points])
    masses = np.concatenate([f * mesh.area, pm])
    want = ref.log_partition(x, model.B, model.beta, sources, masses).astype(float)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_zero_temperature_gives_nan_and_bad_arrays_are_refused():
    rng = np.random.default_rng(13)
    model = _model(math.inf, seed=14)
    x = _unit(rng, 10)
    out = np.zeros(10)
    attention_field(model, None, None, x, log_partition=out)
    assert np.isnan(out).all()
    finite = _model(2.0)
    y = _unit(rng, 20)
    for bad in (np.zeros(9), np.zeros(10, dtype=np.float32), np.zeros((10, 2))[:, 0]):
        with pytest.raises(ValueError, match="log_partition"):
            attention_field(finite, y, np.ones(20), x, log_partition=bad)


def test_not_asking_changes_nothing():
    """The outputs are bit-identical with and without log_partition, for every method."""
    rng = np.random.default_rng(15)
    model = _model(8.0, seed=16)
    y = _unit(rng, 4000)
    x = _unit(rng, 100)
    mu = rng.random(4000) + 1e-8
    for method in ("direct", "tree", "harmonic"):
        a = [o.copy() for o in attention_field(model, y, mu, x, want_div=True, method=method)]
        b = [o.copy() for o in attention_field(model, y, mu, x, want_div=True, method=method,
                                               log_partition=np.empty(len(x)))]
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
