"""Harmonic (Funk–Hecke) summation at moderate β against independent references: scipy's
modified spherical Bessel functions and Legendre polynomials (addition theorem), and the direct
sum for random B, V and smooth and rough densities."""

import numpy as np
import pytest
from scipy.special import eval_legendre, spherical_in

from spherepde.geometry.mesh import HealpixMesh
from spherepde.models.attention import AttentionModel
from spherepde.models.initial import VonMisesFisher
from spherepde.summation import attention_field
from spherepde.summation.harmonic import (
    PAD,
    _legendre_tables,
    harmonic_degree,
    harmonic_row,
    row_length,
    scaled_bessel,
    work_arrays,
)


@pytest.mark.parametrize("kappa", [1e-10, 0.3, 7.0, 60.0, 250.0])
def test_scaled_bessel_matches_scipy(kappa):
    n = 80
    ours = np.empty(n)
    scaled_bessel(kappa, kappa, ours)
    ref = spherical_in(np.arange(n), kappa) * np.exp(-kappa)
    big = ref > 1e-290
    np.testing.assert_allclose(ours[big], ref[big], rtol=1e-12)


def _degree_of_entries(L):
    """Degree ℓ of every harmonic_row entry (−1 for padding), from its documented layout."""
    half = (L + 1) * (L + 2) // 2 + PAD
    deg = np.full(row_length(L), -1)
    for l in range(L + 1):
        for m in range(l + 1):
            deg[l * (l + 1) // 2 + m] = l
            if m > 0:
                deg[half + l * (l + 1) // 2 + m] = l
    return deg


@pytest.mark.parametrize("L", [1, 6, 40])
def test_harmonic_row_satisfies_the_addition_theorem(L):
    """Σ_m Y_ℓm(x) Y_ℓm(z) = (2ℓ + 1)/(4π) P_ℓ(⟨x, z⟩), including points at the poles; the
    padding and the s₀ entries are exactly 0 (the contraction sums over them); the degree
    weights multiply degree ℓ."""
    qmm, a, b = _legendre_tables(L)
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(6, 3))
    pts[0] = [0.0, 0.0, 1.0]
    pts[1] = [0.0, 0.0, -1.0]
    pts /= np.linalg.norm(pts, axis=1, keepdims=True)
    weights = rng.uniform(0.5, 2.0, L + 1)
    rows = np.zeros((len(pts), row_length(L)))
    weighted = np.zeros((len(pts), row_length(L)))
    for i, p in enumerate(pts):
        harmonic_row(p[0], p[1], p[2], L, qmm, a, b, np.ones(L + 1), *work_arrays(L), rows[i])
        harmonic_row(p[0], p[1], p[2], L, qmm, a, b, weights, *work_arrays(L), weighted[i])
    deg = _degree_of_entries(L)
    assert np.all(rows[:, deg < 0] == 0.0)
    np.testing.assert_allclose(weighted[:, deg >= 0], rows[:, deg >= 0] * weights[deg[deg >= 0]], rtol=1e-14)
    for i in range(len(pts)):
        for j in range(len(pts)):
            c = float(np.clip(pts[i] @ pts[j], -1.0, 1.0))
            keep = deg >= 0
            sums = np.bincount(deg[keep], weights=(rows[i] * rows[j])[keep], minlength=L + 1)
            exact = (2 * np.arange(L + 1) + 1) / (4 * np.pi) * eval_legendre(np.arange(L + 1), c)
            np.testing.assert_allclose(sums, exact, atol=1e-12)


def test_degree_grows_like_root_kappa():
    degrees = [harmonic_degree(k)[0] for k in (10.0, 40.0, 160.0)]
    assert degrees[0] < degrees[1] < degrees[2]
    assert 1.6 < degrees[2] / degrees[1] < 2.4  # ≈ √4


def _densities(mesh, rng):
    smooth = VonMisesFisher(np.array([0.0, 0.6, 0.8]), 3.0).cell_averages(mesh)
    rough = rng.uniform(0.0, 1.0, mesh.npix) ** 4
    rough[rng.uniform(size=mesh.npix) < 0.2] = 0.0  # empty cells
    return {"smooth": smooth, "rough": rough}


@pytest.mark.parametrize("beta", [0.1, 1.0, 10.0, 30.0])
def test_harmonic_matches_direct(beta):
    rng = np.random.default_rng(int(beta * 10) + 1)
    mesh = HealpixMesh(8)
    model = AttentionModel(rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    x = mesh.edge_points.reshape(-1, 3)
    for name, f in _densities(mesh, rng).items():
        out = {}
        for method in ("direct", "harmonic"):
            stats = {}
            v, d, m = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True,
                                      method=method, stats=stats)
            out[method] = (v.copy(), d.copy(), m.copy(), stats)
        assert out["harmonic"][3]["method"] == "harmonic"
        np.testing.assert_allclose(out["harmonic"][2], out["direct"][2], atol=1e-10, err_msg=name)
        np.testing.assert_allclose(out["harmonic"][0], out["direct"][0], atol=1e-9, err_msg=name)
        scale = np.maximum(1.0, np.abs(out["direct"][1]))
        assert np.max(np.abs(out["harmonic"][1] - out["direct"][1]) / scale) < 1e-8, name


def hard_case(nside, beta):
    """All mass near one point, random non-symmetric B and V."""
    mesh = HealpixMesh(nside)
    rng = np.random.default_rng(nside)
    model = AttentionModel(np.eye(3) + 0.2 * rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), beta)
    return mesh, model, VonMisesFisher(np.array([0.0, 0.0, 1.0]), 200.0).cell_averages(mesh)


def harmonic_and_direct(model, mesh, f):
    """(m, div, stats) of the harmonic sum and (m, div) of the direct sum at the edge points."""
    x = mesh.edge_points.reshape(-1, 3)
    stats = {}
    _, div, m = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="harmonic",
                                stats=stats)
    m, div = m.copy(), div.copy()
    _, ref_div, ref = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="direct")
    return m, div, stats, ref, ref_div


@pytest.mark.parametrize("nside, beta, how", [(8, 30.0, "direct"), (16, 30.0, "tree"), (16, 10.0, "direct")])
def test_hard_targets_are_resummed(nside, beta, how, monkeypatch):
    """All mass near one point: for targets whose kernel points away from it, Z is ~e^{−2κ} of
    the expansion's terms; those must be detected and re-summed, by the tree where it pays
    (enough sources, β large enough: summation.field.tree_cap_fraction < 0.6), else directly (here with
    the tilted regional expansions switched off, so that every target handed back takes that
    route). m_β and div v then agree with the direct sum to the tolerance."""
    import spherepde.summation.harmonic as harmonic_sum

    monkeypatch.setattr(harmonic_sum, "TILT_MAX_NSIDE", 0)
    mesh, model, f = hard_case(nside, beta)
    m, div, stats, ref, ref_div = harmonic_and_direct(model, mesh, f)
    assert stats["fallbacks"] > 0 and stats["fallback_method"] == how and stats["tilted"] == 0
    np.testing.assert_allclose(m, ref, atol=2e-10)
    scale = beta * np.linalg.norm(model.V, 2) * np.linalg.norm(model.B, 2)
    np.testing.assert_allclose(div, ref_div, atol=4e-10 * scale + 1e-9)


@pytest.mark.parametrize("nside, beta", [(16, 30.0), (16, 10.0), (8, 10.0)])
def test_tilted_regions_serve_the_hard_targets(nside, beta):
    """The same hard case with the tilted regional expansions on: the targets the global
    expansion hands back are mostly served by them (their terms span at most e^{2|w|} of the sum,
    not e^{2κ}), to the tolerance of the direct sum."""
    mesh, model, f = hard_case(nside, beta)
    m, div, stats, ref, ref_div = harmonic_and_direct(model, mesh, f)
    assert stats["tilted"] > stats["fallbacks"], stats
    np.testing.assert_allclose(m, ref, atol=2e-10)
    scale = beta * np.linalg.norm(model.V, 2) * np.linalg.norm(model.B, 2)
    np.testing.assert_allclose(div, ref_div, atol=4e-10 * scale + 1e-9)


def test_two_peaks_over_a_tiny_floor():
    """A late, concentrated state: two vMF peaks over a floor 1e-11 of their height, the paper's
    matrices at β = 30. The global expansion cannot resolve the near-empty targets; with the
    tilted regions m_β still agrees with the direct sum everywhere."""
    from spherepde.models.initial import Mixture

    mesh = HealpixMesh(16)
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), 30.0)
    peaks = Mixture([0.5, 0.5], [VonMisesFisher([1.0, 0.0, 0.0], 300.0), VonMisesFisher([-1.0, 0.0, 0.0], 300.0)])
    f = peaks.cell_averages(mesh) + 1e-11 * 300 / (4 * np.pi)
    m, div, stats, ref, ref_div = harmonic_and_direct(model, mesh, f)
    assert stats["tilted"] > len(m) // 10, stats
    np.testing.assert_allclose(m, ref, atol=2e-10)
    np.testing.assert_allclose(div, ref_div, atol=1e-8 * np.abs(ref_div).max())


def test_second_region_level_serves_what_the_first_hands_on(monkeypatch):
    """Two peaks over a 1e-11 floor: the nside-4 regions (|w| ≤ 7.6) leave a few hundred targets
    over budget, which the nside-8 regions (|w| ≤ 3.8, terms spanning e^{3.8} less) all serve, to
    the tolerance of the direct sum; with one level those go to the fallback instead."""
    import spherepde.summation.harmonic as harmonic_sum
    from spherepde.models.initial import Mixture

    mesh = HealpixMesh(16)
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), 30.0)
    peaks = Mixture([0.5, 0.5], [VonMisesFisher([1.0, 0.0, 0.0], 300.0), VonMisesFisher([-1.0, 0.0, 0.0], 300.0)])
    f = peaks.cell_averages(mesh) + 1e-11 * 300 / (4 * np.pi)
    m, div, stats, ref, ref_div = harmonic_and_direct(model, mesh, f)
    assert stats["fallbacks"] == 0 and stats["tilted"] == stats["handed_back"].sum(), stats
    np.testing.assert_allclose(m, ref, atol=2e-10)
    np.testing.assert_allclose(div, ref_div, atol=1e-8 * np.abs(ref_div).max())
    monkeypatch.setattr(harmonic_sum, "TILT_LEVELS", 1)
    _, _, one_level, _, _ = harmonic_and_direct(model, mesh, f)
    assert one_level["fallbacks"] > 100, one_level


def test_region_level_and_source_rows():
    """tilt_region_nside: the coarsest level whose pixel radius keeps |w| ≤ TILT_MAX_W, none for
    large β; _source_rows: harmonic_row of each source."""
    import healpy as hp

    from spherepde.summation.harmonic import (
        TILT_MAX_W,
        _legendre_tables,
        _source_rows,
        harmonic_row,
        row_length,
        tilt_region_nside,
    )

    for beta_sigma in (1.0, 10.0, 30.0, 60.0):
        nside = tilt_region_nside(beta_sigma)
        assert beta_sigma * hp.max_pixrad(nside) <= TILT_MAX_W
        assert nside == 1 or beta_sigma * hp.max_pixrad(nside // 2) > TILT_MAX_W
    assert tilt_region_nside(1e4) is None
    L = 7
    qmm, a, b = _legendre_tables(L)
    rng = np.random.default_rng(2)
    y = rng.normal(size=(9, 3))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    out = np.zeros((9, row_length(L)))
    _source_rows(y, L, qmm, a, b, out)
    for j in range(9):
        row = np.zeros(row_length(L))
        harmonic_row(y[j, 0], y[j, 1], y[j, 2], L, qmm, a, b, np.ones(L + 1), *work_arrays(L), row)
        np.testing.assert_array_equal(out[j], row)


def test_routed_targets_skip_the_global_expansion():
    """route: the targets handed back by one call go straight to the tilted regions in the next;
    the answers stay within the tolerance of the direct sum, and the mask handed back contains
    the route (those targets never meet the global expansion). A route of every target serves
    them all without the global expansion."""
    mesh, model, f = hard_case(16, 30.0)
    x = mesh.edge_points.reshape(-1, 3)
    _, ref_div, ref = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="direct")
    stats = {}
    attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="harmonic", stats=stats)
    first = stats["handed_back"]
    assert 0 < first.sum() < len(x)
    for route in (first, np.ones(len(x), dtype=bool)):
        stats = {}
        _, div, m = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="harmonic",
                                    stats=stats, route=route)
        assert np.all(stats["handed_back"][route])
        assert stats["tilted"] + stats["fallbacks"] == stats["handed_back"].sum()
        np.testing.assert_allclose(m, ref, atol=2e-10)
        scale = 30.0 * np.linalg.norm(model.V, 2) * np.linalg.norm(model.B, 2)
        np.testing.assert_allclose(div, ref_div, atol=4e-10 * scale + 1e-9)


def test_region_cache_reuses_only_what_it_may():
    """The per-region tilted coefficients are reused for the same sources, masses and model,
    computed only for regions not yet held, and recomputed when the masses or β change: every
    answer equals a fresh region_coefficients (to round-off: BLAS may sum a row of a
    (regions × sources) product in another order when the number of regions differs; seen with
    OpenBLAS 0.3.31, 1 ulp)."""
    from spherepde.summation.harmonic import _RegionCache, region_coefficients

    rng = np.random.default_rng(4)
    y = rng.normal(size=(300, 3))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    mu = rng.random(300)
    shifts = rng.normal(size=(5, 3)) * 4
    regions = np.arange(10, 15)
    cache = _RegionCache()
    calls = []

    def check(mu, beta_key, pick):
        got = cache.coefficients(y, mu, 2, regions[pick], shifts[pick], 6, beta_key)
        want = region_coefficients(y, mu, shifts[pick], 6)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-14 * np.abs(w).max())
        calls.append(len(cache.rows))

    check(mu, 1.0, [0, 2])
    check(mu, 1.0, [2, 3, 4])  # 2 reused, 3 and 4 added
    assert calls == [2, 4]
    got = cache.coefficients(y, mu, 4, regions[[2]], shifts[[2]], 5, 1.0)  # a second level, same measure
    want = region_coefficients(y, mu, shifts[[2]], 5)[0]
    np.testing.assert_allclose(got[0], want, rtol=1e-13, atol=1e-14 * np.abs(want).max())
    assert len(cache.rows) == 5  # held beside the first level's
    calls.append(len(cache.rows))
    check(mu, 1.0, [0, 2])  # the first level's rows are still there
    assert calls == [2, 4, 5, 5]
    del calls[2:]
    check(mu * 1.5, 1.0, [2])  # other masses: a fresh cache
    check(mu * 1.5, 2.0, [2, 4])  # another model: fresh again
    assert calls[2:] == [1, 2]


def test_the_cache_holds_several_measures_and_their_global_coefficients(monkeypatch):
    """The fields of two states evaluated in turn (the tails' paths, linear in time between two
    states) compute each state's coefficients once: global and tilted, both equal to fresh ones;
    beyond MEASURES measures the one used least recently is computed again."""
    import spherepde.summation.harmonic as harmonic

    computed = []
    original = harmonic._coefficients

    def counted(sources, mu, L, qmm, a, b, parts):
        computed.append(len(mu))
        return original(sources, mu, L, qmm, a, b, parts)

    monkeypatch.setattr(harmonic, "_coefficients", counted)
    cache = harmonic._RegionCache()
    rng = np.random.default_rng(8)
    y = rng.normal(size=(200, 3))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    measures = [rng.random(200) for _ in range(cache.MEASURES + 1)]
    qmm, a, b = harmonic._legendre_tables(6)
    for mu in measures[:2] * 3:  # two states in turn
        got = cache.global_coefficients(y, mu, 6, 12)
        parts = np.empty((1, 12, harmonic.row_length(6)))
        original(y, mu, 6, qmm, a, b, parts)
        np.testing.assert_allclose(got, parts.sum(axis=0), rtol=1e-13, atol=1e-15)
    assert len(computed) == 2
    shifts, regions = rng.normal(size=(3, 3)) * 4, np.arange(3)
    for mu in measures[:2] * 2:
        cache.coefficients(y, mu, 2, regions, shifts, 6, "model")
    assert [len(entry[1]["model"]) for entry in cache.held] == [3, 3]  # each measure's regions, kept
    for mu in measures[2:]:  # MEASURES − 1 more: the first measure is dropped
        cache.global_coefficients(y, mu, 6, 12)
    assert len(cache.held) == cache.MEASURES
    cache.global_coefficients(y, measures[1], 6, 12)  # still held
    cache.global_coefficients(y, measures[0], 6, 12)  # computed again
    assert len(computed) == 2 + (len(measures) - 2) + 1


@pytest.mark.parametrize("L", [1, 6, 30])
def test_moment_maps_give_the_moment_coefficients(L):
    """moment_maps: the coefficients Σ_j μ_j g_q(y_j) Y_k(y_j) of the ten moments g_q = 1, y, y yᵀ
    from the degree-(L + 2) coefficients of the masses alone, against the sums themselves (exact
    up to rounding: g_q Y_k has degree ≤ L + 2); fails if the quadrature is one node short."""
    from spherepde.summation.harmonic import (
        _legendre_tables,
        _moment_factors,
        _source_rows,
        moment_maps,
        row_length,
    )

    rng = np.random.default_rng(L)
    y = rng.normal(size=(400, 3))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    mu = rng.random(400)
    rows = np.zeros((400, row_length(L)))
    rows2 = np.zeros((400, row_length(L + 2)))
    _source_rows(y, L, *_legendre_tables(L), rows)
    _source_rows(y, L + 2, *_legendre_tables(L + 2), rows2)
    d = mu @ rows2
    g = _moment_factors(y, 10)
    maps = moment_maps(L)
    assert len(maps) == 10
    for q in range(10):
        direct = (mu * g[q]) @ rows
        np.testing.assert_allclose(maps[q] @ d, direct, rtol=0, atol=1e-13 * np.abs(direct).max())


def test_cost_model_picks_harmonic_for_many_points_at_moderate_beta():
    from spherepde.summation import choose_method

    rng = np.random.default_rng(0)
    x = rng.normal(size=(50_000, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), 5.0)
    assert choose_method(model, x, 50_000) == "harmonic"
    assert choose_method(model, x[:2000], 3072) == "direct"  # few points: the direct sum


def test_many_sources_mixed_density_stays_within_tol():
    """nside 32 (12 288 sources): a bump on a 30 % uniform floor, β = 10 — the error estimate must
    neither let errors above tol through nor send the floor's targets to the direct sum."""
    from spherepde.models.initial import Mixture, Uniform

    mesh = HealpixMesh(32)
    model = AttentionModel(np.diag([-1.0, -1.0, 1.0]), np.diag([-1.0, 1.0, -2.0]), 10.0)
    law = Mixture([0.7, 0.3], [VonMisesFisher([0.6, 0.3, 0.74], 8.0), Uniform()])
    f = law.cell_averages(mesh)
    x = mesh.edge_points.reshape(-1, 3)[::16]
    stats = {}
    v, d, m = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True,
                              method="harmonic", stats=stats)
    m, d = m.copy(), d.copy()
    _, d_ref, m_ref = attention_field(model, mesh.centroids, f * mesh.area, x, want_div=True, method="direct")
    assert stats["fallbacks"] < len(x) // 20
    np.testing.assert_allclose(m, m_ref, atol=1e-10)
    assert np.max(np.abs(d - d_ref) / np.maximum(1.0, np.abs(d_ref))) < 1e-8


def test_contraction_kernels_match_numpy():
    """_contract4 (four points × four moments) and _accumulate4 (four sources into the
    coefficients) against plain numpy matrix products, for the 4- and 12-row coefficient layouts."""
    from spherepde.summation.harmonic import _accumulate4, _contract4

    rng = np.random.default_rng(7)
    nk = row_length(9)
    rows = rng.normal(size=(4, nk))
    for nmom in (4, 12):
        coef_t = rng.normal(size=(nmom, nk))
        mom = np.full((nmom, 8), np.nan)
        for q0 in range(0, nmom, 4):
            _contract4(rows, coef_t, q0, mom, 4)
        np.testing.assert_allclose(mom[:, 4:], coef_t @ rows.T, rtol=1e-12, atol=1e-12)
        assert np.isnan(mom[:, :4]).all()  # other points untouched
        g = rng.normal(size=(nmom, 4))
        acc = coef_t.copy()
        _accumulate4(rows, g, acc)
        np.testing.assert_allclose(acc, coef_t + g @ rows, rtol=1e-12, atol=1e-12)


def test_evaluation_does_not_depend_on_its_work_chunks():
    """_evaluate splits the targets into chunks of blocks by the thread count; every target is
    computed alone within its block, so any chunking gives bit-identical results, for target
    counts that do not fill a block and for none at all."""
    from spherepde.summation.harmonic import _evaluate, _legendre_tables

    rng = np.random.default_rng(11)
    L = 12
    qmm, a, b = _legendre_tables(L)
    coef_t = rng.normal(size=(12, row_length(L)))
    coef_t[0] = np.abs(coef_t[0]) + 50.0  # a positive partition function: targets are finished
    BT = rng.normal(size=(3, 3))
    V = rng.normal(size=(3, 3))
    for n in (0, 1, 17, 16 * 40 + 3):
        x = rng.normal(size=(n, 3))
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
        results = []
        for nthreads in (1, 2, 7):
            out = (np.full((n, 3), np.nan), np.full(n, np.nan), np.full((n, 3), np.nan))
            fallback = np.full(n, 9, dtype=np.int8)
            _evaluate(x, coef_t, L, qmm, a, b, 0.0, np.zeros(2), np.zeros(L + 1), 1e-3, BT, 2.0,
                      np.zeros(3), V, True, *out, fallback, nthreads, np.empty(0), 0.0, np.empty(0))
            results.append((out, fallback))
        for out, fallback in results:
            assert np.isin(fallback, (0, 1)).all()  # every target was reached
            assert n == 0 or (fallback == 0).mean() > 0.9
            np.testing.assert_array_equal(fallback, results[0][1])
            for got, ref in zip(out, results[0][0]):
                assert np.isfinite(got[fallback == 0]).all()
                np.testing.assert_array_equal(got, ref)  # NaN (not served) where ref is NaN
